"""`LMLPLoraLoaderMixin`: LoRA files for `LMLPPipeline` in diffusers' format (`transformer.`-prefixed peft keys, the
`LoraConfig` as JSON in the header), read through the backbone's checked `load_lora_adapter`, safetensors only."""

import json
import os
from collections.abc import Callable
from typing import Any

import safetensors.torch
import torch
from diffusers.loaders.lora_base import LORA_ADAPTER_METADATA_KEY, LORA_WEIGHT_NAME_SAFE, LoraBaseMixin
from diffusers.utils import logging
from torch import nn

from ..models.loading import listed
from ..models.lora import (
    LORA_KEY_SUFFIXES,
    _check_component_keys,
    _refuse_non_finite_updates,
    check_weight_name,
    read_lora_source,
)


logger = logging.get_logger(__name__)


class LMLPLoraLoaderMixin(LoraBaseMixin):
    """Load, save, fuse and switch LoRA adapters of an [`LMLPPipeline`]'s transformer, as diffusers' pipelines do.

    Every backbone's block Linears can be adapted, and the tied SymMixer/AsymMixer weights as `target_parameters`.
    `set_adapters`, `unload_lora_weights` and the rest are `LoraBaseMixin`'s.
    """

    _lora_loadable_modules = ["transformer"]
    transformer_name = "transformer"

    @classmethod
    def lora_state_dict(
        cls, pretrained_model_name_or_path_or_dict: str | os.PathLike | dict[str, torch.Tensor], **kwargs
    ) -> dict[str, torch.Tensor] | tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
        """A LoRA state dict (and, with `return_lora_metadata=True`, its prefixed `LoraConfig` or None) from a
        `.safetensors` file, a folder, a Hub repo id or a dict; `kwargs` are diffusers' file and Hub options
        (`weight_name`, `subfolder`, `revision`, `token`, ...), `use_safetensors` only `None` or `True`."""
        return_lora_metadata = kwargs.pop("return_lora_metadata", False)
        state_dict, metadata, where = read_lora_source(pretrained_model_name_or_path_or_dict, kwargs)
        if not isinstance(pretrained_model_name_or_path_or_dict, dict):
            _check_component_keys(state_dict, cls.transformer_name, where)
        return (state_dict, metadata) if return_lora_metadata else state_dict

    def load_lora_weights(
        self,
        pretrained_model_name_or_path_or_dict: str | os.PathLike | dict[str, torch.Tensor],
        adapter_name: str | None = None,
        hotswap: bool = False,
        **kwargs,
    ) -> None:
        """Load a LoRA (see `lora_state_dict`) into `self.transformer` as a new active adapter, or with `hotswap`
        into the loaded `adapter_name` in place; `low_cpu_mem_usage` creates the layers empty first."""
        low_cpu_mem_usage = kwargs.pop("low_cpu_mem_usage", False)
        state_dict, metadata = self.lora_state_dict(
            pretrained_model_name_or_path_or_dict, return_lora_metadata=True, **kwargs
        )
        self.load_lora_into_transformer(
            state_dict, transformer=self.transformer, adapter_name=adapter_name, _pipeline=self,
            low_cpu_mem_usage=low_cpu_mem_usage, hotswap=hotswap, metadata=metadata,
        )  # fmt: skip

    @classmethod
    def load_lora_into_transformer(
        cls,
        state_dict: dict[str, torch.Tensor],
        transformer: nn.Module,
        adapter_name: str | None = None,
        _pipeline: Any = None,
        low_cpu_mem_usage: bool = False,
        hotswap: bool = False,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        """Load `transformer.`-prefixed LoRA weights into `transformer`, checking that every key finds its layer.
        Without `metadata` (the prefixed `LoraConfig`) alpha equals the rank, as in diffusers."""
        transformer.load_lora_adapter(
            state_dict, prefix=cls.transformer_name, adapter_name=adapter_name, metadata=metadata, _pipeline=_pipeline,
            low_cpu_mem_usage=low_cpu_mem_usage, hotswap=hotswap,
        )  # fmt: skip

    @classmethod
    def save_lora_weights(
        cls,
        save_directory: str | os.PathLike,
        transformer_lora_layers: dict[str, torch.Tensor] | nn.Module | None = None,
        is_main_process: bool = True,
        weight_name: str | None = None,
        save_function: Callable[..., Any] | None = None,
        safe_serialization: bool = True,
        transformer_lora_adapter_metadata: dict[str, Any] | None = None,
    ) -> None:
        """Write a transformer LoRA as diffusers does: `transformer.`-prefixed keys in a safetensors file, the
        `LoraConfig` (`transformer_lora_adapter_metadata`, needed to rebuild alpha and tied-weight targets) in its
        header; `save_function(tensors, filename, metadata=header)` replaces `safetensors.torch.save_file`."""
        if not safe_serialization:
            raise ValueError("LoRA weights are saved as safetensors only (safe_serialization=True), never pickled.")
        if not transformer_lora_layers:
            raise ValueError(
                "Pass the LoRA weights to save: transformer_lora_layers=get_peft_model_state_dict(transformer)."
            )
        weight_name = LORA_WEIGHT_NAME_SAFE if weight_name is None else weight_name
        check_weight_name(weight_name)
        state_dict = cls.pack_weights(transformer_lora_layers, cls.transformer_name)
        not_lora = sorted(key for key in state_dict if not key.endswith(LORA_KEY_SUFFIXES))
        if not_lora:
            raise ValueError(
                f"transformer_lora_layers has keys that are not LoRA matrices: {listed(not_lora)}; pass "
                "get_peft_model_state_dict(transformer)."
            )
        header = {"format": "pt"}
        if transformer_lora_adapter_metadata:
            # JSON has no sets (to_dict() gives target_modules as one): sorted, equal configs write equal JSON.
            fields = {
                f"{cls.transformer_name}.{key}": sorted(value) if isinstance(value, set) else value
                for key, value in transformer_lora_adapter_metadata.items()
            }
            header[LORA_ADAPTER_METADATA_KEY] = json.dumps(fields, indent=2, sort_keys=True)
        if not is_main_process:
            return
        if os.path.isfile(save_directory):
            raise ValueError(f"{save_directory} is a file; save_lora_weights writes into a folder.")
        os.makedirs(save_directory, exist_ok=True)
        path = os.path.join(save_directory, weight_name)
        (save_function or safetensors.torch.save_file)(state_dict, path, metadata=header)
        logger.info(f"LoRA weights saved in {path}")

    def fuse_lora(
        self,
        components: list[str] = ["transformer"],
        lora_scale: float = 1.0,
        safe_fusing: bool = False,
        adapter_names: list[str] | None = None,
    ) -> None:
        """`LoraBaseMixin.fuse_lora` (W ← W + lora_scale·ΔW); with `safe_fusing`, an update holding NaN or inf
        fuses nothing (peft alone would leave the layers before it fused)."""
        if safe_fusing:
            for component in components:
                _refuse_non_finite_updates(getattr(self, component), adapter_names)
        super().fuse_lora(
            components=components, lora_scale=lora_scale, safe_fusing=safe_fusing, adapter_names=adapter_names
        )

    def unfuse_lora(self, components: list[str] = ["transformer"]) -> None:
        """Subtract what `fuse_lora` merged (diffusers' own needs `components` passed)."""
        super().unfuse_lora(components=components)
