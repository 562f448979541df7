"""Saving without this machine's folders, and only what safetensors can store.

diffusers writes where a component was loaded from (`_name_or_path`) into every saved config: for a local folder an
absolute path, username included, that a push would publish. No loader reads it, so a local path is left out; a Hub
repo id is kept. diffusers fails on torch's quantized layers only after writing `config.json`, so `check_storable`
comes first.
"""

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from diffusers.configuration_utils import FrozenDict

from .loading import listed


def is_local_path(value: Any) -> bool:
    """Whether a config's `_name_or_path` is an absolute path, or a relative one that exists here."""
    return isinstance(value, str | os.PathLike) and (os.path.isabs(value) or os.path.exists(value))


@contextmanager
def local_paths_left_out(*objects: Any) -> Iterator[None]:
    """Within the block, the diffusers configs of `objects` (compiled or not) lack a local `_name_or_path`."""
    changed: list[tuple[Any, FrozenDict]] = []
    for obj in objects:
        obj = getattr(obj, "_orig_mod", obj)  # diffusers saves a compiled model's original module
        config = getattr(obj, "_internal_dict", None)
        if isinstance(config, FrozenDict) and is_local_path(config.get("_name_or_path")):
            changed.append((obj, config))
            obj._internal_dict = FrozenDict({key: value for key, value in config.items() if key != "_name_or_path"})
    try:
        yield
    finally:
        for obj, config in changed:
            obj._internal_dict = config


def check_storable(model: torch.nn.Module) -> None:
    """Raise a `ValueError` if `model`'s state dict holds a non-tensor or a torch-quantized tensor."""
    keys = [k for k, v in model.state_dict().items() if not isinstance(v, torch.Tensor) or v.is_quantized]
    if keys:
        raise ValueError(
            f"{type(model).__name__} holds state that safetensors cannot store ({listed(keys)}): torch's quantized "
            "layers keep their weights packed. Save the model before quantizing it (or quantize with torchao, whose "
            "weights save). Nothing was written."
        )
