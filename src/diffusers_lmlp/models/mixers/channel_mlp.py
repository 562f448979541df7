"""Channel MLPs: the per-token MLP of a block, swappable in any family (timm style: one constructor signature).

Every class here is built as `make(hidden_size, mlp_ratio)`; a class that needs the token layout (the image grid
behind the time and text tokens) sets `needs_token_layout = True` and takes the layout as the keyword arguments
`num_extra_tokens` and `grid_size`, which `channel_mlp_factory` binds from the model's config. A model names its channel MLP by the config value `channel_mlp`, a key of `CHANNEL_MLPS`.
"""

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


class JointMLP(nn.Module):
    """The transformer channel MLP (the L-MLP's FNN_C, U-ViT's `mlp`): Linear → GELU (exact) → Linear.

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


# The IMLP's depthwise kernel: n = 3, the paper's default (§5.1; Table 5 ablates 1, 3, 5, 7).
DW_KERNEL_SIZE = 3


class AGeLU(nn.Module):
    """The arbitrary GELU of eq. 4, `AGeLU(x) = β · GELU(α · x + γ) + θ`, with per-channel learnable α, β, γ, θ.

    The paper gives no initialisation; `init_weights` starts it as the exact GELU (α = β = 1, γ = θ = 0). The
    IMLP's two copies (AGeLU and AGeLU' of eq. 5) therefore start identical and only differ after training: their
    gradients differ from the first step, because the two halves of the concatenation meet different depthwise
    kernels and different columns of the second Linear.

    Args:
        num_features (`int`): Channels C'/2 of the last axis, each with its own α, β, γ, θ (eq. 6).
    """

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
        """Apply AGeLU channel-wise.

        Args:
            x (`torch.Tensor`): (..., num_features) input.

        Returns:
            `torch.Tensor`: (..., num_features) `β · GELU(α · x + γ) + θ`.
        """
        return self.beta * F.gelu(self.alpha * x + self.gamma) + self.theta


def _imlp_hidden_width(hidden_size: int, mlp_ratio: float) -> int:
    """C' = int(hidden_size · mlp_ratio), which the two AGeLUs share in halves, so it must be even."""
    inner = int(hidden_size * mlp_ratio)
    if inner % 2:
        raise ValueError(
            f"The IMLP splits its hidden width C' = int(hidden_size × mlp_ratio) = int({hidden_size} × {mlp_ratio}) "
            f"= {inner} between two AGeLUs of C'/2 channels (eq. 5), so C' must be even; choose a mlp_ratio that "
            "gives an even width (e.g. 4)."
        )
    return inner


class IMLP(nn.Module):
    """The improved MLP (IMLP) of "Improving MLP Module in Vision Transformer" (§4, Fig. 4), a swappable channel MLP.

        t = fc1(x)                                  W^d: D -> C'/2 (the paper's r = 2 when mlp_ratio = 4)
        t = concat(AGeLU(t), AGeLU'(t))             channel-wise enhancement, C' channels (eq. 5)
        t = GELU(norm(dw_conv(t)))                  spatial-wise enhancement: the DW block (§4.3)
        y = fc2(t)                                  W^e: C' -> D

    with C' = int(D · mlp_ratio), so the first Linear has half the outputs of the transformer MLP's. The DW block is
    a 3×3 depthwise convolution (with bias) over the image tokens, the last grid_size² tokens read row-major as a
    (B, C', g, g) image, followed by a norm and the exact GELU, without a residual (the paper draws none).

    Our readings where a diffusion backbone differs from the paper's classifiers:

    - Time and text tokens. The 1 + T tokens before the image have no place on the grid. Each goes through the
      same DW block as a 1×1 image: the zero-padded 3×3 kernel sees its centre tap only, so the convolution is a
      per-channel scale and bias there. Every token then reaches fc2 through the same conv → norm → GELU path, so
      fc2's shared weights read one kind of input (skipping the DW block would feed it raw AGeLU outputs for some
      tokens and normalised GELU outputs for others). The flop counter counts 9·C' MACs for each of these tokens
      too, as for a border pixel of the grid, so the MACs are 9·C' per token whatever the layout.
    - Norm. The paper's DW block uses BatchNorm, which in training mode couples the samples of a batch and keeps
      running statistics that gradient checkpointing would update twice per step. We use a LayerNorm over the C'
      channels of each token instead: per sample and per token, identical in training and evaluation, the
      transformer's own norm, and one rule for grid and non-grid tokens alike.

    Args:
        hidden_size (`int`): Token width D (the paper's C).
        mlp_ratio (`float`): Hidden width C' as a multiple of D; int(D · mlp_ratio) must be even.
        num_extra_tokens (`int`): Time and text tokens before the image tokens (1 + text_seq_len).
        grid_size (`int`): Side g of the square grid of image tokens (sample_size / patch_size).
    """

    needs_token_layout = True

    def __init__(self, hidden_size: int, mlp_ratio: float, *, num_extra_tokens: int, grid_size: int):
        super().__init__()
        inner = _imlp_hidden_width(hidden_size, mlp_ratio)
        self.num_extra_tokens = num_extra_tokens
        self.grid_size = grid_size
        self.fc1 = nn.Linear(hidden_size, inner // 2)  # W^d
        self.agelu = nn.ModuleList([AGeLU(inner // 2), AGeLU(inner // 2)])  # AGeLU and AGeLU'
        self.dw_conv = nn.Conv2d(inner, inner, DW_KERNEL_SIZE, padding=DW_KERNEL_SIZE // 2, groups=inner)
        self.norm = nn.LayerNorm(inner)
        self.fc2 = nn.Linear(inner, hidden_size)  # W^e

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the IMLP to every token.

        Args:
            x (`torch.Tensor`): (B, L, D) normalised tokens, [time | text | image], L = num_extra_tokens + g².

        Returns:
            `torch.Tensor`: (B, L, D).
        """
        batch_size, seq_len, _ = x.shape
        g, num_extra = self.grid_size, self.num_extra_tokens
        if seq_len != num_extra + g * g:
            raise ValueError(
                f"IMLP was built for {num_extra} time/text tokens and a {g}×{g} image grid ({num_extra + g * g} "
                f"tokens), got {seq_len}; build it with the num_extra_tokens and grid_size of the model's layout."
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


# config value -> class
CHANNEL_MLPS: dict[str, type[nn.Module]] = {"mlp": JointMLP, "imlp": IMLP}


def channel_mlp_factory(name: str, num_extra_tokens: int, grid_size: int) -> Callable[[int, float], nn.Module]:
    """The channel MLP class called `name`, as a `make(hidden_size, mlp_ratio)` factory.

    Args:
        name (`str`): A key of `CHANNEL_MLPS` (the model config's `channel_mlp`).
        num_extra_tokens (`int`): Time and text tokens before the image tokens (1 + text_seq_len).
        grid_size (`int`): Side of the square grid of image tokens (sample_size / patch_size).
    """
    if name not in CHANNEL_MLPS:
        raise ValueError(f"channel_mlp={name!r} is not a channel MLP; choose one of {sorted(CHANNEL_MLPS)}.")
    if getattr(CHANNEL_MLPS[name], "needs_token_layout", False):
        return functools.partial(CHANNEL_MLPS[name], num_extra_tokens=num_extra_tokens, grid_size=grid_size)
    return CHANNEL_MLPS[name]
