"""A backbone loads every weight from its checkpoint, or says which it could not (`StrictLoadingMixin`).

diffusers' `ModelMixin.from_pretrained` loads a checkpoint whose keys differ from the model's with a warning only:
the weights the file lacks hold no values (it builds the model without initialising it: on the meta device with
`low_cpu_mem_usage=True`, its default, and as uninitialised memory without), and the tensors the model has no place
for are dropped. The usual cause is a wrong class (an L-MLP folder loaded as `MoEMLPModel`) or a damaged checkpoint.
The backbones' `from_pretrained` refuses both unless called with `strict=False`, reading the keys from diffusers' own
report (`output_loading_info`), which it computes on every path (`low_cpu_mem_usage` on or off, `device_map`,
sharded checkpoints) from the checkpoint's keys and the model's `state_dict()`. Two gaps cannot be closed by a check
after the public call, so `StrictLoadingMixin` overrides diffusers' private `_load_pretrained_model`, the one override
of a private method in this package:
- for a sharded checkpoint diffusers takes the keys from the index file, which may list a tensor no shard holds, and
  then reports nothing missing; the keys are read from the shards' headers instead;
- with a `device_map`, diffusers moves the model before `from_pretrained` returns, and fails on a weight no tensor
  filled ("Cannot copy out of meta tensor"); those weights get a new model's values first.
tests/test_strict_loading.py checks both gaps on diffusers alone, and the signature overridden: when diffusers closes
them or changes the method, those tests fail, and the override can go.
"""

import inspect
import os
from typing import Self

import torch
from diffusers import ModelMixin
from diffusers.utils import logging
from safetensors import safe_open
from torch import nn


logger = logging.get_logger(__name__)

# Names printed in a message before "and N more".
MAX_LISTED = 5
# The arguments of `from_pretrained` that say where a checkpoint's config.json is, besides the folder or repo id.
CONFIG_LOCATION_ARGUMENTS = ("subfolder", "cache_dir", "revision", "token", "local_files_only", "proxies")


def listed(names: list[str]) -> str:
    """`names` for a message: the first `MAX_LISTED`, then how many more."""
    more = f" and {len(names) - MAX_LISTED} more" if len(names) > MAX_LISTED else ""
    return ", ".join(names[:MAX_LISTED]) + more


def checkpoint_location(pretrained_model_name_or_path: str | os.PathLike, subfolder: str | None) -> str:
    """Where a checkpoint was read from, for a message: the folder or repo id, and its subfolder."""
    location = os.fspath(pretrained_model_name_or_path)
    return os.path.join(location, subfolder) if subfolder else location


def saved_class_name(
    model_class: type[nn.Module], pretrained_model_name_or_path: str | os.PathLike, kwargs: dict
) -> str | None:
    """The class that a checkpoint's `config.json` names (`_class_name`), read where `from_pretrained` read it.

    Args:
        model_class (`type[nn.Module]`): The class it was loaded as (a diffusers `ModelMixin`).
        pretrained_model_name_or_path (`str` or `os.PathLike`): As given to `from_pretrained`.
        kwargs (`dict`): The other arguments of `from_pretrained`; those that locate the file are used.
    """
    location = {key: kwargs[key] for key in CONFIG_LOCATION_ARGUMENTS if key in kwargs}
    return model_class.load_config(pretrained_model_name_or_path, **location).get("_class_name")


def key_mismatch(missing: list[str], unexpected: list[str]) -> str:
    """The keys a checkpoint and a model do not share, in words: how many of each, and the first few by name.

    Args:
        missing (`list[str]`): Keys of the model's `state_dict()` that the checkpoint lacks.
        unexpected (`list[str]`): Keys of the checkpoint that the model does not have.
    """
    parts = []
    if missing:
        weights = "1 weight of the model is" if len(missing) == 1 else f"{len(missing)} weights of the model are"
        parts.append(f"{weights} missing from it ({listed(sorted(missing))})")
    if unexpected:
        tensors = (
            "1 tensor in it is not a weight"
            if len(unexpected) == 1
            else f"{len(unexpected)} tensors in it are not weights"
        )
        parts.append(f"{tensors} of the model ({listed(sorted(unexpected))})")
    return "; ".join(parts)


def refusal(
    model_class: str, saved_class: str | None, location: str, missing: list[str], unexpected: list[str]
) -> str:
    """The error of a strict load whose checkpoint does not match the model: what differs, why, and what to do.

    Args:
        model_class (`str`): The class the checkpoint was loaded as.
        saved_class (`str`, *optional*): The class its `config.json` names (`_class_name`), if any.
        location (`str`): Where the checkpoint was read from.
        missing (`list[str]`): Keys of the model that the checkpoint lacks.
        unexpected (`list[str]`): Keys of the checkpoint that the model does not have.
    """
    if saved_class is not None and saved_class != model_class:
        cause = (
            f"Its config.json names the class {saved_class}, not {model_class}: load it with the class in "
            f"config.json, {saved_class}.from_pretrained(...), or load the whole pipeline folder with "
            "LMLPPipeline.from_pretrained, which takes each class from model_index.json."
        )
    else:
        cause = (
            f"The checkpoint is incomplete, or was written by another model or version than the {model_class} its "
            "config.json describes: save it again from the trained model with save_pretrained."
        )
    return (
        f"The checkpoint at {location} does not match the {model_class} it is loaded as: "
        f"{key_mismatch(missing, unexpected)}. {cause} To load it anyway, with the missing weights initialised as in "
        f"a new model and the other tensors dropped, pass strict=False to {model_class}.from_pretrained (for a "
        f"pipeline, load the transformer that way and pass it: LMLPPipeline.from_pretrained(folder, "
        "transformer=transformer))."
    )


def warn_non_strict(model_class: str, location: str, missing: list[str], unexpected: list[str]) -> None:
    """Log what a load with `strict=False` initialised and dropped.

    Args:
        model_class (`str`): The class the checkpoint was loaded as.
        location (`str`): Where the checkpoint was read from.
        missing (`list[str]`): Keys of the model that the checkpoint lacks: initialised as in a new model.
        unexpected (`list[str]`): Keys of the checkpoint that the model does not have: dropped.
    """
    logger.warning(
        f"Loaded the {model_class} at {location} with strict=False, although the checkpoint does not match it: "
        f"{key_mismatch(missing, unexpected)}. The missing weights are initialised as in a new, untrained model, the "
        "other tensors dropped."
    )


def checkpoint_keys(files: list[str]) -> list[str]:
    """The tensor names in safetensors files, read from their headers (no tensor is read).

    Args:
        files (`list[str]`): The shards of a checkpoint.
    """
    keys = []
    for file in files:
        with safe_open(file, framework="pt") as shard:
            keys.extend(shard.keys())
    return keys


def initialise_unloaded(model: nn.Module, keys: list[str]) -> None:
    """Give the weights that no checkpoint tensor filled the values of a newly built model of the same config.

    diffusers builds a model it loads without initialising it (`no_init_weights`, and the meta device with
    `low_cpu_mem_usage`), so a weight the checkpoint does not fill holds no values until it is set here.

    Args:
        model (`nn.Module`): The loaded model, a diffusers `ModelMixin` whose `__init__` arguments are its config
            fields.
        keys (`list[str]`): Keys of its `state_dict()`: the missing weights, and those diffusers re-creates for
            `ignore_mismatched_sizes=True`.
    """
    arguments = inspect.signature(type(model).__init__).parameters
    fresh = type(model)(**{key: value for key, value in model.config.items() if key in arguments}).state_dict()
    current = model.state_dict()
    # A weight left on the meta device goes where the loaded ones are.
    loaded_device = next((tensor.device for tensor in current.values() if not tensor.is_meta), torch.device("cpu"))
    values = {
        key: fresh[key].to(loaded_device if current[key].is_meta else current[key].device, current[key].dtype)
        for key in keys
    }
    model.load_state_dict(values, strict=False, assign=True)


class StrictLoadingMixin(ModelMixin):
    """`ModelMixin` whose `from_pretrained` reads safetensors only and refuses a checkpoint that does not fill every
    weight (the module docstring says why the private loader is overridden too)."""

    @classmethod
    def from_pretrained(
        cls, pretrained_model_name_or_path: str | os.PathLike, *, strict: bool = True, **kwargs
    ) -> Self | tuple[Self, dict[str, list]]:
        """`ModelMixin.from_pretrained`, reading safetensors weights only and refusing a checkpoint that does not fill
        every weight.

        Every loader (this one, `LMLPPipeline.from_pretrained`, `DiffusionPipeline.from_pretrained`) comes through
        here, so a folder with only pickled weights (`.bin`) fails instead of being unpickled, and a checkpoint whose
        keys differ from the model's (a weight it lacks, a tensor the model has no place for) fails instead of
        loading with weights that hold no values: a folder loaded as another family's class, or a damaged file. The
        error names the keys and the class in the folder's `config.json`. diffusers would only warn.

        Args:
            pretrained_model_name_or_path (`str` or `os.PathLike`): A Hub repo id or a local folder.
            strict (`bool`, *optional*, defaults to `True`): Refuse a checkpoint whose keys are not exactly the
                model's. With `False` it loads, and a warning names the keys: the weights it lacks are initialised
                as in a new, untrained model, its other tensors are dropped. diffusers' pipeline loaders do not pass
                this argument on: to load a pipeline so, load its transformer with `strict=False` and pass it
                (`LMLPPipeline.from_pretrained(folder, transformer=transformer)`).
            **kwargs: Everything `ModelMixin.from_pretrained` takes (`subfolder`, `dtype`, `variant`,
                `low_cpu_mem_usage`, `device_map`, `output_loading_info`, ...); `use_safetensors` may only be `True`,
                and FlashPack files (`use_flashpack`) are not read. Weights that `ignore_mismatched_sizes=True`
                re-creates are initialised as in a new model.

        Returns:
            The model, or with `output_loading_info=True` the model and diffusers' report (`missing_keys`,
            `unexpected_keys`, `mismatched_keys`, `error_msgs`).

        Raises:
            `ValueError`: `use_safetensors=False`, `use_flashpack=True`, or (with `strict=True`) a checkpoint whose
                keys differ from the model's.
        """
        if kwargs.get("use_safetensors") is False:
            raise ValueError(
                f"{cls.__name__} loads safetensors weights only, so that loading never unpickles; got "
                "use_safetensors=False. Convert trusted pickled weights once by loading them with torch.load(..., "
                "weights_only=True), load_state_dict, and save_pretrained (safetensors is the default)."
            )
        if kwargs.get("use_flashpack"):
            raise ValueError(
                f"{cls.__name__} loads safetensors weights only, whose keys it checks against the model's; got "
                "use_flashpack=True. Load the folder's diffusion_pytorch_model.safetensors (leave use_flashpack unset)."
            )
        kwargs["use_safetensors"] = True
        output_loading_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(pretrained_model_name_or_path, output_loading_info=True, **kwargs)
        missing, unexpected = sorted(info["missing_keys"]), sorted(info["unexpected_keys"])
        if missing or unexpected:
            location = checkpoint_location(pretrained_model_name_or_path, kwargs.get("subfolder"))
            if strict:
                saved_class = saved_class_name(cls, pretrained_model_name_or_path, kwargs)
                raise ValueError(refusal(cls.__name__, saved_class, location, missing, unexpected))
            warn_non_strict(cls.__name__, location, missing, unexpected)
        return (model, info) if output_loading_info else model

    @classmethod
    def _load_pretrained_model(
        cls, model, state_dict, resolved_model_file, pretrained_model_name_or_path, loaded_keys, **kwargs
    ):
        """diffusers' loader with the two gaps of the module docstring closed: a sharded checkpoint's keys come from
        its shards' headers, and the weights no tensor filled (missing, or re-created by `ignore_mismatched_sizes`)
        get a new model's values before a `device_map` moves them. Returns what diffusers returns."""
        quantized = kwargs.get("hf_quantizer") is not None
        # diffusers 0.40 (not 0.42.1) also loads shards from a DDUF archive (`dduf_entries`): entries, not files.
        if state_dict is None and not quantized and not kwargs.get("dduf_entries"):
            loaded_keys = checkpoint_keys(resolved_model_file)
        result = super()._load_pretrained_model(
            model, state_dict, resolved_model_file, pretrained_model_name_or_path, loaded_keys, **kwargs
        )
        _, missing_keys, _, mismatched_keys, *_ = result
        unloaded = missing_keys + [key for key, *_ in mismatched_keys]
        if unloaded and not quantized:
            initialise_unloaded(model, unloaded)
        return result
