"""A backbone loads every weight from its checkpoint, or says which it could not (`StrictLoadingMixin`).

diffusers' `from_pretrained` only warns when a checkpoint's keys differ from the model's, leaving missing weights
without values; ours refuses unless `strict=False`. Two gaps need diffusers' private `_load_pretrained_model`
overridden (the package's only such override): a sharded checkpoint's keys come from its index, which may list a
tensor no shard holds, and with a `device_map` diffusers fails on weights no tensor filled.
tests/models/test_strict_loading.py checks both gaps on diffusers: once they close, drop the override.
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


def key_mismatch(missing: list[str], unexpected: list[str]) -> str:
    """The keys a checkpoint and a model do not share, in words."""
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
    """The error of a strict load whose checkpoint does not match the model."""
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


def checkpoint_keys(files: list[str]) -> list[str]:
    """The tensor names in a checkpoint's safetensors shards, from their headers; a tensor in two shards is refused,
    since the later one would silently override the other."""
    shard_of = {}
    for file in files:
        with safe_open(file, framework="pt") as shard:
            for key in shard.keys():
                if key in shard_of:
                    raise ValueError(
                        f"The tensor {key} is in two shards of one checkpoint, {os.path.basename(shard_of[key])} and "
                        f"{os.path.basename(file)}: the checkpoint is damaged; save it again with save_pretrained."
                    )
                shard_of[key] = file
    return list(shard_of)


def initialise_unloaded(model: nn.Module, keys: list[str]) -> None:
    """Give the weights `keys`, which no checkpoint tensor filled, a new model's values (diffusers builds a model it
    loads without initialising it)."""
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
    weight."""

    @classmethod
    def from_pretrained(
        cls, pretrained_model_name_or_path: str | os.PathLike, *, strict: bool = True, **kwargs
    ) -> Self | tuple[Self, dict[str, list]]:
        """`ModelMixin.from_pretrained`, reading safetensors only (pickles are never unpickled) and refusing a
        checkpoint that does not fill every weight, naming the keys. Every loader, pipelines' included, comes here.

        Args:
            pretrained_model_name_or_path (`str` or `os.PathLike`): A Hub repo id or a local folder.
            strict (`bool`, *optional*, defaults to `True`): Refuse a checkpoint whose keys are not exactly the
                model's; with `False`, warn, give missing weights a new model's values and drop the other tensors.
            **kwargs: What `ModelMixin.from_pretrained` takes; `use_safetensors` may only be `True`, `use_flashpack`
                is refused.
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
            location = os.fspath(pretrained_model_name_or_path)
            if kwargs.get("subfolder"):
                location = os.path.join(location, kwargs["subfolder"])
            if strict:
                where = {key: kwargs[key] for key in CONFIG_LOCATION_ARGUMENTS if key in kwargs}
                saved_class = cls.load_config(pretrained_model_name_or_path, **where).get("_class_name")
                raise ValueError(refusal(cls.__name__, saved_class, location, missing, unexpected))
            logger.warning(
                f"Loaded the {cls.__name__} at {location} with strict=False, although the checkpoint does not match "
                f"it: {key_mismatch(missing, unexpected)}. The missing weights are initialised as in a new, untrained "
                "model, the other tensors dropped."
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
            loaded_keys = checkpoint_keys(resolved_model_file)
        result = super()._load_pretrained_model(
            model, state_dict, resolved_model_file, pretrained_model_name_or_path, loaded_keys, **kwargs
        )
        _, missing_keys, _, mismatched_keys, *_ = result
        unloaded = missing_keys + [key for key, *_ in mismatched_keys]
        if unloaded and not quantized:
            initialise_unloaded(model, unloaded)
        return result
