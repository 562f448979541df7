"""Saving a model or a pipeline: without the folders of the machine that loaded it, and only what safetensors can store.

diffusers records where each component was loaded from in its config (`_name_or_path`) and writes it back on every
`save_pretrained`. For a component read from a local folder, or from a Hub repo through the local cache, that is an
absolute path of this machine: `/home/<user>/...`, its username included, which a push then publishes. No loader
reads it (diffusers' `from_pretrained` takes the path it is given, and drops the private `_` keys of a saved config),
so it is only bookkeeping. transformers leaves `name_or_path` out of a saved tokenizer for the same reason
(huggingface/transformers#21483). A Hub repo id (`"user/repo"`, what a pipeline loaded by its id records) says where
the model came from and nothing about the machine: it is kept.

torch's own quantized layers (`torch.ao.quantization.quantize_dynamic`, the eager quantization of a model on a CPU)
keep their int8 weights packed, as Python objects in the state dict, which safetensors cannot store: diffusers and
huggingface_hub fail on them with an `AttributeError`, after `config.json` is written. `check_storable` refuses such a
model before anything is written. (torchao's quantized weights are tensors: they save and load.)
"""

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from diffusers.configuration_utils import FrozenDict

from .loading import listed


def is_local_path(value: Any) -> bool:
    """Whether a config's `_name_or_path` names a place on this machine: an absolute path, or a relative one that
    exists here. A Hub repo id is neither (a relative folder that happens to share its name counts as local)."""
    if not isinstance(value, str | os.PathLike):
        return False
    path = os.fspath(value)
    return os.path.isabs(path) or os.path.exists(path)


@contextmanager
def local_paths_left_out(*objects: Any) -> Iterator[None]:
    """Within the block, the configs of `objects` (diffusers `ConfigMixin`s: a pipeline and its components) have no
    `_name_or_path` where it names a local path; after it, they have it again.

    Everything else in each config stays, and every other key reads the same during the block, so a pipeline that
    samples in another thread meanwhile is unaffected.

    Args:
        *objects: A model, or a pipeline and its components, compiled (`torch.compile`) or not; those without a
            diffusers config (a tokenizer, transformers' models, whose configs do not save the path) are passed over.
    """
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
    """Raise a `ValueError` before anything is written if `model`'s state dict holds what safetensors cannot store:
    an object that is not a tensor, or a tensor of torch's quantized dtypes (`qint8`, ...).

    Args:
        model (`torch.nn.Module`): The model about to be saved.

    Raises:
        `ValueError`: It names the keys and says to save the model before quantizing it.
    """
    keys = [
        key for key, value in model.state_dict().items() if not isinstance(value, torch.Tensor) or value.is_quantized
    ]
    if keys:
        raise ValueError(
            f"{type(model).__name__} holds state that safetensors cannot store ({listed(keys)}): torch's quantized layers "
            "(torch.ao.quantization.quantize_dynamic) keep their weights packed. Save the model before quantizing it, "
            "and quantize it again after loading; or quantize with torchao (diffusers' TorchAoConfig), whose weights "
            "save. Nothing was written."
        )
