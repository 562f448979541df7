"""The L-MLP block (Hu & Rostami 2024, §4.1 and Appendix A.2), exactly as the reference code computes it.

    x = x + skip                                   (out blocks only: additive long skip)
    x_tok = LN_L(xᵀ)                               on the un-normalised x, statistics over the L tokens: (B, D, L)
    x = LN_D(x)                                    the residual stream is re-normalised here
    x = x + merge(left(x_tok)ᵀ + right(x))         left: FNN_L over tokens, right: FNN_R over channels
    x = x + joint_mlp(LN_D(x))                     the same LN_D parameters again

Both hemispheres are purely linear; the only non-linearity is the GELU of the joint MLP. Every layer is an
`nn.Linear` or `nn.LayerNorm` called as a module (the token-axis ones on the permuted (B, D, L) tensor, as in the
reference), so forward hooks, PEFT adapters, quantizers and FLOP counters see all of them.
See shared/reference/reference-implementations.md §A.2 and §A.7 for where this differs from a textbook
pre-norm reading of the paper.
"""

import torch
import torch.nn.functional as F
from torch import nn


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the MLP along channels.

        Args:
            x (`torch.Tensor`): (B, L, D) normalised input.

        Returns:
            `torch.Tensor`: (B, L, D) `fc2(gelu(fc1(x)))`.
        """
        return self.fc2(F.gelu(self.fc1(x)))  # (B, L, s·D) inside


class LMLPBlock(nn.Module):
    """One L-MLP block. Every mixer block shares the contract `block(x, skip) -> (x, router_probs)`.

    Args:
        hidden_size (`int`): Token width D.
        seq_len (`int`): Number of tokens L.
        mlp_ratio (`float`): Joint-MLP hidden width as a multiple of D.
        norm_eps (`float`): LayerNorm epsilon.
        left (`nn.Module`, *optional*): The token mixer over the token axis of the permuted input, (B, D, L) ->
            (B, D, L). Defaults to the L-MLP's single matrix, an `nn.Linear(L, L)` (one bias per output token,
            shared by every channel); the MoE-MLP block passes its routed mixer here and overrides `mix_tokens`.
    """

    def __init__(
        self, hidden_size: int, seq_len: int, mlp_ratio: float, norm_eps: float, left: nn.Module | None = None
    ):
        super().__init__()
        self.channel_norm = nn.LayerNorm(hidden_size, eps=norm_eps)  # reference `norm1`, used twice
        self.token_norm = nn.LayerNorm(seq_len, eps=norm_eps)  # reference `norm2`, over the token axis
        self.left = nn.Linear(seq_len, seq_len) if left is None else left  # reference `l`, FNN_L
        self.right = nn.Linear(hidden_size, hidden_size)  # reference `r`
        self.merge = nn.Linear(hidden_size, hidden_size)  # reference `proj`
        self.joint_mlp = JointMLP(hidden_size, mlp_ratio)  # reference `mlp`

    def mix_tokens(self, x_tok: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """FNN_L, the "left hemisphere": one learned L×L matrix mixes the tokens of every channel.

        Args:
            x_tok (`torch.Tensor`): (B, D, L) token-normalised input, tokens on the last axis.

        Returns:
            `tuple`: the mixed tokens (B, D, L), and `None` (a single matrix has no router).
        """
        return self.left(x_tok), None

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
        x_tok = self.token_norm(x.transpose(1, 2))  # (B, D, L), from the un-normalised x
        x = self.channel_norm(x)  # (B, L, D)
        left, router_probs = self.mix_tokens(x_tok)  # (B, D, L)
        x = x + self.merge(self.right(x) + left.transpose(1, 2))  # (B, L, D)
        x = x + self.joint_mlp(self.channel_norm(x))  # (B, L, D)
        return x, router_probs
