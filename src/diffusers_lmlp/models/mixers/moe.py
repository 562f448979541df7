"""Multi-head MoE-linear attention ("Many Can Beat One", §3.2, eqs. 4–7, §3.4 eq. 10, Algorithm 1).

The MoE-MLP block is the L-MLP block with its single token-mixing matrix (FNN_L) replaced by a per-sample
mixture of E learned L×L matrices, one set per channel head:

    g[b, h]   = softmax_e( W_σ[h] · mean_{d ∈ head h} x_tok[b, :, d] + b_σ[h] )       (B, H, E)
    W[b, h]   = Σ_e g[b, h, e] · W_e[h]                                               (B, H, L, L)
    left[b, :, head h] = W[b, h] @ x_tok[b, :, head h] + Σ_e g[b, h, e] · b_e[h]        (B, L, D)

How we read the paper where its pseudo-code slips (Algorithm 1):

- The channel branch is written `nn.Linear(L, E)`; eqs. 3 and 6 make it FC_C, a D×D linear. It is the L-MLP's
  `right` Linear(D, D) here.
- `norm2(x)` is applied to `x`, not to the permuted `xperm`; the text (and the L-MLP block it extends) normalises
  the permuted input over L. We apply the token LayerNorm to the un-normalised input, as the L-MLP does.
- The gate `l_gate(xperm).view(B, H, D, E).mean(2)` only works if D there means the head width D/H. §3.4 says the
  gating layers have weights of size L × H × E and that heads do not share experts. So each head h has its own
  L→E gate; its logits are those of the head's channels averaged. A linear map commutes with the mean, so we
  average the head's channels first (D/H times cheaper) and then apply the gate.
- The experts have no bias in the pseudo-code. We give each expert the bias of an `nn.Linear(L, L)`, mixed by the
  same gate weights, so that with E = 1 and H = 1 the block is exactly the L-MLP block (bias included).

Cost: forming W[b, h] costs H·E·L² multiply-adds per sample and applying it L²·D, instead of the E·L²·D of
applying every expert. There are no Python loops over experts; the only loop runs over the H gates.

What is a module: each head's gate is an `nn.Linear(L, E)` followed by the `Router` softmax, both called as modules
(the model collects the router probabilities with hooks on `Router`, so the block returns only its tokens), so hooks, quantizers and PEFT LoRA
adapters (target `left.gates.<h>`) see it. The expert matrices are parameters of `MoELinearAttention`: they are
mixed per sample (Σ_e g_e·W_e, then one bmm), which is not a Linear layer, so LoRA cannot target them; fine-tune
them whole with PEFT's `modules_to_save=["left"]`, or adapt the block's Linear layers around them.

Expert initialisation: the pseudo-code zero-initialises every expert. That makes them identical and the token
mixing a zero map at the start, so the gate gets no gradient (∂left/∂g_e = W_e x = 0) and the experts receive
gradients that differ only by the near-uniform gate weights: they stay almost identical. We instead draw each
expert independently from the reference's Linear init (truncated normal, std 0.02), so experts differ and the
router learns from the first step; with E = 1 the distribution equals the L-MLP's.
"""

from collections.abc import Callable

import torch
from torch import nn

from .channel_mlp import JointMLP
from .lmlp import LMLPBlock
from .routing import Router


class MoELinearAttention(nn.Module):
    """Token mixing by a per-sample, per-head mixture of expert L×L matrices.

    Args:
        seq_len (`int`): Number of tokens L.
        hidden_size (`int`): Token width D; must be divisible by `num_heads`.
        num_experts (`int`): Experts E per head.
        num_heads (`int`): Channel heads H; each head has its own experts and gate.
    """

    def __init__(self, seq_len: int, hidden_size: int, num_experts: int, num_heads: int):
        super().__init__()
        if num_experts < 1 or num_heads < 1:
            raise ValueError(f"num_experts and num_heads must be >= 1, got {num_experts} and {num_heads}.")
        if hidden_size % num_heads:
            raise ValueError(
                f"hidden_size ({hidden_size}) must be divisible by num_heads ({num_heads}): each head mixes "
                f"hidden_size / num_heads channels. Pick num_heads among the divisors of {hidden_size}."
            )
        self.num_experts = num_experts
        self.num_heads = num_heads
        self.expert_weight = nn.Parameter(torch.empty(num_heads, num_experts, seq_len, seq_len))  # (H, E, Lo, Li)
        self.expert_bias = nn.Parameter(torch.zeros(num_heads, num_experts, seq_len))  # (H, E, L)
        self.gates = nn.ModuleList(nn.Linear(seq_len, num_experts) for _ in range(num_heads))  # W_σ[h]: L -> E
        self.router = Router()

    def init_weights(self) -> None:
        """Draw every expert from the reference Linear init (truncated normal, std 0.02; bias 0), independently."""
        nn.init.trunc_normal_(self.expert_weight, std=0.02)
        nn.init.zeros_(self.expert_bias)

    def forward(self, x_tok: torch.Tensor) -> torch.Tensor:
        """Mix tokens with the routed expert matrices.

        Args:
            x_tok (`torch.Tensor`): (B, D, L) token-normalised input, tokens on the last axis (the paper's z').

        Returns:
            `torch.Tensor`: the mixed tokens (B, D, L).
        """
        batch_size, hidden_size, seq_len = x_tok.shape
        num_heads = self.num_heads
        # Each head's channels are one (D/H, L) slab of z'; the token LayerNorm leaves z' contiguous, so this is a view.
        x_perm = x_tok.reshape(batch_size * num_heads, hidden_size // num_heads, seq_len)  # (B·H, D/H, L)

        head_mean = x_perm.mean(1).view(batch_size, num_heads, seq_len)  # (B, H, L)
        logits = torch.stack([gate(head_mean[:, h]) for h, gate in enumerate(self.gates)], dim=1)  # (B, H, E)
        router_probs = self.router(logits)  # (B, H, E)

        probs_by_head = router_probs.transpose(0, 1)  # (H, B, E)
        weight = torch.bmm(probs_by_head, self.expert_weight.flatten(2))  # (H, B, L·L)
        bias = torch.bmm(probs_by_head, self.expert_bias)  # (H, B, L)
        weight = weight.transpose(0, 1).reshape(batch_size * num_heads, seq_len, seq_len)  # (B·H, L, L)
        bias = bias.transpose(0, 1).reshape(batch_size * num_heads, 1, seq_len)  # (B·H, 1, L)

        mixed = torch.baddbmm(bias, x_perm, weight.transpose(1, 2))  # (B·H, D/H, L): z'_h W_hᵀ, eq. 5
        return mixed.view(batch_size, hidden_size, seq_len)  # (B, D, L)


class MoEMLPBlock(LMLPBlock):
    """The MoE-MLP block: the reference L-MLP block with `MoELinearAttention` as its token mixer (eqs. 6–7).

    Args:
        hidden_size (`int`): Token width D.
        seq_len (`int`): Number of tokens L.
        mlp_ratio (`float`): Joint-MLP hidden width as a multiple of D.
        norm_eps (`float`): LayerNorm epsilon.
        num_experts (`int`): Experts E per head.
        num_heads (`int`): Channel heads H.
        channel_mlp (`Callable[[int, float], nn.Module]`, *optional*): The joint MLP's class (`JointMLP`).
    """

    def __init__(
        self,
        hidden_size: int,
        seq_len: int,
        mlp_ratio: float,
        norm_eps: float,
        num_experts: int,
        num_heads: int,
        channel_mlp: Callable[[int, float], nn.Module] = JointMLP,
    ):
        super().__init__(
            hidden_size,
            seq_len,
            mlp_ratio,
            norm_eps,
            channel_mlp=channel_mlp,
            left=MoELinearAttention(seq_len, hidden_size, num_experts, num_heads),
        )


def load_balancing_loss(router_probs: torch.Tensor, weight: float = 0.01, alpha: float = 1e-10) -> torch.Tensor:
    """The optional load-balancing loss of the MoE-MLP paper (§4.2, Table 4), off unless a training loop adds it.

    For every router (block × head), u_e is the mean gate probability of expert e over the batch, and

        L_balance = (σ_u / (μ_u + α))² − Σ_e (1/E) · log(u_e + α)

    (squared coefficient of variation plus the cross-entropy towards uniform usage). The result is averaged over
    routers and multiplied by `weight`. The paper trains its main models without it and uses weight 0.01 when on.

    Args:
        router_probs (`torch.Tensor`): (num_blocks, B, H, E) gate probabilities, as returned by
            `MoEMLPModel(..., output_router_probs=True).router_probs`.
        weight (`float`, *optional*, defaults to 0.01): Loss weight (Shazeer et al. 2017, as in the paper).
        alpha (`float`, *optional*, defaults to 1e-10): Small constant for numerical stability.

    Returns:
        `torch.Tensor`: Scalar loss, ready to add to the diffusion loss.

    Example:
        ```py
        out = model(latents, text_states, t, output_router_probs=True)
        loss = F.mse_loss(out.sample, noise) + load_balancing_loss(out.router_probs)
        ```
    """
    if router_probs.ndim != 4:
        raise ValueError(
            f"router_probs must be (num_blocks, B, H, E), got shape {tuple(router_probs.shape)}. "
            "Pass `.router_probs` of a MoEMLPModel output computed with output_router_probs=True."
        )
    usage = router_probs.float().mean(dim=1)  # (num_blocks, H, E)
    mean = usage.mean(-1)  # (num_blocks, H)
    std = usage.std(-1, correction=0)  # (num_blocks, H)
    coefficient_of_variation = (std / (mean + alpha)) ** 2
    cross_entropy = -torch.log(usage + alpha).mean(-1)
    return weight * (coefficient_of_variation + cross_entropy).mean()
