"""Loading, saving and casting a backbone: strictly, safetensors only, without this machine's folders, and refusing
what torch's dynamic int8 quantization cannot do (save, adapt, compute beside non-float32 weights).

diffusers only warns when a checkpoint's keys differ from the model's; ours refuses unless `strict=False`. Two gaps
need diffusers' private `_load_pretrained_model` overridden (the package's only such override): a sharded
checkpoint's keys come from its index, which may list a tensor no shard holds, and with a `device_map` diffusers fails
on weights no tensor filled (tests/models/test_strict_loading.py says when they close). A saved config's local
`_name_or_path` (a path with the username, that a push would publish) is left out.
"""

import inspect
import logging as std_logging  # `hub push --with-code` puts all modules in one namespace: `logging` is diffusers'
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Self

import torch
from diffusers import ModelMixin
from diffusers.configuration_utils import FrozenDict
from diffusers.utils import logging
from safetensors import safe_open
from torch import nn


logger = logging.get_logger(__name__)

# The arguments of `from_pretrained` that say where a checkpoint's config.json is, besides the folder or repo id.
CONFIG_LOCATION_ARGUMENTS = ("subfolder", "cache_dir", "revision", "token", "local_files_only", "proxies")


def listed(names: list[str]) -> str:
    """`names` for a message: the first 5, then how many more."""
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def key_mismatch(missing: list[str], unexpected: list[str]) -> str:
    """The keys a checkpoint and a model do not share, in words."""
    parts = []
    if missing:
        weights = "1 weight of the model is" if len(missing) == 1 else f"{len(missing)} weights of the model are"
        parts.append(f"{weights} missing from it ({listed(sorted(missing))})")
    if n := len(unexpected):
        tensors = "1 tensor in it is not a weight" if n == 1 else f"{n} tensors in it are not weights"
        parts.append(f"{tensors} of the model ({listed(sorted(unexpected))})")
    return "; ".join(parts)


class StrictLoadingMixin(ModelMixin):
    """`ModelMixin` whose `from_pretrained` reads safetensors only and refuses a checkpoint that misses a weight."""

    @classmethod
    def from_pretrained(
        cls, pretrained_model_name_or_path: str | os.PathLike, *, strict: bool = True, **kwargs
    ) -> Self | tuple[Self, dict[str, list]]:
        """`ModelMixin.from_pretrained`, reading safetensors only (never unpickling) and refusing a checkpoint whose
        keys are not exactly the model's, naming them. Every loader, pipelines' included, comes here. With
        `strict=False` it warns, gives missing weights a new model's values and drops the other tensors."""
        if kwargs.get("use_safetensors") is False:
            raise ValueError(
                f"{cls.__name__} loads safetensors weights only, so that loading never unpickles; got "
                "use_safetensors=False. Convert trusted pickled weights once: torch.load(..., weights_only=True), "
                "load_state_dict, save_pretrained."
            )
        if kwargs.get("use_flashpack"):
            raise ValueError(
                f"{cls.__name__} loads safetensors weights only, whose keys it checks against the model's; got "
                "use_flashpack=True. Leave use_flashpack unset."
            )
        kwargs["use_safetensors"] = True
        output_loading_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(pretrained_model_name_or_path, output_loading_info=True, **kwargs)
        missing, unexpected = sorted(info["missing_keys"]), sorted(info["unexpected_keys"])
        if missing or unexpected:
            location, name = os.fspath(pretrained_model_name_or_path), cls.__name__
            mismatch = key_mismatch(missing, unexpected)
            if kwargs.get("subfolder"):
                location = os.path.join(location, kwargs["subfolder"])
            if not strict:
                logger.warning(
                    f"Loaded the {name} at {location} with strict=False, although the checkpoint does not match it: "
                    f"{mismatch}. The missing weights are initialised as in a new model, the other tensors dropped."
                )
                return (model, info) if output_loading_info else model
            where = {key: kwargs[key] for key in CONFIG_LOCATION_ARGUMENTS if key in kwargs}
            saved = cls.load_config(pretrained_model_name_or_path, **where).get("_class_name")
            if saved is not None and saved != name:
                cause = (
                    f"Its config.json names the class {saved}, not {name}: load it with {saved}.from_pretrained(...), "
                    "or load the pipeline folder with LMLPPipeline.from_pretrained."
                )
            else:
                cause = "The checkpoint is incomplete or from another model or version: save it again with save_pretrained."
            raise ValueError(
                f"The checkpoint at {location} does not match the {name} it is loaded as: {mismatch}. {cause} To load "
                f"it anyway (missing weights new, other tensors dropped), pass strict=False to {name}.from_pretrained "
                "(for a pipeline, load the transformer so and pass it: LMLPPipeline.from_pretrained(folder, "
                "transformer=transformer))."
            )
        return (model, info) if output_loading_info else model

    @classmethod
    def _load_pretrained_model(
        cls, model, state_dict, resolved_model_file, pretrained_model_name_or_path, loaded_keys, **kwargs
    ):
        """diffusers' loader with the module docstring's two gaps closed."""
        quantized = kwargs.get("hf_quantizer") is not None
        # diffusers 0.40 (not 0.42.1) also loads shards from a DDUF archive (`dduf_entries`): entries, not files.
        if state_dict is None and not quantized and not kwargs.get("dduf_entries"):
            # The keys from the shards' headers; a tensor in two shards is refused (the later would override).
            shard_of = {}
            for file in resolved_model_file:
                with safe_open(file, framework="pt") as shard:
                    for key in shard.keys():
                        if key in shard_of:
                            raise ValueError(
                                f"The tensor {key} is in two shards of one checkpoint, {os.path.basename(shard_of[key])} "
                                f"and {os.path.basename(file)}: the checkpoint is damaged; save it again."
                            )
                        shard_of[key] = file
            loaded_keys = list(shard_of)
        result = super()._load_pretrained_model(
            model, state_dict, resolved_model_file, pretrained_model_name_or_path, loaded_keys, **kwargs
        )
        _, missing_keys, _, mismatched_keys, *_ = result
        unloaded = missing_keys + [key for key, *_ in mismatched_keys]
        if unloaded and not quantized:
            # diffusers builds a model it loads without initialising it: give these a new model's values, on the
            # loaded weights' device where diffusers left them on meta.
            arguments = inspect.signature(type(model).__init__).parameters
            fresh = type(model)(**{k: v for k, v in model.config.items() if k in arguments}).state_dict()
            current = model.state_dict()
            device = next((t.device for t in current.values() if not t.is_meta), torch.device("cpu"))
            values = {
                key: fresh[key].to(device if current[key].is_meta else current[key].device, current[key].dtype)
                for key in unloaded
            }
            model.load_state_dict(values, strict=False, assign=True)
        return result


class EmptyFp32ModulesWarning(std_logging.Filter):
    """Drops diffusers' warning, on every `ModelMixin.to(dtype)`, that names no modules to keep in float32."""

    def filter(self, record: std_logging.LogRecord) -> bool:
        return "should be kept in float32: []." not in record.getMessage()


@contextmanager
def no_empty_fp32_warning() -> Iterator[None]:
    """Within the block, `EmptyFp32ModulesWarning` filters diffusers' models logger."""
    logger, empty_warning = std_logging.getLogger("diffusers.models.modeling_utils"), EmptyFp32ModulesWarning()
    logger.addFilter(empty_warning)
    try:
        yield
    finally:
        logger.removeFilter(empty_warning)


def is_dynamically_quantized(module: nn.Module) -> bool:
    """Whether torch's `quantize_dynamic` put `module` in place of a float layer (float32 inputs only, no PEFT)."""
    return type(module).__module__.startswith("torch.ao.nn.quantized.dynamic")


def dynamically_quantized_layers(model: nn.Module) -> list[str]:
    """The names of the layers of `model` that torch's dynamic quantization replaced."""
    return [name for name, module in model.named_modules() if is_dynamically_quantized(module)]


def check_float32_beside_quantized_layers(model: nn.Module) -> None:
    """Raise a `ValueError` when `model` holds dynamically quantized layers and float weights other than float32."""
    layers = dynamically_quantized_layers(model) if model.dtype != torch.float32 else []
    if layers:
        raise ValueError(
            f"{type(model).__name__} has Linear layers that torch's dynamic quantization replaced ({listed(layers)}), "
            f"which compute on float32 inputs, but its other weights are {model.dtype}. Cast it back with "
            ".to(torch.float32), or sample the float model in bf16 instead."
        )


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
