"""The U-shaped skeleton of every backbone (out block i takes in block n-1-i's output as its long skip), with token
I/O, input checks and the reference init: the public models only choose the block."""

import math
import numbers
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from torch import nn

from .loading import StrictLoadingMixin, check_storable, local_paths_left_out, no_empty_fp32_warning
from .mixers.channel_mlp import channel_mlp_factory
from .tokens import OutputHead, TokenEmbedder


# The reference network's timestep runs over 1..1000: diffusers' t in [0, 1000) plus 1.
NUM_TRAIN_TIMESTEPS = 1000


def _is_positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _is_positive_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and value > 0


BOOLEAN = (lambda v: isinstance(v, bool), "True or False")

# The config fields every backbone checks where it has them: field -> (test, what it must be); a model class may
# extend or relax them.
CONFIG_REQUIREMENTS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "sample_size": (_is_positive_int, "a positive integer (the side of the square latent)"),
    "patch_size": (_is_positive_int, "a positive integer (the side of a square patch)"),
    "in_channels": (_is_positive_int, "a positive integer (the latent channels)"),
    "out_channels": (lambda v: v is None or _is_positive_int(v), "a positive integer or None (None: in_channels)"),
    "hidden_size": (_is_positive_int, "a positive integer (the token width D)"),
    "mlp_ratio": (_is_positive_real, "a positive finite number (the channel MLP's width as a multiple of D)"),
    "text_embed_dim": (_is_positive_int, "a positive integer (the width of the text encoder states)"),
    "text_seq_len": (_is_positive_int, "a positive integer (the number of text tokens)"),
    "pooled_text_projection": BOOLEAN,
    "long_skips": BOOLEAN,
    "norm_eps": (_is_positive_real, "a positive finite number (the LayerNorm epsilon)"),
}


def check_width(field: str, ratio: float, size: int, what: str) -> None:
    """Raise a `ValueError` unless `ratio` × `size` gives the layer `what` at least one hidden unit."""
    if int(size * ratio) < 1:
        raise ValueError(
            f"{field}={ratio} gives a {what} of int({size} × {ratio}) = 0 hidden units; use {field} >= 1 / {size}."
        )


def rename_reference_keys(
    state_dict: dict[str, torch.Tensor], rules: list[tuple[str, str]], unexpected: Callable[[str], Exception]
) -> dict[str, torch.Tensor]:
    """Rename every key (less a DDP `module.` prefix) by the first matching (pattern, replacement) rule; raise
    `unexpected(key)` for a key no rule matches. Tensors are not copied."""
    converted = {}
    for key, tensor in state_dict.items():
        key = key.removeprefix("module.")
        for pattern, replacement in rules:
            new_key, count = re.subn(pattern, replacement, key)
            if count:
                converted[new_key] = tensor
                break
        else:
            raise unexpected(key)
    return converted


def _check_timestep_values(timestep: torch.Tensor) -> None:
    """Raise a `ValueError` naming the timesteps outside [0, `NUM_TRAIN_TIMESTEPS`), NaN included (one GPU sync)."""
    in_range = (timestep >= 0) & (timestep < NUM_TRAIN_TIMESTEPS)  # False for NaN
    if not in_range.all():
        raise ValueError(
            f"timestep must lie in [0, {NUM_TRAIN_TIMESTEPS}) (diffusers scheduler timesteps; the network embeds "
            f"t + 1), got {timestep[in_range.logical_not()].tolist()}."
        )


class UShapedStack(nn.Module):
    """num_layers // 2 in blocks, a mid block and num_layers // 2 out blocks from `make_block(receives_skip)`; without
    `long_skips` a plain sequence."""

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
        skips = []
        for block in self.in_blocks:
            x = self._run(block, x, None)  # (B, L, D)
            skips.append(x)
        x = self._run(self.mid_block, x, None)
        for block in self.out_blocks:
            x = self._run(block, x, skips.pop() if self.long_skips else None)
        return x


class UShapedMixerModel(StrictLoadingMixin):
    """Shared body of the public backbones: subclasses register their config and call `_build(make_block)`.

    Parameters every subclass takes: sample_size (32), patch_size (2) and in_channels (4) of the square latent;
    out_channels (None: in_channels); hidden_size (512), the token width D; num_layers, an even depth; mlp_ratio, the
    channel MLP's width over D; text_embed_dim (768) and text_seq_len (77) of the text states; conv_out (True), the
    reference's final 3×3 convolution; norm_eps; pooled_text_projection (False), adding a projection of the text's
    last state to every image token (not in the papers); where a class has them, channel_mlp ("mlp", a key of
    `channel_mlp.CHANNEL_MLPS`) and long_skips (True).
    """

    _supports_gradient_checkpointing = True
    _skip_layerwise_casting_patterns = ["pos_embed", "norm"]
    named_configs: dict[str, dict] = {}  # the papers' configurations of this class: name -> `__init__` overrides
    config_requirements: dict[str, tuple[Callable[[Any], bool], str]] = CONFIG_REQUIREMENTS

    def save_pretrained(
        self,
        save_directory: str | os.PathLike,
        safe_serialization: bool = True,
        variant: str | None = None,
        max_shard_size: int | str = "10GB",
        **kwargs,
    ) -> None:
        """`ModelMixin.save_pretrained` without a local `_name_or_path`, refusing torch's quantized layers before
        writing (`models/loading.py`). A pipeline's `save_pretrained` passes on only the arguments named here."""
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
        """`PeftAdapterMixin.load_lora_adapter` with the checks of `models/lora.py`."""
        from .lora import load_checked_adapter

        load_checked_adapter(
            self, pretrained_model_name_or_path_or_dict, prefix, hotswap, kwargs, super().load_lora_adapter
        )

    def to(self, *args, **kwargs):
        """`ModelMixin.to` without diffusers' empty "kept in float32" warning (`models/loading.py`)."""
        with no_empty_fp32_warning():
            return super().to(*args, **kwargs)

    @classmethod
    def long_skips(cls, config: Mapping) -> bool:
        """Whether out blocks receive long skips: the config's `long_skips` where the class has it, else always."""
        return config.get("long_skips", True)

    @classmethod
    def from_named_config(cls, name: str, **overrides):
        """A randomly initialised model of one of `cls.named_configs`, `overrides` replacing config values."""
        if name not in cls.named_configs:
            raise ValueError(
                f"Unknown {cls.__name__} configuration {name!r}; choose one of {sorted(cls.named_configs)}."
            )
        return cls(**{**cls.named_configs[name], **overrides})

    def _build(self, make_block: Callable[[int, bool], nn.Module]) -> None:
        """Check the config, build token I/O and the stack with `make_block(seq_len, receives_skip)`, initialise."""
        config = self.config
        for field, (is_valid, requirement) in self.config_requirements.items():
            if field in config and not is_valid(config[field]):
                raise ValueError(
                    f"{field}={config[field]!r} cannot build a {type(self).__name__}: {field} must be {requirement}."
                )
        if config.sample_size % config.patch_size:
            raise ValueError(
                f"sample_size ({config.sample_size}) must be a multiple of patch_size ({config.patch_size})."
            )
        if not isinstance(config.num_layers, int) or config.num_layers < 0 or config.num_layers % 2:
            raise ValueError(
                f"num_layers must be even and >= 0 (num_layers // 2 in-blocks, a mid-block, num_layers // 2 "
                f"out-blocks), got {config.num_layers!r}."
            )
        if config.mlp_ratio is not None:
            check_width("mlp_ratio", config.mlp_ratio, config.hidden_size, "channel MLP")
        self._check_config()
        self.embed = TokenEmbedder(config)
        seq_len = self.embed.seq_len
        self.stack = UShapedStack(config.num_layers, lambda skip: make_block(seq_len, skip), self.long_skips(config))
        self.head = OutputHead(config)
        self.initialize_weights()

    def _check_config(self) -> None:
        """A class's own config checks, after the shared ones and before any layer exists."""

    @property
    def seq_len(self) -> int:
        """L = 1 + text_seq_len + (sample_size / patch_size)², the number of tokens every block mixes."""
        return self.embed.seq_len

    def channel_mlp_class(self) -> Callable[[int, float], nn.Module]:
        """The channel MLP `config.channel_mlp` names, as a `make(hidden_size, mlp_ratio)` with the token layout bound."""
        config = self.config
        return channel_mlp_factory(
            config.channel_mlp,
            num_extra_tokens=1 + config.text_seq_len,
            grid_size=config.sample_size // config.patch_size,
        )

    def initialize_weights(self) -> None:
        """The reference init: Linears and the positional embedding trunc-normal (std 0.02), zero biases, LayerNorms
        1 and 0, convolutions PyTorch's default; then each submodule's own `init_weights()`."""
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
        """Validate the inputs; return the timesteps as a float (B,) tensor on the device of `hidden_states`. Timestep
        values are checked where they were given (no GPU wait for numbers), except on meta and under compile."""
        config, name, side = self.config, type(self).__name__, self.config.sample_size
        text_shape = f"(B, {config.text_seq_len}, {config.text_embed_dim})"
        if hidden_states.ndim != 4 or hidden_states.shape[1:] != (config.in_channels, side, side):
            raise ValueError(
                f"{name} expects latents of shape (B, {config.in_channels}, {side}, {side}) (in_channels="
                f"{config.in_channels}, sample_size={side}), got {tuple(hidden_states.shape)}: blocks mix a fixed "
                f"L = {self.seq_len} tokens, so resize the images to the model's resolution."
            )
        if encoder_hidden_states is None:
            raise ValueError(
                f'{name} needs encoder_hidden_states {text_shape}; for the unconditional branch pass the empty prompt "".'
            )
        for argument, tensor in (("hidden_states", hidden_states), ("encoder_hidden_states", encoder_hidden_states)):
            if not tensor.is_floating_point():
                raise ValueError(f"{argument} must be a floating-point tensor, got {tensor.dtype}; pass floats.")
        if encoder_hidden_states.ndim != 3 or encoder_hidden_states.shape[1:] != (
            config.text_seq_len,
            config.text_embed_dim,
        ):
            raise ValueError(
                f"{name} expects encoder_hidden_states of shape {text_shape}, got "
                f'{tuple(encoder_hidden_states.shape)}. Tokenise with padding="max_length", '
                f"max_length={config.text_seq_len} and a text encoder of hidden size {config.text_embed_dim}."
            )
        batch_size = hidden_states.shape[0]
        if encoder_hidden_states.shape[0] != batch_size:
            raise ValueError(
                f"Batch size mismatch: hidden_states has {batch_size} samples but encoder_hidden_states has "
                f"{encoder_hidden_states.shape[0]}; give both the same batch."
            )
        timestep = torch.as_tensor(timestep)  # where it was given
        if timestep.dtype == torch.bool or timestep.is_complex():
            raise ValueError(
                f"timestep must hold real numbers in [0, {NUM_TRAIN_TIMESTEPS}), got dtype {timestep.dtype}."
            )
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
        """Predict the noise ε of (B, in_channels, sample_size, sample_size) noisy latents from (B, text_seq_len,
        text_embed_dim) text states and scalar or (B,) diffusers timesteps in [0, 999] (the network embeds t + 1)."""
        sample = self._predict(hidden_states, encoder_hidden_states, timestep)
        return Transformer2DModelOutput(sample=sample) if return_dict else (sample,)

    def _predict(
        self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, timestep: torch.Tensor | float | int
    ) -> torch.Tensor:
        timestep = self._check_inputs(hidden_states, encoder_hidden_states, timestep)
        tokens = self.embed(hidden_states, encoder_hidden_states, timestep + 1)  # (B, L, D)
        tokens = self.stack(tokens)  # (B, L, D)
        return self.head(tokens)
