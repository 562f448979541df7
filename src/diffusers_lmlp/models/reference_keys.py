"""Renaming a reference checkpoint's state dict to our module names, shared by the reference converters."""

import re
from collections.abc import Callable

import torch


def rename_reference_keys(
    state_dict: dict[str, torch.Tensor], rules: list[tuple[str, str]], unexpected: Callable[[str], Exception]
) -> dict[str, torch.Tensor]:
    """Rename every key by the first rule whose pattern matches it; tensors are not copied or reshaped.

    A leading `module.` (a DDP-wrapped save) is stripped first.

    Args:
        state_dict (`dict[str, torch.Tensor]`): The reference state dict.
        rules (`list[tuple[str, str]]`): (regular expression, replacement) pairs, applied with `re.subn` to the whole
            key; the first that matches wins.
        unexpected (`Callable[[str], Exception]`): The error to raise for a key no rule matches, given the key.

    Returns:
        `dict[str, torch.Tensor]`: The renamed state dict.
    """
    converted = {}
    for key, tensor in state_dict.items():
        key = key.removeprefix("module.")
        for pattern, replacement in rules:
            new_key, count = re.subn(pattern, replacement, key)
            if count:
                converted[new_key] = tensor
                break
        else:
            raise unexpected(key)
    return converted
