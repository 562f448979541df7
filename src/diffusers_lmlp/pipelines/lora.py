"""`LMLPLoraLoaderMixin`: LoRA files for `LMLPPipeline`, the way diffusers handles its transformer-only pipelines.

Files are diffusers' format (`transformer.`-prefixed peft keys, the adapter's `LoraConfig` as JSON in the header),
so loading rebuilds rank, alpha and targets exactly. Loading goes through the backbone's checked
`load_lora_adapter` (`models/lora.py`).
"""

import json
import os
from collections.abc import Callable
from typing import Any

import safetensors
import safetensors.torch
import torch
from diffusers.loaders.lora_base import LORA_ADAPTER_METADATA_KEY, LORA_WEIGHT_NAME_SAFE, LoraBaseMixin
from diffusers.utils import logging
from torch import nn

from ..models.loading import listed
from ..models.lora import LORA_KEY_SUFFIXES, _check_component_keys, _refuse_non_finite_updates
from ..models.lora_files import check_weight_name, read_lora_source


logger = logging.get_logger(__name__)


class LMLPLoraLoaderMixin(LoraBaseMixin):
    """Load, save, fuse and switch LoRA adapters of an [`LMLPPipeline`]'s transformer, as diffusers' pipelines do.

    Every registered backbone can be adapted: its blocks' nn.Linear layers, and the tied SymMixer/AsymMixer weights as
    `target_parameters`. `set_adapters`, `fuse_lora`, `unload_lora_weights` and the rest are `LoraBaseMixin`'s.
    """

    _lora_loadable_modules = ["transformer"]
    transformer_name = "transformer"

    @classmethod
    def lora_state_dict(
        cls, pretrained_model_name_or_path_or_dict: str | os.PathLike | dict[str, torch.Tensor], **kwargs
    ) -> dict[str, torch.Tensor] | tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
        """Read a LoRA state dict (and its adapter metadata) from a file, a folder, a Hub repo or a dict.

        Args:
            pretrained_model_name_or_path_or_dict (`str`, `os.PathLike` or `dict`): A `.safetensors` file, a folder, a
                Hub repo id, or a state dict (returned as it is).
            weight_name (`str`, *optional*, defaults to `"pytorch_lora_weights.safetensors"`): The safetensors file.
            subfolder (`str`, *optional*): The file's folder inside the folder or repo.
            cache_dir (`str` or `os.PathLike`, *optional*): The huggingface_hub cache to use.
            force_download (`bool`, *optional*, defaults to `False`): Download again even when cached.
            local_files_only (`bool`, *optional*, defaults to `False`): Never go online.
            token (`str` or `bool`, *optional*): The Hub token.
            revision (`str`, *optional*): The repo's branch, tag or commit.
            use_safetensors (`bool`, *optional*): Only `None` or `True`.
            return_lora_metadata (`bool`, *optional*, defaults to `False`): Also return the adapter metadata.

        Returns:
            The state dict, or with `return_lora_metadata=True` it and the metadata (prefixed `LoraConfig` or None).
        """
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
        """Load a LoRA into `self.transformer` as a new adapter, and make it the active one.

        Args:
            pretrained_model_name_or_path_or_dict (`str`, `os.PathLike` or `dict`): See `lora_state_dict`.
            adapter_name (`str`, *optional*): The adapter's name, for `set_adapters`; `"default_<n>"` when not given.
            hotswap (`bool`, *optional*, defaults to `False`): Replace the weights of the loaded adapter
                `adapter_name` in place (no recompilation), as diffusers does; not for adapters on tied weights.
            low_cpu_mem_usage (`bool`, *optional*, defaults to `False`): Create the adapter's layers empty first.
            **kwargs: The file options of `lora_state_dict` (`weight_name`, `subfolder`, `revision`, ...).
        """
        low_cpu_mem_usage = kwargs.pop("low_cpu_mem_usage", False)
        state_dict, metadata = self.lora_state_dict(
            pretrained_model_name_or_path_or_dict, return_lora_metadata=True, **kwargs
        )
        self.load_lora_into_transformer(
            state_dict,
            transformer=self.transformer,
            adapter_name=adapter_name,
            _pipeline=self,
            low_cpu_mem_usage=low_cpu_mem_usage,
            hotswap=hotswap,
            metadata=metadata,
        )

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

        Args:
            state_dict (`dict[str, torch.Tensor]`): `transformer.<layer>.lora_A.weight` and `.lora_B.weight` tensors.
            transformer (`nn.Module`): A model of the registry (any `PeftAdapterMixin` model).
            adapter_name (`str`, *optional*): See `load_lora_weights`.
            _pipeline (`DiffusionPipeline`, *optional*): The pipeline, whose CPU offloading diffusers pauses.
            low_cpu_mem_usage (`bool`, *optional*, defaults to `False`): See `load_lora_weights`.
            hotswap (`bool`, *optional*, defaults to `False`): See `load_lora_weights`.
            metadata (`dict`, *optional*): The `transformer.`-prefixed `LoraConfig` fields; without them the rank is
                read from the matrices and alpha equals it, as in diffusers. Adapters on tied weights need them.
        """
        transformer.load_lora_adapter(
            state_dict,
            prefix=cls.transformer_name,
            adapter_name=adapter_name,
            metadata=metadata,
            _pipeline=_pipeline,
            low_cpu_mem_usage=low_cpu_mem_usage,
            hotswap=hotswap,
        )

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
        """Write a transformer LoRA as diffusers does: `transformer.`-prefixed keys, the config in the header.

        Args:
            save_directory (`str` or `os.PathLike`): The folder to write to (created if needed).
            transformer_lora_layers (`dict[str, torch.Tensor]` or `nn.Module`): `get_peft_model_state_dict`'s output.
            is_main_process (`bool`, *optional*, defaults to `True`): Only the main process writes.
            weight_name (`str`, *optional*, defaults to `"pytorch_lora_weights.safetensors"`): A `.safetensors` name.
            save_function (`Callable`, *optional*, defaults to `safetensors.torch.save_file`): Called as
                `save_function(tensors, filename, metadata=header)`.
            safe_serialization (`bool`, *optional*, defaults to `True`): Only `True`.
            transformer_lora_adapter_metadata (`dict`, *optional*): `lora_config.to_dict()`, so that loading rebuilds
                the adapter exactly; without it alpha = rank, and an adapter on tied weights cannot be loaded.
        """
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
                f"transformer_lora_layers has keys that are not LoRA matrices: {listed(not_lora)}. Pass "
                "get_peft_model_state_dict(transformer), whose keys end with .lora_A.weight and .lora_B.weight."
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
        """Merge the active adapters (or `adapter_names`) into the transformer's weights: W ← W + lora_scale·ΔW.

        As in diffusers, the fused adapters keep the scale `lora_scale` after `unfuse_lora`.

        Args:
            components (`list[str]`, *optional*, defaults to `["transformer"]`): The components to fuse.
            lora_scale (`float`, *optional*, defaults to 1.0): Multiplies each adapter's scale before merging.
            safe_fusing (`bool`, *optional*, defaults to `False`): Fuse nothing, and raise, if an update holds NaN or
                inf (peft alone would leave the layers before the broken one fused).
            adapter_names (`list[str]`, *optional*): The adapters to merge; the active ones when not given.
        """
        if safe_fusing:
            for component in components:
                _refuse_non_finite_updates(getattr(self, component), adapter_names)
        super().fuse_lora(
            components=components, lora_scale=lora_scale, safe_fusing=safe_fusing, adapter_names=adapter_names
        )

    def unfuse_lora(self, components: list[str] = ["transformer"]) -> None:
        """Subtract what `fuse_lora` merged, restoring the transformer's own weights (up to rounding).

        Args:
            components (`list[str]`, *optional*, defaults to `["transformer"]`): The components to unfuse.
        """
        super().unfuse_lora(components=components)
