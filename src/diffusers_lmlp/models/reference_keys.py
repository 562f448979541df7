"""Renaming a reference checkpoint's state dict to our module names, shared by the reference converters."""

import re
from collections.abc import Callable

import torch


def rename_reference_keys(
    state_dict: dict[str, torch.Tensor], rules: list[tuple[str, str]], unexpected: Callable[[str], Exception]
) -> dict[str, torch.Tensor]:
    """Rename every key (less a DDP `module.` prefix) by the first (pattern, replacement) rule that matches it;
    `unexpected(key)` is the error for a key no rule matches. Tensors are not copied or reshaped."""
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
