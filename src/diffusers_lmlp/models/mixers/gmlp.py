"""gMLP (Liu et al. 2021, "Pay Attention to MLPs") as a block of the U-shaped stack: L-MLP Table 1's baseline A3.

The gMLP block with its spatial gating unit (SGU), after labml.ai's annotated implementation, on (B, L, D) tokens:

    x = x + skip                                   (out blocks only: additive long skip, as the UL-MLP's)
    shortcut = x
    z = GELU(channel_proj1(LN_D(x)))               Z = σ(XU): D → d_ffn per token
    u, v = split(z)                                two halves of d_ffn / 2 channels (Z_1, Z_2)
    v = spatial_proj(LN(v)ᵀ)ᵀ                      f_{W,b}(Z_2) = W Z_2 + b: an L×L Linear over the token axis
    x = shortcut + channel_proj2(u ⊙ v)            Y = (Z_1 ⊙ f_{W,b}(Z_2)) V: d_ffn / 2 → D

As in the paper, W starts near zero and b at ones, so the gate starts ≈ 1 and passes Z_1 through.
"""

import torch
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.loaders import PeftAdapterMixin
from torch import nn

from ...exports import public
from ..backbone import UShapedMixerModel
from ..catalog import NAMED_CONFIGS


class SpatialGatingUnit(nn.Module):
    """s(Z) = Z_1 ⊙ f_{W,b}(LN(Z_2)), with f_{W,b} a Linear over the token axis: d_ffn → d_ffn / 2 channels."""

    def __init__(self, d_ffn: int, seq_len: int, norm_eps: float):
        super().__init__()
        self.norm = nn.LayerNorm(d_ffn // 2, eps=norm_eps)
        self.spatial_proj = nn.Linear(seq_len, seq_len)  # f_{W,b}: one bias per output token

    def init_weights(self) -> None:
        """W near zero (U(±0.01), the paper's "small values") and b = 1: the unit starts close to passing Z_1."""
        nn.init.uniform_(self.spatial_proj.weight, -0.01, 0.01)
        nn.init.ones_(self.spatial_proj.bias)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        u, v = z.chunk(2, dim=-1)  # (B, L, d_ffn / 2) each
        v = self.spatial_proj(self.norm(v).transpose(1, 2)).transpose(1, 2)  # (B, d_ffn / 2, L) inside
        return u * v


class GMLPBlock(nn.Module):
    """One gMLP block, `block(x, skip) -> x` on (B, L, D), d_ffn = int(D · mlp_ratio) even."""

    def __init__(self, hidden_size: int, seq_len: int, mlp_ratio: float, norm_eps: float):
        super().__init__()
        d_ffn = int(hidden_size * mlp_ratio)
        if d_ffn % 2:
            raise ValueError(
                f"mlp_ratio={mlp_ratio} gives gMLP a width d_ffn = int({hidden_size} × {mlp_ratio}) = {d_ffn}, which "
                "is odd; the spatial gating unit splits it in halves. Choose an even width (e.g. mlp_ratio="
                f"{(d_ffn + 1.5) / hidden_size:.6g}: d_ffn = {d_ffn + 1})."
            )
        self.norm = nn.LayerNorm(hidden_size, eps=norm_eps)
        self.channel_proj1 = nn.Linear(hidden_size, d_ffn)  # U
        self.sgu = SpatialGatingUnit(d_ffn, seq_len, norm_eps)
        self.channel_proj2 = nn.Linear(d_ffn // 2, hidden_size)  # V

    def forward(self, x: torch.Tensor, skip: torch.Tensor | None = None) -> torch.Tensor:
        if skip is not None:
            x = x + skip
        z = F.gelu(self.channel_proj1(self.norm(x)))  # (B, L, d_ffn)
        z = self.sgu(z)  # (B, L, d_ffn / 2)
        return x + self.channel_proj2(z)  # (B, L, D)


@public
class GMLPTransformer2DModel(UShapedMixerModel, ConfigMixin, PeftAdapterMixin):
    """gMLP blocks ([gMLP](https://arxiv.org/abs/2105.08050)) in the U-shaped text-to-image backbone: COCO-size with
    the gMLP paper's d_ffn = 6·D by default, L-MLP Table 1's A3 as "A3". Parameters are `UShapedMixerModel`'s
    (num_layers=12, mlp_ratio=6.0: an even d_ffn as a multiple of D; norm_eps=1e-5) with `long_skips`. LoRA can target
    `channel_proj1`, `sgu.spatial_proj` and `channel_proj2`."""

    _no_split_modules = ["GMLPBlock"]
    _repeated_blocks = ["GMLPBlock"]
    named_configs = NAMED_CONFIGS["gmlp"]

    @register_to_config
    def __init__(
        self,
        sample_size: int = 32,
        patch_size: int = 2,
        in_channels: int = 4,
        out_channels: int | None = None,
        hidden_size: int = 512,
        num_layers: int = 12,
        mlp_ratio: float = 6.0,
        text_embed_dim: int = 768,
        text_seq_len: int = 77,
        conv_out: bool = True,
        norm_eps: float = 1e-5,
        long_skips: bool = True,
        pooled_text_projection: bool = False,
    ):
        super().__init__()
        self._build(lambda seq_len, skip: GMLPBlock(hidden_size, seq_len, mlp_ratio, norm_eps))
