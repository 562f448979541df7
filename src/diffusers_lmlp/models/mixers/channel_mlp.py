"""Channel MLPs, the per-token MLP of a block, built as `make(hidden_size, mlp_ratio)` (`channel_mlp_factory` binds
the token layout of one with `needs_token_layout`). A model's `channel_mlp` config names a key of `CHANNEL_MLPS`."""

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


class JointMLP(nn.Module):
    """The transformer channel MLP (the L-MLP's FNN_C, U-ViT's `mlp`): Linear → GELU (exact) → Linear, hidden width
    int(D · mlp_ratio)."""

    def __init__(self, hidden_size: int, mlp_ratio: float):
        super().__init__()
        inner = int(hidden_size * mlp_ratio)
        self.fc1 = nn.Linear(hidden_size, inner)
        self.fc2 = nn.Linear(inner, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))  # (B, L, s·D) inside


class AGeLU(nn.Module):
    """The arbitrary GELU of eq. 4, `β · GELU(α · x + γ) + θ`, with learnable α, β, γ, θ per channel (eq. 6); it
    starts as the exact GELU (the paper gives no init)."""

    def __init__(self, num_features: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.empty(num_features))
        self.beta = nn.Parameter(torch.empty(num_features))
        self.gamma = nn.Parameter(torch.empty(num_features))
        self.theta = nn.Parameter(torch.empty(num_features))
        self.init_weights()

    def init_weights(self) -> None:
        """Start as the exact GELU: α = β = 1, γ = θ = 0."""
        nn.init.ones_(self.alpha)
        nn.init.ones_(self.beta)
        nn.init.zeros_(self.gamma)
        nn.init.zeros_(self.theta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.beta * F.gelu(self.alpha * x + self.gamma) + self.theta


class IMLP(nn.Module):
    """The improved MLP (IMLP) of "Improving MLP Module in Vision Transformer" (§4, Fig. 4), a swappable channel MLP.

        t = fc1(x)                                  W^d: D -> C'/2 (the paper's r = 2 when mlp_ratio = 4)
        t = concat(AGeLU(t), AGeLU'(t))             channel-wise enhancement, C' channels (eq. 5)
        t = GELU(norm(dw_conv(t)))                  spatial-wise enhancement: the DW block (§4.3)
        y = fc2(t)                                  W^e: C' -> D

    with C' = int(D · mlp_ratio), even, and no residual. The 3×3 depthwise conv (the paper's default, §5.1) reads the
    image tokens as a (B, C', g, g) grid and each time or text token as a 1×1 image. The norm is a per-token
    LayerNorm, not the paper's BatchNorm, which couples samples.
    """

    needs_token_layout = True

    def __init__(self, hidden_size: int, mlp_ratio: float, *, num_extra_tokens: int, grid_size: int):
        super().__init__()
        inner = int(hidden_size * mlp_ratio)
        if inner % 2:
            raise ValueError(
                f"The IMLP splits C' = int({hidden_size} × {mlp_ratio}) = {inner} between two AGeLUs of C'/2 channels "
                "(eq. 5), so C' must be even; choose a mlp_ratio that gives an even width (e.g. 4)."
            )
        self.num_extra_tokens = num_extra_tokens
        self.grid_size = grid_size
        self.fc1 = nn.Linear(hidden_size, inner // 2)  # W^d
        self.agelu = nn.ModuleList([AGeLU(inner // 2), AGeLU(inner // 2)])  # AGeLU and AGeLU'
        self.dw_conv = nn.Conv2d(inner, inner, 3, padding=1, groups=inner)
        self.norm = nn.LayerNorm(inner)
        self.fc2 = nn.Linear(inner, hidden_size)  # W^e

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, L, D) normalised tokens [time | text | image], L = num_extra_tokens + g² → (B, L, D)."""
        batch_size, seq_len, _ = x.shape
        g, num_extra = self.grid_size, self.num_extra_tokens
        if seq_len != num_extra + g * g:
            raise ValueError(
                f"IMLP was built for {num_extra} time/text tokens and a {g}×{g} image grid ({num_extra + g * g} "
                f"tokens), got {seq_len}; build it with the model's num_extra_tokens and grid_size."
            )
        t = self.fc1(x)  # (B, L, C'/2)
        t = torch.cat([agelu(t) for agelu in self.agelu], dim=-1)  # (B, L, C')
        channels = t.shape[-1]
        extra = t[:, :num_extra].reshape(batch_size * num_extra, channels, 1, 1)  # (B·(1+T), C', 1, 1)
        extra = self.dw_conv(extra).reshape(batch_size, num_extra, channels)  # (B, 1+T, C')
        image = t[:, num_extra:].transpose(1, 2).reshape(batch_size, channels, g, g)  # (B, C', g, g)
        image = self.dw_conv(image).flatten(2).transpose(1, 2)  # (B, g², C')
        t = F.gelu(self.norm(torch.cat([extra, image], dim=1)))  # (B, L, C')
        return self.fc2(t)  # (B, L, D)


CHANNEL_MLPS: dict[str, type[nn.Module]] = {"mlp": JointMLP, "imlp": IMLP}


def channel_mlp_factory(name: str, num_extra_tokens: int, grid_size: int) -> Callable[[int, float], nn.Module]:
    """The channel MLP class called `name`, as a `make(hidden_size, mlp_ratio)` with the token layout bound."""
    if name not in CHANNEL_MLPS:
        raise ValueError(f"channel_mlp={name!r} is not a channel MLP; choose one of {sorted(CHANNEL_MLPS)}.")
    if getattr(CHANNEL_MLPS[name], "needs_token_layout", False):
        return functools.partial(CHANNEL_MLPS[name], num_extra_tokens=num_extra_tokens, grid_size=grid_size)
    return CHANNEL_MLPS[name]
