"""Reading a LoRA (a `.safetensors` file, in a folder or a Hub repo; never a pickle) and loading it into a backbone,
checked (`load_checked_adapter`): any key it cannot place (diffusers skips it), NaN weights and a mistyped `LoraConfig`
are refused; adapters on tied weights (`target_parameters`) are injected from their config, as peft 0.21 requires."""

import json
import math
import os
from collections.abc import Callable
from typing import Any

import safetensors
import torch
from diffusers.loaders.lora_base import LORA_ADAPTER_METADATA_KEY, LORA_WEIGHT_NAME_SAFE
from diffusers.utils import get_adapter_name, logging
from huggingface_hub import hf_hub_download
from torch import nn

from .loading import is_dynamically_quantized, listed


logger = logging.get_logger(__name__)

# The only keys of a LoRA file: peft's A (r, in) and B (out, r) matrices of each adapted layer.
LORA_KEY_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


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
            source, weight_name, subfolder=subfolder, revision=revision, cache_dir=cache_dir,
            force_download=force_download, local_files_only=local_files_only, token=token,
        )  # fmt: skip
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


def _check_component_keys(state_dict: dict[str, torch.Tensor], prefix: str, source: str) -> None:
    """Raise unless `state_dict` holds tensors, each keyed `<prefix>.<peft key>`."""
    if not state_dict:
        raise ValueError(
            f"{source} holds no tensors, so it would load as an adapter that changes nothing. Save the LoRA with "
            f"LMLPPipeline.save_lora_weights(folder, {prefix}_lora_layers=get_peft_model_state_dict({prefix}))."
        )
    foreign = sorted(key for key in state_dict if not key.startswith(f"{prefix}."))
    if len(foreign) == len(state_dict):
        found = (
            f"holds no LoRA weights for the {prefix}: none of its {len(foreign)} keys has the `{prefix}.` prefix "
            f"({listed(foreign)})"
        )
    elif foreign:
        found = f"has LoRA keys without the `{prefix}.` prefix: {listed(foreign)}"
    else:
        return
    raise ValueError(
        f"{source} {found}. LMLPPipeline loads LoRA keys `{prefix}.<peft key>`, as save_lora_weights writes them (a "
        f"`{prefix}.save_lora_adapter` file has bare keys): save it again with LMLPPipeline.save_lora_weights."
    )


def _unwrapped_name(name: str) -> str:
    """A module's name without peft's `base_layer` wrappers."""
    return ".".join(part for part in name.split(".") if part != "base_layer")


def _adapted_shape(module: nn.Module, name: str, target_parameters: list[str]) -> tuple[int, int]:
    """The (out, in) shape of the weight a LoRA on `module` adapts: an nn.Linear's, or a `target_parameters` one
    ("<module suffix>.<parameter>")."""
    if isinstance(module, nn.Linear):
        return module.out_features, module.in_features
    for target in target_parameters:
        suffix, parameter = target.rsplit(".", 1)
        if (name == suffix or name.endswith(f".{suffix}")) and parameter in dict(
            module.named_parameters(recurse=False)
        ):
            return tuple(getattr(module, parameter).shape)
    if is_dynamically_quantized(module):
        raise ValueError(
            f"The LoRA adapts {name}, a Linear that torch's dynamic quantization (quantize_dynamic) replaced, which "
            "PEFT cannot adapt: load it into the float model, fuse it (pipe.fuse_lora(), pipe.unload_lora_weights()) "
            "and quantize after."
        )
    raise ValueError(
        f"The LoRA adapts {name}, a {type(module).__name__}, not an nn.Linear: a tied weight is adapted as a "
        "parameter, so save with transformer_lora_adapter_metadata=lora_config.to_dict() of a LoraConfig with "
        "target_parameters."
    )


def _check_lora_state_dict(
    state_dict: dict[str, torch.Tensor], transformer: nn.Module, target_parameters: list[str]
) -> set[str]:
    """Raise unless every key is a LoRA matrix of a layer of `transformer` of fitting shape; return the layers."""
    not_lora = sorted(key for key in state_dict if not key.endswith(LORA_KEY_SUFFIXES))
    if not_lora:
        raise ValueError(
            f"Keys that are not LoRA matrices: {listed(not_lora)}; a LoRA file holds only `<layer>.lora_A.weight` and "
            "`<layer>.lora_B.weight`, as get_peft_model_state_dict(transformer) returns them."
        )
    layers = sorted({key.rsplit(".lora_", 1)[0] for key in state_dict})
    unpaired = [layer for layer in layers if not all(layer + suffix in state_dict for suffix in LORA_KEY_SUFFIXES)]
    if unpaired:
        raise ValueError(f"LoRA layers with lora_A or lora_B missing: {listed(unpaired)}. The file is incomplete.")
    from peft.tuners.tuners_utils import BaseTunerLayer

    base = {
        _unwrapped_name(name): module
        for name, module in transformer.named_modules()
        if not isinstance(module, BaseTunerLayer) and not any(part.startswith("lora_") for part in name.split("."))
    }
    name = type(transformer).__name__
    unknown = [layer for layer in layers if _unwrapped_name(layer) not in base]
    if unknown:
        raise ValueError(
            f"LoRA keys for layers the {name} does not have: {listed(unknown)}; load it into the model it was trained for."
        )
    for layer in layers:
        module_name = _unwrapped_name(layer)
        out_features, in_features = _adapted_shape(base[module_name], module_name, target_parameters)
        down, up = state_dict[f"{layer}.lora_A.weight"], state_dict[f"{layer}.lora_B.weight"]
        rank = down.shape[0]
        if down.shape != (rank, in_features) or up.shape != (out_features, rank):
            raise ValueError(
                f"The LoRA of {layer} has lora_A {tuple(down.shape)} and lora_B {tuple(up.shape)}, but the layer maps "
                f"{in_features} to {out_features} features: they must be (r, {in_features}) and ({out_features}, r) "
                "with one rank r. It was trained for a model of another config."
            )
    return set(layers)


def _check_adapted(transformer: nn.Module, adapter_name: str, layers: set[str]) -> None:
    """Raise unless the layers that `adapter_name` adapts in `transformer` are exactly `layers`."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    adapted = {
        name
        for name, module in transformer.named_modules()
        if isinstance(module, BaseTunerLayer) and adapter_name in getattr(module, "lora_A", {})
    }
    if adapted != layers:
        missing, extra = sorted(layers - adapted), sorted(adapted - layers)
        if any(".base_layer." in layer for layer in missing) and len(getattr(transformer, "peft_config", {})) > 1:
            reason = (
                "peft 0.21 adds no adapter to a layer inside another adapter's tied-weight wrapper (the AsymMixer's "
                "fc2): load one such adapter at a time (unload_lora_weights() or delete_adapters(...) first)."
            )
        else:
            reason = "Save the LoRA with the LoraConfig it was trained with (lora_config.to_dict() as metadata)."
        raise ValueError(
            f"Adapter {adapter_name!r} does not adapt the layers the LoRA file has weights for: not adapted "
            f"{listed(missing) or 'none'}; adapted without weights {listed(extra) or 'none'}. {reason}"
        )


def _refuse_non_finite_updates(model: nn.Module, adapter_names: list[str] | None) -> None:
    """Raise if the update ΔW that fusing `adapter_names` (default: the active ones) would add holds NaN or inf."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for name, module in model.named_modules():
        if not isinstance(module, BaseTunerLayer):
            continue
        for adapter in adapter_names or module.active_adapters:
            if adapter in module.lora_A and not torch.isfinite(module.get_delta_weight(adapter)).all():
                raise ValueError(
                    f"Adapter {adapter!r} holds NaN or inf in its update of {name}, so nothing was fused "
                    "(safe_fusing=True): load a sound copy, or delete_adapters it."
                )


def load_checked_adapter(
    transformer: nn.Module, source, prefix: str | None, hotswap: bool, kwargs: dict, load: Callable
) -> None:
    """`PeftAdapterMixin.load_lora_adapter` (`load`, with its arguments), refusing what it would load silently or
    fail on inside peft; safetensors only. A half-loaded adapter is removed."""
    adapter_name, metadata = kwargs.pop("adapter_name", None), kwargs.pop("metadata", None)
    low_cpu_mem_usage, _pipeline = kwargs.pop("low_cpu_mem_usage", False), kwargs.pop("_pipeline", None)
    if kwargs.pop("network_alphas", None) is not None:
        raise ValueError("network_alphas (kohya-style alphas) are not supported: pass the LoraConfig as metadata.")
    state_dict, saved, where = read_lora_source(source, kwargs)
    metadata = saved if metadata is None else metadata
    if prefix is not None:
        _check_component_keys(state_dict, prefix, where)
        state_dict = {key.removeprefix(f"{prefix}."): value for key, value in state_dict.items()}
        if metadata is not None:
            metadata = {k.removeprefix(f"{prefix}."): v for k, v in metadata.items() if k.startswith(f"{prefix}.")}
    elif not state_dict:
        _check_component_keys(state_dict, "transformer", where)
    _check_lora_config(metadata, where)
    non_finite = sorted(key for key, value in state_dict.items() if not torch.isfinite(value).all())
    if non_finite:
        raise ValueError(f"{where} holds NaN or inf in {listed(non_finite)}: the LoRA is broken; load a sound copy.")
    target_parameters = list((metadata or {}).get("target_parameters") or [])
    layers = _check_lora_state_dict(state_dict, transformer, target_parameters)
    if target_parameters and hotswap:
        raise ValueError(
            "hotswap is not supported for an adapter on tied weights (target_parameters): load it under a new "
            "adapter_name, or delete_adapters the old one first."
        )
    if adapter_name is None:
        adapter_name = get_adapter_name(transformer)
    loaded = list(getattr(transformer, "peft_config", {}))
    if hotswap and adapter_name not in loaded:
        raise ValueError(
            f"hotswap replaces a loaded adapter: adapter_name must be one of {loaded}, not {adapter_name!r}."
        )
    if not hotswap and adapter_name in loaded:
        raise ValueError(f"Adapter name {adapter_name!r} is already in use; choose another, or pass hotswap=True.")
    logger.info(f"Loading LoRA {adapter_name}.")
    try:
        if target_parameters:  # peft 0.21's inject_adapter_in_model refuses a state dict for such a config
            from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict

            config = LoraConfig(**metadata)
            inject_adapter_in_model(
                config, transformer, adapter_name=adapter_name, low_cpu_mem_usage=low_cpu_mem_usage
            )
            transformer._hf_peft_config_loaded = True
            set_peft_model_state_dict(transformer, state_dict, adapter_name, low_cpu_mem_usage=low_cpu_mem_usage)
        else:
            load(
                state_dict, prefix=None, adapter_name=adapter_name, metadata=metadata, _pipeline=_pipeline,
                low_cpu_mem_usage=low_cpu_mem_usage, hotswap=hotswap,
            )  # fmt: skip
        _check_adapted(transformer, adapter_name, layers)
    except Exception as error:
        if not hotswap:  # remove the half-loaded adapter, and peft's layers when no adapter is left
            if adapter_name in getattr(transformer, "peft_config", {}):
                transformer.delete_adapters(adapter_name)
            if not getattr(transformer, "peft_config", None):
                transformer.unload_lora()
        if isinstance(error, RuntimeError) and "size mismatch" in str(error):
            raise ValueError(
                f"The LoRA's matrices do not have the rank that its config gives (r, rank_pattern in the file's "
                f"metadata): {error}. Save the LoRA with the LoraConfig it was trained with."
            ) from error
        raise


# The `LoraConfig` fields a LoRA file's metadata may set: field -> (test, requirement), checked before peft sees them.
_LORA_CONFIG_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "r": (lambda v: type(v) is int and v > 0, "a positive integer"),
    "lora_alpha": (lambda v: _is_finite_number(v) and v > 0, "a positive finite number"),
    "lora_dropout": (lambda v: _is_finite_number(v) and 0 <= v < 1, "a number in [0, 1)"),
    "target_modules": (lambda v: v is None or isinstance(v, str) or _is_strings(v), "a string or a list of them"),
    "target_parameters": (lambda v: v is None or _is_strings(v), "a list of strings"),
    "rank_pattern": (lambda v: isinstance(v, dict) and all(type(r) is int and r > 0 for r in v.values()),
                     "an object of positive integers"),
    "alpha_pattern": (lambda v: isinstance(v, dict) and all(_is_finite_number(a) and a > 0 for a in v.values()),
                      "an object of positive finite numbers"),
}  # fmt: skip


def _is_finite_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _is_strings(value: Any) -> bool:
    return isinstance(value, list | tuple) and all(isinstance(item, str) for item in value)


def _check_lora_config(metadata: dict[str, Any] | None, where: str) -> None:
    """Raise, naming the field, for a `LoraConfig` field of the wrong type or value."""
    for field, (ok, requirement) in _LORA_CONFIG_FIELDS.items():
        if metadata and field in metadata and not ok(metadata[field]):
            raise ValueError(
                f"{where}: the LoRA's config has {field}={metadata[field]!r}, which must be {requirement}. Save the "
                "LoRA with the LoraConfig it was trained with (lora_config.to_dict() as metadata)."
            )
