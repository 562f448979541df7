"""The U-shaped skeleton shared by every backbone (U-ViT, UL-MLP, MoE-MLP and the other mixers).

    in blocks ──► mid block ──► out blocks      out block i receives the output of in block n-1-i (LIFO)

`UShapedStack` routes the long skips (each block merges its own); `UShapedMixerModel` adds token I/O, input checks,
the shared diffusers `forward` and the reference initialisation. The public models only choose the block.
"""

import math
import numbers
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from torch import nn

from .casting import no_empty_fp32_warning
from .loading import StrictLoadingMixin
from .mixers.channel_mlp import channel_mlp_factory
from .saving import check_storable, local_paths_left_out
from .tokens import OutputHead, TokenEmbedder


# The reference network's timestep n runs over 1..1000: diffusers' t in [0, 1000) of the SD noise schedule, plus 1.
NUM_TRAIN_TIMESTEPS = 1000


def _is_positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _is_positive_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and value > 0


# The config fields every backbone shares: field -> (test, what it must be); a model class may extend or relax them.
CONFIG_REQUIREMENTS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "sample_size": (_is_positive_int, "a positive integer (the side of the square latent)"),
    "patch_size": (_is_positive_int, "a positive integer (the side of a square patch)"),
    "in_channels": (_is_positive_int, "a positive integer (the latent channels)"),
    "out_channels": (lambda v: v is None or _is_positive_int(v), "a positive integer or None (None: in_channels)"),
    "hidden_size": (_is_positive_int, "a positive integer (the token width D)"),
    "mlp_ratio": (
        _is_positive_real,
        "a positive finite number (the channel MLP's width as a multiple of hidden_size)",
    ),
    "text_embed_dim": (_is_positive_int, "a positive integer (the width of the text encoder states)"),
    "text_seq_len": (_is_positive_int, "a positive integer (the number of text tokens)"),
    "pooled_text_projection": (lambda v: isinstance(v, bool), "True or False"),
    "norm_eps": (_is_positive_real, "a positive finite number (the LayerNorm epsilon)"),
}


def _check_timestep_values(timestep: torch.Tensor) -> None:
    """Raise a `ValueError` naming the timesteps outside [0, `NUM_TRAIN_TIMESTEPS`) (NaN included); one GPU sync."""
    in_range = (timestep >= 0) & (timestep < NUM_TRAIN_TIMESTEPS)  # False for NaN
    if not in_range.all():
        raise ValueError(
            f"timestep must lie in [0, {NUM_TRAIN_TIMESTEPS}) (diffusers scheduler timesteps t of the "
            f"{NUM_TRAIN_TIMESTEPS}-step training schedule; the network embeds t + 1), got "
            f"{timestep[in_range.logical_not()].tolist()}."
        )


class UShapedStack(nn.Module):
    """num_layers // 2 in-blocks, one mid-block and num_layers // 2 out-blocks, built by `make_block(receives_skip)`;
    with `long_skips` out block i gets the output of in block n-1-i, else the stack is a plain sequence."""

    def __init__(self, num_layers: int, make_block: Callable[[bool], nn.Module], long_skips: bool = True):
        super().__init__()
        self.long_skips = long_skips
        self.in_blocks = nn.ModuleList(make_block(False) for _ in range(num_layers // 2))
        self.mid_block = make_block(False)
        self.out_blocks = nn.ModuleList(make_block(long_skips) for _ in range(num_layers // 2))
        self.gradient_checkpointing = False

    def _run(self, block: nn.Module, x: torch.Tensor, skip: torch.Tensor | None) -> torch.Tensor:
        if torch.is_grad_enabled() and self.gradient_checkpointing:
            return self._gradient_checkpointing_func(block, x, skip)
        return block(x, skip)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Run every block on (B, L, D) tokens."""
        skips = []
        for block in self.in_blocks:
            x = self._run(block, x, None)
            skips.append(x)
        x = self._run(self.mid_block, x, None)
        for block in self.out_blocks:
            x = self._run(block, x, skips.pop() if self.long_skips else None)
        return x


class UShapedMixerModel(StrictLoadingMixin):
    """Shared body of the public backbones. Subclasses register their config and call `_build(make_block)`."""

    _supports_gradient_checkpointing = True
    _skip_layerwise_casting_patterns = ["pos_embed", "norm"]
    # The papers' named configurations of this class: name -> `__init__` overrides.
    named_configs: dict[str, dict] = {}
    # field -> (test, requirement) for the config fields this class checks before building anything.
    config_requirements: dict[str, tuple[Callable[[Any], bool], str]] = CONFIG_REQUIREMENTS

    def save_pretrained(
        self,
        save_directory: str | os.PathLike,
        safe_serialization: bool = True,
        variant: str | None = None,
        max_shard_size: int | str = "10GB",
        **kwargs,
    ) -> None:
        """`ModelMixin.save_pretrained` without a local `_name_or_path` in `config.json` (`models/saving.py`). The
        arguments are explicit because a pipeline's `save_pretrained` passes on only those in this signature.

        Args:
            save_directory (`str` or `os.PathLike`): The folder; made if missing.
            safe_serialization (`bool`, *optional*, defaults to `True`): Write safetensors (all the loader reads).
            variant (`str`, *optional*): Write `diffusion_pytorch_model.<variant>.safetensors`.
            max_shard_size (`int` or `str`, *optional*, defaults to `"10GB"`): The largest weights file.
            **kwargs: The rest of what `ModelMixin.save_pretrained` takes (`is_main_process`, `push_to_hub`, ...).

        Raises:
            `ValueError`: Before anything is written, for torch's quantized layers, which safetensors cannot store.
        """
        check_storable(self)
        with local_paths_left_out(self):
            super().save_pretrained(
                save_directory,
                safe_serialization=safe_serialization,
                variant=variant,
                max_shard_size=max_shard_size,
                **kwargs,
            )

    def load_lora_adapter(self, pretrained_model_name_or_path_or_dict, prefix="transformer", hotswap=False, **kwargs):
        """`PeftAdapterMixin.load_lora_adapter`, with the checks of `LMLPPipeline.load_lora_weights`: a safetensors
        file inside its folder, every key placed in a layer of fitting shape, finite weights and a well-typed config
        (diffusers alone skips unknown keys and loads an empty file as an adapter that changes nothing). The
        arguments are diffusers'."""
        from .lora import load_checked_adapter

        load_checked_adapter(
            self, pretrained_model_name_or_path_or_dict, prefix, hotswap, kwargs, super().load_lora_adapter
        )

    def to(self, *args, **kwargs):
        """`ModelMixin.to` without diffusers' empty "kept in float32" warning (`models/casting.py`).

        Args:
            *args, **kwargs: What `nn.Module.to` takes (a device, a dtype or both).
        """
        with no_empty_fp32_warning():
            return super().to(*args, **kwargs)

    @classmethod
    def long_skips(cls, config: Mapping) -> bool:
        """Whether out blocks receive long skips: the config's `long_skips` where the class has it, else always.

        Args:
            config (`Mapping`): A full config of this class.
        """
        return config.get("long_skips", True)

    @classmethod
    def from_named_config(cls, name: str, **overrides):
        """Build a randomly initialised model from one of the papers' named configurations.

        Args:
            name (`str`): A key of `cls.named_configs` (e.g. "F2", "2E1H", "4E1H", "4E2H").
            **overrides: Config values that replace the named ones (e.g. `sample_size=64`).
        """
        if name not in cls.named_configs:
            raise ValueError(
                f"Unknown {cls.__name__} configuration {name!r}; choose one of {sorted(cls.named_configs)}."
            )
        return cls(**{**cls.named_configs[name], **overrides})

    def _build(self, make_block: Callable[[int, bool], nn.Module]) -> None:
        """Build token I/O and the stack from `self.config`, with `make_block(seq_len, receives_skip)`, then
        initialise every weight."""
        self._check_config()
        config = self.config
        self.embed = TokenEmbedder(
            config.sample_size,
            config.patch_size,
            config.in_channels,
            config.hidden_size,
            config.text_embed_dim,
            config.text_seq_len,
            config.pooled_text_projection,
        )
        seq_len = self.embed.seq_len
        self.stack = UShapedStack(config.num_layers, lambda skip: make_block(seq_len, skip), self.long_skips(config))
        self.head = OutputHead(
            config.sample_size,
            config.patch_size,
            config.hidden_size,
            config.out_channels or config.in_channels,
            self.embed.num_extra_tokens,
            config.conv_out,
            config.norm_eps,
        )
        self.initialize_weights()

    def _check_config(self) -> None:
        """Raise a `ValueError` naming the first config field that cannot build the model, before any layer exists."""
        config = self.config
        name = type(self).__name__
        for field, (is_valid, requirement) in self.config_requirements.items():
            if not is_valid(config[field]):
                raise ValueError(f"{field}={config[field]!r} cannot build a {name}: {field} must be {requirement}.")
        if config.sample_size % config.patch_size:
            raise ValueError(
                f"sample_size ({config.sample_size}) must be a multiple of patch_size ({config.patch_size})."
            )
        if not isinstance(config.num_layers, int) or config.num_layers < 0 or config.num_layers % 2:
            raise ValueError(
                f"num_layers must be even and >= 0 (num_layers // 2 in-blocks, 1 mid-block, num_layers // 2 "
                f"out-blocks), got {config.num_layers!r}."
            )
        if config.mlp_ratio is not None and int(config.hidden_size * config.mlp_ratio) < 1:
            raise ValueError(
                f"mlp_ratio={config.mlp_ratio} gives a channel MLP of int({config.hidden_size} × {config.mlp_ratio}) "
                "= 0 hidden units; use mlp_ratio >= 1 / hidden_size (the papers use 4)."
            )

    @property
    def seq_len(self) -> int:
        """L = 1 + text_seq_len + (sample_size / patch_size)², the number of tokens every block mixes."""
        return self.embed.seq_len

    def channel_mlp_class(self) -> Callable[[int, float], nn.Module]:
        """The channel MLP that `config.channel_mlp` names, as a `make(hidden_size, mlp_ratio)` with the token layout
        bound, so that a block takes any of them."""
        config = self.config
        return channel_mlp_factory(
            config.channel_mlp,
            num_extra_tokens=1 + config.text_seq_len,
            grid_size=config.sample_size // config.patch_size,
        )

    def initialize_weights(self) -> None:
        """The reference initialisation, then each submodule's own `init_weights()` (timm's convention).

        Every `nn.Linear` and the positional embedding: truncated normal, std 0.02, bias 0; LayerNorms: 1 and 0; the
        token-I/O convolutions keep PyTorch's default init, as in the reference.
        """
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.trunc_normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm) and module.elementwise_affine:
                nn.init.ones_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        for module in self.modules():
            if module is not self and callable(getattr(module, "init_weights", None)):
                module.init_weights()
        nn.init.trunc_normal_(self.embed.pos_embed, std=0.02)

    def _check_inputs(
        self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, timestep: torch.Tensor | float | int
    ) -> torch.Tensor:
        """Validate the inputs and return the timesteps as a float (B,) tensor on the device of `hidden_states`.

        Timestep values are checked where they were given (numbers and CPU tensors without a GPU wait), except on the
        meta device and under `torch.compile`."""
        config = self.config
        name = type(self).__name__
        side = config.sample_size
        if hidden_states.ndim != 4 or hidden_states.shape[1:] != (config.in_channels, side, side):
            raise ValueError(
                f"{name} expects latents of shape (B, {config.in_channels}, {side}, {side}) (in_channels="
                f"{config.in_channels}, sample_size={side}), got {tuple(hidden_states.shape)}. Token mixing works "
                f"over a fixed number of tokens (L = {self.seq_len}), so other sizes need a model built with "
                f"another sample_size; resize the images to the model's native resolution instead."
            )
        batch_size = hidden_states.shape[0]
        if encoder_hidden_states is None:
            raise ValueError(
                f"{name} needs encoder_hidden_states (B, {config.text_seq_len}, {config.text_embed_dim}); for the "
                'unconditional branch pass the text encoder\'s states of the empty prompt "".'
            )
        for argument, tensor in (("hidden_states", hidden_states), ("encoder_hidden_states", encoder_hidden_states)):
            if not tensor.is_floating_point():
                raise ValueError(
                    f"{argument} must be a floating-point tensor, got {tensor.dtype}. Pass latents and text encoder "
                    "states as floats (any float dtype: they are cast to the model's)."
                )
        expected_text = (config.text_seq_len, config.text_embed_dim)
        if encoder_hidden_states.ndim != 3 or encoder_hidden_states.shape[1:] != expected_text:
            raise ValueError(
                f"{name} expects encoder_hidden_states of shape (B, {config.text_seq_len}, "
                f"{config.text_embed_dim}) (text_seq_len={config.text_seq_len}, text_embed_dim="
                f"{config.text_embed_dim}), got {tuple(encoder_hidden_states.shape)}. Tokenise with "
                f'padding="max_length", max_length={config.text_seq_len}, truncation=True and use a text encoder '
                f"of hidden size {config.text_embed_dim}."
            )
        if encoder_hidden_states.shape[0] != batch_size:
            raise ValueError(
                f"Batch size mismatch: hidden_states has {batch_size} samples but encoder_hidden_states has "
                f"{encoder_hidden_states.shape[0]}. Repeat the text states (or latents) so both have the same batch."
            )
        timestep = torch.as_tensor(timestep)  # where it was given
        if timestep.dtype == torch.bool or timestep.is_complex():
            raise ValueError(
                f"timestep must hold real numbers (diffusers scheduler timesteps in [0, {NUM_TRAIN_TIMESTEPS})), got "
                f"dtype {timestep.dtype}."
            )
        # Values cannot be read on the meta device (FLOP counting), and reading them would split a compiled graph.
        if timestep.device.type != "meta" and not torch.compiler.is_compiling():
            _check_timestep_values(timestep)
        timestep = timestep.to(hidden_states.device)
        if timestep.ndim == 0 or timestep.shape == (1,):
            timestep = timestep.reshape(1).expand(batch_size)
        elif timestep.shape != (batch_size,):
            raise ValueError(
                f"timestep must be a scalar or a 1-D tensor of length {batch_size} (the batch size), got shape "
                f"{tuple(timestep.shape)}."
            )
        return timestep.float()

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        timestep: torch.Tensor | float | int,
        return_dict: bool = True,
    ) -> Transformer2DModelOutput | tuple[torch.Tensor]:
        """Predict the noise ε of a noisy latent.

        Args:
            hidden_states (`torch.Tensor`): (B, in_channels, sample_size, sample_size) noisy latents.
            encoder_hidden_states (`torch.Tensor`): (B, text_seq_len, text_embed_dim) text encoder states (those of
                "" for the unconditional branch).
            timestep (`torch.Tensor` or `float` or `int`): Scalar or (B,) diffusers timesteps t in [0, 999]; the
                network embeds the reference's t + 1, so converted reference weights run unchanged.
            return_dict (`bool`, *optional*, defaults to `True`): Return a `Transformer2DModelOutput`, not a tuple.

        Returns:
            [`~models.modeling_outputs.Transformer2DModelOutput`] or `tuple`: `sample`, the (B, out_channels, H, W) ε.
        """
        sample = self._predict(hidden_states, encoder_hidden_states, timestep)
        if not return_dict:
            return (sample,)
        return Transformer2DModelOutput(sample=sample)

    def _predict(
        self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, timestep: torch.Tensor | float | int
    ) -> torch.Tensor:
        """Validate, embed, run the stack and the head: the (B, out_channels, H, W) prediction."""
        timestep = self._check_inputs(hidden_states, encoder_hidden_states, timestep)
        # The reference's timestep n = t + 1 (1..1000).
        tokens = self.embed(hidden_states, encoder_hidden_states, timestep + 1)  # (B, L, D)
        tokens = self.stack(tokens)  # (B, L, D)
        return self.head(tokens)
