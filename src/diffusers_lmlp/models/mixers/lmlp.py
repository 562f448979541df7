"""The L-MLP block (Hu & Rostami 2024, §4.1 and Appendix A.2), exactly as the reference code computes it, and the
design variants of the paper's Table 1 (§5.2).

The reference block (Table 1's F2 and F2-deep):

    x = x + skip                                   (out blocks only: additive long skip, "second stage")
    x_tok = LN_L(xᵀ)                               on the un-normalised x, statistics over the L tokens: (B, D, L)
    x = LN_D(x)                                    the residual stream is re-normalised here
    x = x + merge(left(x_tok)ᵀ + right(x))         left: FNN_L over tokens, right: FNN_R over channels
    x = x + joint_mlp(LN_D(x))                     FNN_Z (the paper's FNN_C), with the same LN_D parameters

Both hemispheres are purely linear; the only non-linearity is the GELU of the joint MLP. The Table 1 variants
change one piece each (see `LMLPTransformer2DModel` for the named rows):

- first stage (FNN_L, FNN_R): a Linear (C1 onwards) or a one-hidden-layer MLP (A1, B1–B3, C1), optionally with a
  GELU after the Linear on the left branch only (E1) or on both (E2);
- merging: Add, Prod (element-wise product, B1, D1, E1) or GLU (the left branch gated by the sigmoid of the right,
  B2), followed by the Linear projection or not (B3);
- second stage: the joint MLP or none (A1, B1–B3);
- where an out block takes its long skip: into the residual stream at the block's input ("second stage": the
  reference, so it reaches the joint MLP; F2, F2-deep) or into the first stage's two branches only ("first stage":
  the residual stream does not carry it; F1).

Every layer is an `nn.Linear` or `nn.LayerNorm` called as a module (the token-axis ones on the permuted (B, D, L)
tensor, as in the reference), so forward hooks, PEFT adapters, quantizers and FLOP counters see all of them.
The reference code (zizhao-hu/L-MLP `libs/f2.py`) is followed where it differs from a textbook pre-norm reading of
the paper: the merge's residual lands on the normalised input, the D-axis LayerNorm is reused before the joint MLP,
and the L-axis LayerNorm reads the raw tokens.
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
    """One L-MLP block, `block(x (B, L, D), skip (B, L, D) | None) -> (B, L, D)`.

    The defaults are the reference block.

    Args:
        hidden_size (`int`): Token width D.
        seq_len (`int`): Number of tokens L.
        mlp_ratio (`float` or `None`): Joint-MLP (second stage) hidden width as a multiple of D; `None`: no second
            stage.
        norm_eps (`float`): LayerNorm epsilon.
        lateral_mlp_ratio (`float`, *optional*): Make FNN_L and FNN_R one-hidden-layer MLPs (Linear → GELU →
            Linear) with this hidden width as a multiple of L and D; `None` (default): single Linears.
        lateral_activation (`str`, *optional*, defaults to `"none"`): `"left"`: GELU after the left Linear (Table 1
            E1); `"both"`: after both (E2). Only with Linear branches.
        merging (`str`, *optional*, defaults to `"add"`): How the branches meet: `"add"`, `"prod"` or `"glu"`.
        merge_proj (`bool`, *optional*, defaults to `True`): Apply the Linear(D, D) after merging.
        skip_stage (`str`, *optional*, defaults to `"second_stage"`): Where the long skip enters (see the module
            docstring).
        channel_mlp (`Callable[[int, float], nn.Module]`, *optional*): The second stage's class (`JointMLP`).
        left (`nn.Module`, *optional*): A token mixer over the token axis of the permuted input, (B, D, L) ->
            (B, D, L), in place of FNN_L; the MoE-MLP block passes its routed mixer here.
    """

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
        if left is None:  # reference `l`, FNN_L: one bias per output token, shared by every channel
            left = nn.Linear(seq_len, seq_len) if lateral_mlp_ratio is None else JointMLP(seq_len, lateral_mlp_ratio)
        self.left = left
        # reference `r`, FNN_R
        self.right = (
            nn.Linear(hidden_size, hidden_size)
            if lateral_mlp_ratio is None
            else JointMLP(hidden_size, lateral_mlp_ratio)
        )
        self.merge = nn.Linear(hidden_size, hidden_size) if merge_proj else None  # reference `proj`
        self.joint_mlp = None if mlp_ratio is None else channel_mlp(hidden_size, mlp_ratio)  # reference `mlp`

    def _merge(self, left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
        """Z from the two (B, L, D) hemispheres."""
        if self.lateral_activation in ("left", "both"):
            left = F.gelu(left)
        if self.lateral_activation == "both":
            right = F.gelu(right)
        # `left` first, as the reference: Z then takes the left hemisphere's transposed layout, and the merge GEMM
        # reads that layout, so its sums round exactly as the reference's do (tests/test_reference_conversion.py).
        if self.merging == "add":
            z = left + right
        elif self.merging == "prod":
            z = left * right
        else:  # "glu"
            z = left * torch.sigmoid(right)
        return z if self.merge is None else self.merge(z)

    def forward(self, x: torch.Tensor, skip: torch.Tensor | None = None) -> torch.Tensor:
        """Run the block.

        Args:
            x (`torch.Tensor`): (B, L, D) tokens.
            skip (`torch.Tensor`, *optional*): (B, L, D) output of the matching in-block (out blocks only).

        Returns:
            `torch.Tensor`: the new tokens (B, L, D).
        """
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
