"""Finding and reading a LoRA file: a `.safetensors` file, one inside a folder or one in a Hub repo; never a pickle."""

import json
import os
from typing import Any

import safetensors
import torch
from diffusers.loaders.lora_base import LORA_ADAPTER_METADATA_KEY, LORA_WEIGHT_NAME_SAFE
from huggingface_hub import hf_hub_download


# What JSON calls the types `json.loads` returns, but objects.
JSON_TYPES = {list: "array", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}


def refuse_pickle(name: str) -> None:
    """Raise unless `name` is a safetensors file; called before the file is opened or downloaded."""
    if not name.endswith(".safetensors"):
        raise ValueError(
            f"{name} is not a safetensors file; LoRA weights load from safetensors only, never from a pickle (.bin, "
            ".pt), which can run code. Convert a trusted file once with safetensors.torch.save_file."
        )


def check_weight_name(weight_name: str) -> None:
    """Raise unless `weight_name` is a safetensors file's path inside the folder it is read from or written to."""
    refuse_pickle(weight_name)
    if os.path.isabs(weight_name) or ".." in weight_name.replace("\\", "/").split("/"):
        raise ValueError(
            f"weight_name={weight_name!r} leads out of the folder; pass the name of a file inside it (or its "
            "subfolder=...)."
        )


def lora_file(
    source: str | os.PathLike,
    weight_name: str | None = None,
    subfolder: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    force_download: bool = False,
    local_files_only: bool = False,
    token: str | bool | None = None,
    revision: str | None = None,
) -> str:
    """The local path of a LoRA file: `source`, or `weight_name` (under `subfolder`) in the folder or Hub repo
    `source` (the other arguments are `hf_hub_download`'s)."""
    source = os.fspath(source)
    if os.path.isfile(source):
        if weight_name is not None or subfolder is not None:
            raise ValueError(f"{source} is a file: pass its folder to choose a file with weight_name or subfolder.")
        refuse_pickle(source)
        return source
    weight_name = LORA_WEIGHT_NAME_SAFE if weight_name is None else weight_name
    check_weight_name(weight_name)
    if not os.path.isdir(source):
        return hf_hub_download(
            source,
            weight_name,
            subfolder=subfolder,
            revision=revision,
            cache_dir=cache_dir,
            force_download=force_download,
            local_files_only=local_files_only,
            token=token,
        )
    folder = os.path.join(source, subfolder) if subfolder else source
    if subfolder and os.path.commonpath([os.path.abspath(folder), os.path.abspath(source)]) != os.path.abspath(source):
        raise ValueError(
            f'subfolder={subfolder!r} leads out of {source}; pass a folder inside it, such as subfolder="loras".'
        )
    if not os.path.isdir(folder):
        raise ValueError(f"{source} has no subfolder {subfolder!r} ({folder} does not exist).")
    path = os.path.join(folder, weight_name)
    if not os.path.isfile(path):
        raise ValueError(
            f"{folder} has no {weight_name} (it holds {sorted(os.listdir(folder)) or 'nothing'}); pass weight_name=... "
            "to load another safetensors file."
        )
    return path


def read_lora_file(path: str) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """The tensors of a safetensors LoRA file and the adapter config in its header (None when it has none)."""
    try:
        with safetensors.safe_open(path, framework="pt") as file:
            header = file.metadata() or {}
            state_dict = {key: file.get_tensor(key) for key in file.keys()}
    except safetensors.SafetensorError as error:
        raise ValueError(
            f"{path} is not a valid safetensors file ({error}); save LoRA weights with LMLPPipeline.save_lora_weights."
        ) from error
    if LORA_ADAPTER_METADATA_KEY not in header:
        return state_dict, None
    raw = header[LORA_ADAPTER_METADATA_KEY]
    try:
        metadata = json.loads(raw)
    except json.JSONDecodeError as error:
        found = f"malformed JSON ({error})"
    else:
        if isinstance(metadata, dict):
            return state_dict, metadata
        found = f"a JSON {JSON_TYPES[type(metadata)]}, {raw[:80]}"
    raise ValueError(
        f"{path}: the header entry {LORA_ADAPTER_METADATA_KEY!r} must be the adapter's LoraConfig as a JSON object "
        f"(lora_config.to_dict(), as save_lora_weights writes it), but it is {found}. Save the LoRA again with it."
    )


def read_lora_source(source, kwargs: dict) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None, str]:
    """The tensors, adapter config and name (for errors) of a LoRA given as a state dict, or located by `source` and
    `lora_file`'s options in `kwargs`."""
    if kwargs.pop("use_safetensors", None) not in (None, True):
        raise ValueError(
            "LoRA weights load from safetensors files only, never unpickled: use_safetensors=False is not supported."
        )
    if isinstance(source, dict):
        if kwargs:
            raise ValueError(f"{sorted(kwargs)} locate a file; they do not apply to a state dict.")
        return source, None, "The state dict"
    path = lora_file(source, **kwargs)
    return (*read_lora_file(path), path)
