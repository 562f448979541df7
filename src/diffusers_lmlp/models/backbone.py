"""The U-shaped skeleton shared by every backbone of the family (U-ViT, UL-MLP, MoE-MLP).

    in blocks ──► mid block ──► out blocks      out block i adds the output of in block n-1-i (LIFO)

`UShapedStack` holds the blocks and the long skips; `UShapedMixerModel` wraps token I/O around it, validates the
inputs and keeps all initialisation in one place. The public models only choose the block.
"""

import math
import numbers
from collections.abc import Callable
from typing import Any

import torch
from diffusers.models.modeling_utils import ModelMixin
from torch import nn

from .mixers.moe import MoELinearAttention
from .tokens import OutputHead, TokenEmbedder


# The reference network's timestep n runs over 1..1000: diffusers' t in [0, 1000) of the SD noise schedule, plus 1.
NUM_TRAIN_TIMESTEPS = 1000
# The skeleton of the shapes world's small models (`shapes-S`, `shapes-moe-S`; diffusers_lmlp.shapes): 8×8×8 latents of
# 32 px images in 2×2 patches (16 image tokens), 10 tokens of its 64-wide text encoder, D = 96, 8 + 1 blocks.
SHAPES_SMALL = dict(
    sample_size=8, patch_size=2, in_channels=8, hidden_size=96, num_layers=8, text_embed_dim=64, text_seq_len=10
)


def _is_positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _is_positive_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and value > 0


# The config fields every backbone shares: field -> (test, what the field must be). A mixer checks its own
# arguments (the MoE-MLP's num_experts and num_heads).
CONFIG_REQUIREMENTS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "sample_size": (_is_positive_int, "a positive integer (the side of the square latent)"),
    "patch_size": (_is_positive_int, "a positive integer (the side of a square patch)"),
    "in_channels": (_is_positive_int, "a positive integer (the latent channels)"),
    "out_channels": (lambda v: v is None or _is_positive_int(v), "a positive integer or None (None: in_channels)"),
    "hidden_size": (_is_positive_int, "a positive integer (the token width D)"),
    "mlp_ratio": (_is_positive_real, "a positive finite number (the joint MLP's width as a multiple of hidden_size)"),
    "text_embed_dim": (_is_positive_int, "a positive integer (the width of the text encoder states)"),
    "text_seq_len": (_is_positive_int, "a positive integer (the number of text tokens)"),
    "norm_eps": (_is_positive_real, "a positive finite number (the LayerNorm epsilon)"),
}


class UShapedStack(nn.Module):
    """num_layers // 2 in-blocks, one mid-block and num_layers // 2 out-blocks with additive long skips.

    Args:
        num_layers (`int`): The reference "depth" (even): 16 gives 8 + 1 + 8 = 17 blocks.
        make_block (`Callable[[], nn.Module]`): Builds one block with the contract
            `block(x (B, L, D), skip (B, L, D) | None) -> (x (B, L, D), router_probs (B, H, E) | None)`.
    """

    def __init__(self, num_layers: int, make_block: Callable[[], nn.Module]):
        super().__init__()
        self.in_blocks = nn.ModuleList(make_block() for _ in range(num_layers // 2))
        self.mid_block = make_block()
        self.out_blocks = nn.ModuleList(make_block() for _ in range(num_layers // 2))
        self.gradient_checkpointing = False

    def _run(self, block: nn.Module, x: torch.Tensor, skip: torch.Tensor | None, router_probs: list) -> torch.Tensor:
        if torch.is_grad_enabled() and self.gradient_checkpointing:
            x, probs = self._gradient_checkpointing_func(block, x, skip)
        else:
            x, probs = block(x, skip)
        if probs is not None:
            router_probs.append(probs)
        return x

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Run every block.

        Args:
            x (`torch.Tensor`): (B, L, D) tokens.

        Returns:
            `tuple`: the tokens (B, L, D), and the router probabilities of the blocks that route, in block order.
        """
        router_probs: list[torch.Tensor] = []
        skips = []
        for block in self.in_blocks:
            x = self._run(block, x, None, router_probs)
            skips.append(x)
        x = self._run(self.mid_block, x, None, router_probs)
        for block in self.out_blocks:
            x = self._run(block, x, skips.pop(), router_probs)
        return x, router_probs


class UShapedMixerModel(ModelMixin):
    """Shared body of the public backbones. Subclasses register their config and call `_build(make_block)`."""

    _supports_gradient_checkpointing = True
    _skip_layerwise_casting_patterns = ["pos_embed", "norm"]
    # The papers' named configurations of this class: name -> `__init__` overrides of the defaults.
    named_configs: dict[str, dict] = {}

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        """`ModelMixin.from_pretrained`, reading safetensors weights only: loading never unpickles.

        Every loader (this one, `LMLPPipeline.from_pretrained`, `DiffusionPipeline.from_pretrained`) comes through
        here, so a folder with only pickled weights (`.bin`) fails instead of being unpickled.

        Args:
            pretrained_model_name_or_path (`str` or `os.PathLike`): A Hub repo id or a local folder.
            **kwargs: Everything `ModelMixin.from_pretrained` takes (`subfolder`, `dtype`, `variant`, ...);
                `use_safetensors` may only be `True`.
        """
        if kwargs.get("use_safetensors") is False:
            raise ValueError(
                f"{cls.__name__} loads safetensors weights only, so that loading never unpickles; got "
                "use_safetensors=False. Convert trusted pickled weights once by loading them with torch.load(..., "
                "weights_only=True), load_state_dict, and save_pretrained (safetensors is the default)."
            )
        kwargs["use_safetensors"] = True
        return super().from_pretrained(pretrained_model_name_or_path, **kwargs)

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

    def _build(self, make_block: Callable[[int], nn.Module]) -> None:
        """Build token I/O and the stack from `self.config`.

        Args:
            make_block (`Callable[[int], nn.Module]`): Builds one block given the sequence length L.
        """
        self._check_config()
        config = self.config
        self.embed = TokenEmbedder(
            config.sample_size,
            config.patch_size,
            config.in_channels,
            config.hidden_size,
            config.text_embed_dim,
            config.text_seq_len,
        )
        seq_len = self.embed.seq_len
        self.stack = UShapedStack(config.num_layers, lambda: make_block(seq_len))
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
        """Raise a `ValueError` naming the first config field that cannot build the model, before any layer is built."""
        config = self.config
        name = type(self).__name__
        for field, (is_valid, requirement) in CONFIG_REQUIREMENTS.items():
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
        if int(config.hidden_size * config.mlp_ratio) < 1:
            raise ValueError(
                f"mlp_ratio={config.mlp_ratio} gives a joint MLP of int({config.hidden_size} × {config.mlp_ratio}) = 0 "
                f"hidden units; use mlp_ratio >= 1 / hidden_size (the papers use 4)."
            )

    @property
    def seq_len(self) -> int:
        """L = 1 + text_seq_len + (sample_size / patch_size)², the number of tokens every block mixes."""
        return self.embed.seq_len

    def initialize_weights(self) -> None:
        """The reference initialisation (reference-implementations.md §A.3), in one place.

        Every Linear-like weight (including the token-mixing matrices, the MoE experts and gates): truncated normal
        with std 0.02, biases 0. LayerNorms: weight 1, bias 0. Positional embedding: truncated normal, std 0.02.
        The two convolutions keep PyTorch's default init, as in the reference.
        """
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.trunc_normal_(module.weight, std=0.02)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
            elif isinstance(module, MoELinearAttention):
                nn.init.trunc_normal_(module.expert_weight, std=0.02)
                nn.init.zeros_(module.expert_bias)
        nn.init.trunc_normal_(self.embed.pos_embed, std=0.02)

    def _check_inputs(
        self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, timestep: torch.Tensor | float | int
    ) -> torch.Tensor:
        """Validate the inputs and return the timesteps as a float (B,) tensor.

        Timesteps must be real numbers in [0, `NUM_TRAIN_TIMESTEPS`); floats are fine (some diffusers schedulers
        pass them). On the meta device and under `torch.compile` the values are not checked.
        """
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
        timestep = torch.as_tensor(timestep, device=hidden_states.device)
        if timestep.dtype == torch.bool or timestep.is_complex():
            raise ValueError(
                f"timestep must hold real numbers (diffusers scheduler timesteps in [0, {NUM_TRAIN_TIMESTEPS})), got "
                f"dtype {timestep.dtype}."
            )
        # Values cannot be read on the meta device (shape-only runs, e.g. FLOP counting), and reading them under
        # torch.compile would split the graph.
        if timestep.device.type != "meta" and not torch.compiler.is_compiling():
            in_range = (timestep >= 0) & (timestep < NUM_TRAIN_TIMESTEPS)  # False for NaN
            if not in_range.all():
                raise ValueError(
                    f"timestep must lie in [0, {NUM_TRAIN_TIMESTEPS}) (diffusers scheduler timesteps t of the "
                    f"{NUM_TRAIN_TIMESTEPS}-step training schedule; the network embeds t + 1), got "
                    f"{timestep[in_range.logical_not()].tolist()}."
                )
        if timestep.ndim == 0 or timestep.shape == (1,):
            timestep = timestep.reshape(1).expand(batch_size)
        elif timestep.shape != (batch_size,):
            raise ValueError(
                f"timestep must be a scalar or a 1-D tensor of length {batch_size} (the batch size), got shape "
                f"{tuple(timestep.shape)}."
            )
        return timestep.float()

    def _predict(
        self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, timestep: torch.Tensor | float | int
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Validate, embed, run the stack and the head.

        Returns:
            `tuple`: the prediction (B, out_channels, H, W) and the per-block router probabilities (may be empty).
        """
        timestep = self._check_inputs(hidden_states, encoder_hidden_states, timestep)
        # The reference network's timestep n runs over 1..1000 and is diffusers' scheduler index t (0..999) plus 1.
        tokens = self.embed(hidden_states, encoder_hidden_states, timestep + 1)  # (B, L, D)
        tokens, router_probs = self.stack(tokens)  # (B, L, D)
        return self.head(tokens), router_probs
