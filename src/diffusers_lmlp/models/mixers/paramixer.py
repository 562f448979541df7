"""ParaMixer, SymMixer and AsymMixer (Karakida, Ota & Taki 2024, "Hierarchical Associative Memory, Parallelized
MLP-Mixer, and Symmetry Breaking", eqs. 32, 38–39) as U-shaped diffusion backbones.

One parallelized mixing layer (eq. 32, the reference `pMixerBlock`) reads one symmetric LayerNorm:

    x = x + skip                                          (out blocks only: the long skip, added at the block input)
    x̂ = LN_{L,D}(x)                                       statistics over tokens and channels jointly, affine (L, D)
    x = x + token_mlp(x̂ᵀ)ᵀ + channel_mlp(x̂)               parallel: both branches read the same x̂

The MLPs are bias-free with GELU; the families differ only in them (`VanillaMLP`, `SymmetricMLP`, `AsymmetricMLP`).
Unlike the reference classifier (Toshihiro-Ota/paramixer) the init is the package's and there is no dropout. LoRA
adapts the tied W as parameters (`LoraConfig(target_parameters=["token_mlp.weight", "channel_mlp.weight"])`),
keeping the MLP symmetric.
"""

import torch
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.loaders import PeftAdapterMixin
from torch import nn

from ...exports import public
from ..backbone import CONFIG_REQUIREMENTS, UShapedMixerModel, _is_positive_int, _is_positive_real, check_width
from ..catalog import NAMED_CONFIGS


class VanillaMLP(nn.Module):
    """ParaMixer's MLP: fc2(GELU(fc1(x))) with independent, bias-free weights (the reference `vMlp`)."""

    def __init__(self, in_features: int, hidden_features: int):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_features, bias=False)  # W₁ (eq. 32: W₁ or W₃)
        self.fc2 = nn.Linear(hidden_features, in_features, bias=False)  # W₂ (or W₄)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))  # (..., hidden_features) inside


class SymmetricMLP(nn.Module):
    """SymMixer's MLP: y = GELU(x Wᵀ) W, i.e. W₂ = W₁ᵀ (eqs. 28–29); W has a Linear's (hidden, in) layout."""

    def __init__(self, in_features: int, hidden_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_features, in_features))  # W₁; W₂ = W₁ᵀ

    def init_weights(self) -> None:
        nn.init.trunc_normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = F.gelu(torch.matmul(x, self.weight.t()))  # (..., hidden_features)
        return torch.matmul(hidden, self.weight)  # (..., in_features)


class AsymmetricMLP(SymmetricMLP):
    """AsymMixer's MLP: y = GELU(x Wᵀ) W + fc2(GELU(x Wᵀ)), i.e. W₂ = W₁ᵀ + W̃₂ (eq. 38, the reference `aMlp`); `fc2`
    is the symmetry-breaking term that `symmetry_breaking_penalty` penalises."""

    def __init__(self, in_features: int, hidden_features: int):
        super().__init__(in_features, hidden_features)
        self.fc2 = nn.Linear(hidden_features, in_features, bias=False)  # W̃₂ (or W̃₄)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = F.gelu(torch.matmul(x, self.weight.t()))  # (..., hidden_features)
        return torch.matmul(hidden, self.weight) + self.fc2(hidden)  # (..., in_features)


class ParaMixerBlock(nn.Module):
    """One parallelized mixing layer (eq. 32), `block(x, skip) -> x` on (B, L, D), with MLPs of `mlp_class`;
    `num_iterations` repeats the update with the same weights (the paper's iterative mixing layers)."""

    def __init__(
        self,
        hidden_size: int,
        seq_len: int,
        token_hidden: int,
        channel_hidden: int,
        mlp_class: type[nn.Module],
        norm_eps: float,
        num_iterations: int = 1,
    ):
        super().__init__()
        self.num_iterations = num_iterations
        self.norm = nn.LayerNorm((seq_len, hidden_size), eps=norm_eps)  # the symmetric LayerNorm, over (L, D)
        self.token_mlp = mlp_class(seq_len, token_hidden)  # reference `mlp_tokens`: W₂ g(W₁ ·)
        self.channel_mlp = mlp_class(hidden_size, channel_hidden)  # reference `mlp_channels`: g(· W₃) W₄

    def forward(self, x: torch.Tensor, skip: torch.Tensor | None = None) -> torch.Tensor:
        if skip is not None:
            x = x + skip
        for _ in range(self.num_iterations):
            normed = self.norm(x)  # (B, L, D), statistics over all L·D entries of a sample
            token_mixed = self.token_mlp(normed.transpose(1, 2)).transpose(1, 2)  # (B, D, L) inside
            x = x + token_mixed + self.channel_mlp(normed)  # (B, L, D)
        return x


class ParallelMixerModel(UShapedMixerModel, ConfigMixin, PeftAdapterMixin):
    """Shared body of the ParaMixer, SymMixer and AsymMixer models: `ParaMixerBlock`s whose MLPs are `mlp_class`.
    Parameters are `UShapedMixerModel`'s (num_layers=12, mlp_ratio=4.0, norm_eps=1e-6 as in paramixer), and
    `token_mlp_ratio` (defaults to 0.5; of D, not of L) and `num_iterations` (defaults to 1)."""

    _no_split_modules = ["ParaMixerBlock"]
    _repeated_blocks = ["ParaMixerBlock"]
    config_requirements = {
        **CONFIG_REQUIREMENTS,
        "token_mlp_ratio": (_is_positive_real, "a positive finite number (the token MLP's width as a multiple of D)"),
        "num_iterations": (_is_positive_int, "a positive integer (applications of each block's shared weights)"),
    }
    mlp_class: type[nn.Module]

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
        norm_eps: float = 1e-6,
        token_mlp_ratio: float = 0.5,
        num_iterations: int = 1,
        pooled_text_projection: bool = False,
    ):
        super().__init__()
        self._build(
            lambda seq_len, skip: ParaMixerBlock(
                hidden_size, seq_len, int(hidden_size * token_mlp_ratio), int(hidden_size * mlp_ratio), self.mlp_class,
                norm_eps, num_iterations,
            )
        )  # fmt: skip

    def _check_config(self) -> None:
        check_width("token_mlp_ratio", self.config.token_mlp_ratio, self.config.hidden_size, "token MLP")


@public
class ParaMixerTransformer2DModel(ParallelMixerModel):
    """ParaMixer: parallelized mixing layers with independent MLP weights (eq. 32); parameters as
    `ParallelMixerModel`. LoRA can target `token_mlp.fc1/fc2` and `channel_mlp.fc1/fc2`."""

    mlp_class = VanillaMLP
    named_configs = NAMED_CONFIGS["paramixer"]


@public
class SymMixerTransformer2DModel(ParallelMixerModel):
    """SymMixer: parallelized mixing layers with symmetric MLP weights W₂ = W₁ᵀ (eqs. 28–29); parameters as
    `ParallelMixerModel`. LoRA adapts the tied weights as parameters."""

    mlp_class = SymmetricMLP
    named_configs = NAMED_CONFIGS["symmixer"]


@public
class AsymMixerTransformer2DModel(ParallelMixerModel):
    """AsymMixer: SymMixer plus a learned symmetry-breaking term, W₂ = W₁ᵀ + W̃₂ (eq. 38); parameters as
    `ParallelMixerModel`. Train it with the diffusion loss plus `λ · symmetry_breaking_penalty(model)` (eq. 39)."""

    mlp_class = AsymmetricMLP
    named_configs = NAMED_CONFIGS["asymmixer"]


def symmetry_breaking_penalty(model: nn.Module) -> torch.Tensor:
    """The paper's symmetry-breaking penalty (eq. 39) without λ, a float32 scalar: Σ ‖W̃‖²_F over every
    `AsymmetricMLP.fc2` (found by type, so wrapped models work; with LoRA on `fc2` only the base weight counts).

    Example:
        ```py
        loss = F.mse_loss(model(latents, text_states, t).sample, noise) + 1e-4 * symmetry_breaking_penalty(model)
        ```
    """
    weights = [module.fc2.weight for module in model.modules() if isinstance(module, AsymmetricMLP)]
    if not weights:
        raise ValueError(
            f"{type(model).__name__} has no symmetry-breaking weights (no AsymmetricMLP): the penalty applies to an "
            "AsymMixerTransformer2DModel only."
        )
    return torch.stack([weight.float().square().sum() for weight in weights]).sum()
