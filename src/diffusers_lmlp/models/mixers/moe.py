"""Multi-head MoE-linear attention ("Many Can Beat One", §3.2, eqs. 4–7, §3.4 eq. 10, Algorithm 1) and `MoEMLPModel`,
the full-MLP backbone of "Many Can Beat One: MoE-Linear Attention for Full MLP Image Generation".

The MoE-MLP block is the L-MLP block with FNN_L replaced by a per-sample mixture of E learned L×L matrices per head:

    g[b, h]   = softmax_e( W_σ[h] · mean_{d ∈ head h} x_tok[b, :, d] + b_σ[h] )       (B, H, E)
    W[b, h]   = Σ_e g[b, h, e] · W_e[h]                                               (B, H, L, L)
    left[b, :, head h] = W[b, h] @ x_tok[b, :, head h] + Σ_e g[b, h, e] · b_e[h]        (B, L, D)

Where Algorithm 1 slips we read: the channel branch as FC_C, a D×D Linear (eqs. 3, 6); the token LayerNorm on the
un-normalised input, as in the L-MLP; one L→E gate per head on the head's mean channel (§3.4: heads share no experts;
the mean commutes with the gate and is D/H times cheaper); and a bias per expert, so E = H = 1 is the L-MLP block.
The pseudo-code zero-initialises the experts, which leaves the gate without gradient and the experts identical; we
draw each from the reference Linear init instead, so the router learns from the first step.
"""

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.loaders import PeftAdapterMixin
from diffusers.utils import BaseOutput
from torch import nn

from ...exports import public
from ..backbone import UShapedMixerModel
from ..catalog import NAMED_CONFIGS
from .channel_mlp import JointMLP
from .lmlp import LMLPBlock


class Router(nn.Module):
    """Softmax of gate logits (..., E) into expert probabilities, which `collect_router_probs` records by hooks."""

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.softmax(-1)


@contextlib.contextmanager
def collect_router_probs(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Yield a list that collects every `Router` output of `model` (one (B, ..., E) tensor per call, in order) while
    the context is open; a gradient-checkpointing recomputation in `backward`, after it closes, adds nothing."""
    outputs: list[torch.Tensor] = []
    handles = [
        module.register_forward_hook(lambda _module, _args, output: outputs.append(output))
        for module in model.modules()
        if isinstance(module, Router)
    ]
    try:
        yield outputs
    finally:
        for handle in handles:
            handle.remove()


class MoELinearAttention(nn.Module):
    """Token mixing by a per-sample mixture of E expert L×L matrices, for each of H channel heads (H divides D)."""

    def __init__(self, seq_len: int, hidden_size: int, num_experts: int, num_heads: int):
        super().__init__()
        if num_experts < 1 or num_heads < 1:
            raise ValueError(f"num_experts and num_heads must be >= 1, got {num_experts} and {num_heads}.")
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size ({hidden_size}) must be divisible by num_heads ({num_heads}).")
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
        """Mix the (B, D, L) token-normalised input (the paper's z') with the routed expert matrices."""
        batch_size, hidden_size, seq_len = x_tok.shape
        num_heads = self.num_heads
        # Each head's channels are one (D/H, L) slab of the contiguous z', so this is a view.
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
    """The MoE-MLP block: the reference L-MLP block with `MoELinearAttention` as its token mixer (eqs. 6–7)."""

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
        left = MoELinearAttention(seq_len, hidden_size, num_experts, num_heads)
        super().__init__(hidden_size, seq_len, mlp_ratio, norm_eps, channel_mlp=channel_mlp, left=left)


@dataclass
class MoEMLPModelOutput(BaseOutput):
    """Output of `MoEMLPModel`: the (B, out_channels, H, W) ε prediction `sample` and, with `output_router_probs`,
    the (num_blocks, B, H, E) gate probabilities `router_probs` (for `load_balancing_loss`)."""

    sample: torch.Tensor
    router_probs: torch.Tensor | None = None


@public
class MoEMLPModel(UShapedMixerModel, ConfigMixin, PeftAdapterMixin):
    """The U-shaped MoE-MLP backbone: the UL-MLP whose token mixing is multi-head MoE-linear attention
    (`MoEMLPBlock`); with one expert and one head it is the UL-MLP. The paper's models are the named configurations
    "2E1H", "4E1H" (the defaults) and "4E2H". LoRA can target `left.gates.<h>`, `right`, `merge` and
    `joint_mlp.fc1/fc2`; the experts only whole (`modules_to_save=["left"]`). Parameters are `UShapedMixerModel`'s
    (num_layers=16, mlp_ratio=4.0, norm_eps=1e-5), and `num_experts` E (L×L matrices, defaults to 4) and `num_heads`
    H (channel heads, each with its own experts and gate, defaults to 1)."""

    _no_split_modules = ["MoEMLPBlock"]
    _repeated_blocks = ["MoEMLPBlock"]
    named_configs = NAMED_CONFIGS["moe_mlp"]

    @register_to_config
    def __init__(
        self,
        sample_size: int = 32,
        patch_size: int = 2,
        in_channels: int = 4,
        out_channels: int | None = None,
        hidden_size: int = 512,
        num_layers: int = 16,
        mlp_ratio: float = 4.0,
        text_embed_dim: int = 768,
        text_seq_len: int = 77,
        conv_out: bool = True,
        norm_eps: float = 1e-5,
        num_experts: int = 4,
        num_heads: int = 1,
        channel_mlp: str = "mlp",
        pooled_text_projection: bool = False,
    ):
        super().__init__()
        self._build(
            lambda seq_len, skip: MoEMLPBlock(
                hidden_size, seq_len, mlp_ratio, norm_eps, num_experts, num_heads, channel_mlp=self.channel_mlp_class()
            )
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        timestep: torch.Tensor | float | int,
        output_router_probs: bool = False,
        return_dict: bool = True,
    ) -> MoEMLPModelOutput | tuple[torch.Tensor, ...]:
        """`UShapedMixerModel.forward`; with `output_router_probs` also every block's gate probabilities."""
        if output_router_probs:
            with collect_router_probs(self) as router_probs:
                sample = self._predict(hidden_states, encoder_hidden_states, timestep)
            router_probs = torch.stack(router_probs)  # (num_blocks, B, H, E), one Router per block
        else:
            sample, router_probs = self._predict(hidden_states, encoder_hidden_states, timestep), None
        if not return_dict:
            return (sample,) if router_probs is None else (sample, router_probs)
        return MoEMLPModelOutput(sample=sample, router_probs=router_probs)


def load_balancing_loss(router_probs: torch.Tensor, weight: float = 0.01, alpha: float = 1e-10) -> torch.Tensor:
    """The optional load-balancing loss of the MoE-MLP paper (§4.2), `weight` (the paper's 0.01) × the scalar to add
    to the diffusion loss. With u_e the batch-mean gate probability of expert e in one router (block × head) of the
    (num_blocks, B, H, E) `router_probs`, averaged over routers:

        L_balance = (σ_u / (μ_u + α))² − Σ_e (1/E) · log(u_e + α)

    Example:
        ```py
        out = model(latents, text_states, t, output_router_probs=True)
        loss = F.mse_loss(out.sample, noise) + load_balancing_loss(out.router_probs)
        ```
    """
    if router_probs.ndim != 4:
        raise ValueError(
            f"router_probs must be (num_blocks, B, H, E), got shape {tuple(router_probs.shape)}; pass the "
            "`.router_probs` of a MoEMLPModel output with output_router_probs=True."
        )
    usage = router_probs.float().mean(dim=1)  # (num_blocks, H, E)
    mean = usage.mean(-1)  # (num_blocks, H)
    std = usage.std(-1, correction=0)  # (num_blocks, H)
    coefficient_of_variation = (std / (mean + alpha)) ** 2
    cross_entropy = -torch.log(usage + alpha).mean(-1)
    return weight * (coefficient_of_variation + cross_entropy).mean()
