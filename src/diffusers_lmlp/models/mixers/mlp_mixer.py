"""MLP-Mixer (Tolstikhin et al. 2021) as a block of the U-shaped stack: L-MLP Table 1's baseline A2 (§5.2).

The original Mixer block (its §2, eq. 1): a token MLP (L → D_S → L) over the transposed tokens, then a channel MLP
(D → D_C → D), each after its own per-token LayerNorm(D) and with a residual; out blocks first add their long skip.
"""

from collections.abc import Callable

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.loaders import PeftAdapterMixin
from torch import nn

from ...exports import public
from ..backbone import CONFIG_REQUIREMENTS, UShapedMixerModel, _is_positive_real, check_width
from ..catalog import NAMED_CONFIGS
from .channel_mlp import JointMLP


class MLPMixerBlock(nn.Module):
    """One MLP-Mixer block, `block(x, skip) -> x` on (B, L, D), with D_S = L · token_mlp_ratio."""

    def __init__(
        self,
        hidden_size: int,
        seq_len: int,
        token_mlp_ratio: float,
        mlp_ratio: float,
        norm_eps: float,
        channel_mlp: Callable[[int, float], nn.Module] = JointMLP,
    ):
        super().__init__()
        check_width("token_mlp_ratio", token_mlp_ratio, seq_len, "token MLP")
        self.norm1 = nn.LayerNorm(hidden_size, eps=norm_eps)
        self.token_mlp = JointMLP(seq_len, token_mlp_ratio)  # L -> D_S -> L, over the token axis
        self.norm2 = nn.LayerNorm(hidden_size, eps=norm_eps)
        self.channel_mlp = channel_mlp(hidden_size, mlp_ratio)  # D -> D_C -> D, per token

    def forward(self, x: torch.Tensor, skip: torch.Tensor | None = None) -> torch.Tensor:
        if skip is not None:
            x = x + skip
        x = x + self.token_mlp(self.norm1(x).transpose(1, 2)).transpose(1, 2)  # (B, D, L) inside
        return x + self.channel_mlp(self.norm2(x))  # (B, L, D)


@public
class MLPMixerTransformer2DModel(UShapedMixerModel, ConfigMixin, PeftAdapterMixin):
    """MLP-Mixer blocks ([MLP-Mixer](https://arxiv.org/abs/2105.01601)) in the U-shaped text-to-image backbone:
    COCO-size with the Mixer paper's D_C = 4·D by default, L-MLP Table 1's A2 as "A2". Parameters are
    `UShapedMixerModel`'s (num_layers=12, mlp_ratio=4.0, norm_eps=1e-5) with `long_skips` and `channel_mlp`, and
    `token_mlp_ratio` (defaults to 2.0): D_S as a multiple of L. LoRA can target `token_mlp.fc1/fc2` and
    `channel_mlp.fc1/fc2`."""

    _no_split_modules = ["MLPMixerBlock"]
    _repeated_blocks = ["MLPMixerBlock"]
    config_requirements = {
        **CONFIG_REQUIREMENTS,
        "token_mlp_ratio": (_is_positive_real, "a positive finite number (the token MLP's width as a multiple of L)"),
    }
    named_configs = NAMED_CONFIGS["mlp_mixer"]

    @register_to_config
    def __init__(
        self,
        sample_size: int = 32,
        patch_size: int = 2,
        in_channels: int = 4,
        out_channels: int | None = None,
        hidden_size: int = 512,
        num_layers: int = 12,
        mlp_ratio: float = 4.0,
        text_embed_dim: int = 768,
        text_seq_len: int = 77,
        conv_out: bool = True,
        norm_eps: float = 1e-5,
        token_mlp_ratio: float = 2.0,
        long_skips: bool = True,
        channel_mlp: str = "mlp",
        pooled_text_projection: bool = False,
    ):
        super().__init__()
        self._build(
            lambda seq_len, skip: MLPMixerBlock(
                hidden_size, seq_len, token_mlp_ratio, mlp_ratio, norm_eps, channel_mlp=self.channel_mlp_class()
            )
        )
