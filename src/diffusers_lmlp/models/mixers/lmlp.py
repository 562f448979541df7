"""The L-MLP block (Hu & Rostami 2024, §4.1 and Appendix A.2), exactly as the reference code computes it.

    x = x + skip                                   (out blocks only: additive long skip)
    x_tok = LN_L(x)                                on the un-normalised x, statistics over the L tokens
    x = LN_D(x)                                    the residual stream is re-normalised here
    x = x + merge(left(x_tok) + right(x))          left: FNN_L over tokens, right: FNN_R over channels
    x = x + joint_mlp(LN_D(x))                     the same LN_D parameters again

Both hemispheres are purely linear; the only non-linearity is the GELU of the joint MLP.
See shared/reference/reference-implementations.md §A.2 and §A.7 for where this differs from a textbook
pre-norm reading of the paper.
"""

import torch
import torch.nn.functional as F
from torch import nn


class TokenLayerNorm(nn.Module):
    """LayerNorm over the token axis of a (B, L, D) tensor, with one affine pair per token position.

    This is the reference's `norm2` applied to the transposed input: statistics per (sample, channel) over all
    L tokens (time, text and image together).

    Args:
        seq_len (`int`): Number of tokens L.
        eps (`float`): LayerNorm epsilon.
    """

    def __init__(self, seq_len: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(seq_len))
        self.bias = nn.Parameter(torch.zeros(seq_len))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise over tokens.

        Args:
            x (`torch.Tensor`): (B, L, D).

        Returns:
            `torch.Tensor`: (B, L, D), a transposed view of a (B, D, L) buffer (matmul consumes it without a copy).
        """
        x_perm = x.transpose(1, 2)  # (B, D, L)
        x_perm = F.layer_norm(x_perm, x_perm.shape[-1:], self.weight, self.bias, self.eps)
        return x_perm.transpose(1, 2)  # (B, L, D)


class TokenLinear(nn.Module):
    """FNN_L, the "left hemisphere": one learned L×L matrix that mixes tokens, shared by every channel.

    Args:
        seq_len (`int`): Number of tokens L.
    """

    def __init__(self, seq_len: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(seq_len, seq_len))  # (L_out, L_in), as nn.Linear stores it
        self.bias = nn.Parameter(torch.zeros(seq_len))  # one bias per output token, broadcast over channels

    def forward(self, x_tok: torch.Tensor) -> tuple[torch.Tensor, None]:
        """Mix tokens.

        Args:
            x_tok (`torch.Tensor`): (B, L, D) token-normalised input.

        Returns:
            `tuple`: the mixed tokens (B, L, D), and `None` (a single matrix has no router).
        """
        mixed = torch.baddbmm(self.bias[:, None], self.weight.expand(x_tok.shape[0], -1, -1), x_tok)  # (B, L, D)
        return mixed, None


def residual_linear(residual: torch.Tensor, x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """`residual + linear(x)` with the bias and the residual folded into one in-place GEMM (its beta = 1 epilogue).

    PyTorch's `addmm` first writes the broadcast bias into its output and a separate add then reads two tensors;
    here one pass builds `residual + bias` and the GEMM accumulates into it. On two CPU cores this lifts an L-MLP
    block from ~81% to ~90% of the GEMM peak (benchmarks/). When the dtypes differ (under autocast: a low-precision
    input, a full-precision residual), the plain form keeps autocast's dtype policy.

    Args:
        residual (`torch.Tensor`): (B, L, D_out).
        x (`torch.Tensor`): (B, L, D_in).
        linear (`nn.Linear`): D_in -> D_out.

    Returns:
        `torch.Tensor`: (B, L, D_out).
    """
    if not residual.dtype == x.dtype == linear.weight.dtype:
        return residual + linear(x)
    out = (residual + linear.bias).flatten(0, 1)  # (B·L, D_out)
    return out.addmm_(x.flatten(0, 1), linear.weight.t()).view_as(residual)


class JointMLP(nn.Module):
    """FNN_C: the transformer-style channel MLP, Linear → GELU (exact) → Linear.

    Args:
        hidden_size (`int`): Token width D.
        mlp_ratio (`float`): Hidden width as a multiple of D (the papers' s).
    """

    def __init__(self, hidden_size: int, mlp_ratio: float):
        super().__init__()
        inner = int(hidden_size * mlp_ratio)
        self.fc1 = nn.Linear(hidden_size, inner)
        self.fc2 = nn.Linear(inner, hidden_size)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Apply the MLP along channels and add the result to the residual stream.

        Args:
            x (`torch.Tensor`): (B, L, D) normalised input.
            residual (`torch.Tensor`): (B, L, D) stream the output is added to.

        Returns:
            `torch.Tensor`: (B, L, D) `residual + fc2(gelu(fc1(x)))`.
        """
        return residual_linear(residual, F.gelu(self.fc1(x)), self.fc2)  # (B, L, s·D) inside


class LMLPBlock(nn.Module):
    """One L-MLP block. Every mixer block shares the contract `block(x, skip) -> (x, router_probs)`.

    Args:
        hidden_size (`int`): Token width D.
        seq_len (`int`): Number of tokens L.
        mlp_ratio (`float`): Joint-MLP hidden width as a multiple of D.
        norm_eps (`float`): LayerNorm epsilon.
        left (`nn.Module`, *optional*): The token mixer, (B, L, D) -> ((B, L, D), router_probs | None).
            Defaults to the L-MLP's single matrix `TokenLinear`; the MoE-MLP block passes its routed mixer here.
    """

    def __init__(
        self, hidden_size: int, seq_len: int, mlp_ratio: float, norm_eps: float, left: nn.Module | None = None
    ):
        super().__init__()
        self.channel_norm = nn.LayerNorm(hidden_size, eps=norm_eps)  # reference `norm1`, used twice
        self.token_norm = TokenLayerNorm(seq_len, eps=norm_eps)  # reference `norm2`
        self.left = TokenLinear(seq_len) if left is None else left  # reference `l`
        self.right = nn.Linear(hidden_size, hidden_size)  # reference `r`
        self.merge = nn.Linear(hidden_size, hidden_size)  # reference `proj`
        self.joint_mlp = JointMLP(hidden_size, mlp_ratio)  # reference `mlp`

    def forward(self, x: torch.Tensor, skip: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the block.

        Args:
            x (`torch.Tensor`): (B, L, D) tokens.
            skip (`torch.Tensor`, *optional*): (B, L, D) output of the matching in-block (out blocks only).

        Returns:
            `tuple`: the new tokens (B, L, D), and the router probabilities of the token mixer
            ((B, H, E) for a routed mixer, else `None`).
        """
        if skip is not None:
            x = x + skip
        x_tok = self.token_norm(x)  # (B, L, D), from the un-normalised x
        x = self.channel_norm(x)  # (B, L, D)
        left, router_probs = self.left(x_tok)  # (B, L, D)
        x = residual_linear(x, self.right(x).add_(left), self.merge)  # x + merge(left + right)
        x = self.joint_mlp(self.channel_norm(x), residual=x)  # x + joint_mlp(LN_D(x))
        return x, router_probs
