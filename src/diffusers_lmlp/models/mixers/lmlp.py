"""The L-MLP block (Hu & Rostami 2024, §4.1 and Appendix A.2), exactly as the reference code computes it, and the
design variants of the paper's Table 1 (§5.2). The reference block (Table 1's F2 and F2-deep):

    x = x + skip                                   (out blocks only: additive long skip, "second stage")
    x_tok = LN_L(xᵀ)                               on the un-normalised x, statistics over the L tokens: (B, D, L)
    x = LN_D(x)                                    the residual stream is re-normalised here
    x = x + merge(left(x_tok)ᵀ + right(x))         left: FNN_L over tokens, right: FNN_R over channels
    x = x + joint_mlp(LN_D(x))                     FNN_Z (the paper's FNN_C), with the same LN_D parameters

The reference code (zizhao-hu/L-MLP) is followed where it differs from a pre-norm reading of the paper: the merge's
residual lands on the normalised input, LN_D is reused and LN_L reads the raw tokens. Each Table 1 variant changes
one piece (`LMLPBlock`'s arguments).
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .channel_mlp import JointMLP


MERGINGS = ("add", "prod", "glu")
LATERAL_ACTIVATIONS = ("none", "left", "both")
SKIP_STAGES = ("first_stage", "second_stage")


class LMLPBlock(nn.Module):
    """One L-MLP block, `block(x, skip) -> x` on (B, L, D); the defaults are the reference block. The options are
    `LMLPTransformer2DModel`'s (`skip_stage` is its `long_skip`); `channel_mlp` builds the second stage, and `left`
    is a (B, D, L) -> (B, D, L) token mixer in place of FNN_L (the MoE-MLP's)."""

    def __init__(
        self,
        hidden_size: int,
        seq_len: int,
        mlp_ratio: float | None,
        norm_eps: float,
        lateral_mlp_ratio: float | None = None,
        lateral_activation: str = "none",
        merging: str = "add",
        merge_proj: bool = True,
        skip_stage: str = "second_stage",
        channel_mlp: Callable[[int, float], nn.Module] = JointMLP,
        left: nn.Module | None = None,
    ):
        super().__init__()
        self.lateral_activation = lateral_activation
        self.merging = merging
        self.skip_stage = skip_stage
        self.channel_norm = nn.LayerNorm(hidden_size, eps=norm_eps)  # reference `norm1`, used twice
        self.token_norm = nn.LayerNorm(seq_len, eps=norm_eps)  # reference `norm2`, over the token axis

        def hemisphere(size: int) -> nn.Module:  # reference `l` (FNN_L, one bias per output token) and `r` (FNN_R)
            return nn.Linear(size, size) if lateral_mlp_ratio is None else JointMLP(size, lateral_mlp_ratio)

        self.left = hemisphere(seq_len) if left is None else left
        self.right = hemisphere(hidden_size)
        self.merge = nn.Linear(hidden_size, hidden_size) if merge_proj else None  # reference `proj`
        self.joint_mlp = None if mlp_ratio is None else channel_mlp(hidden_size, mlp_ratio)  # reference `mlp`

    def _merge(self, left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
        if self.lateral_activation in ("left", "both"):
            left = F.gelu(left)
        if self.lateral_activation == "both":
            right = F.gelu(right)
        # `left` first, as in the reference: Z takes its transposed layout, so the merge GEMM rounds as the reference.
        if self.merging == "add":
            z = left + right
        elif self.merging == "prod":
            z = left * right
        else:  # "glu"
            z = left * torch.sigmoid(right)
        return z if self.merge is None else self.merge(z)

    def forward(self, x: torch.Tensor, skip: torch.Tensor | None = None) -> torch.Tensor:
        first_stage_skip = skip is not None and self.skip_stage == "first_stage"
        if skip is not None and not first_stage_skip:
            x = x + skip
        lateral = x + skip if first_stage_skip else x  # (B, L, D), what the two hemispheres read
        x_tok = self.token_norm(lateral.transpose(1, 2))  # (B, D, L), from the un-normalised input
        x = self.channel_norm(x)  # (B, L, D)
        x_lateral = self.channel_norm(lateral) if first_stage_skip else x  # (B, L, D)
        x = x + self._merge(self.left(x_tok).transpose(1, 2), self.right(x_lateral))  # (B, L, D)
        if self.joint_mlp is not None:
            x = x + self.joint_mlp(self.channel_norm(x))  # (B, L, D)
        return x
