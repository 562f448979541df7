"""What each subcommand reads in a backbone, and the error naming the subcommand that fits one it cannot read.

`lateralization` reads an `LMLPBlock`'s first stage (an L × L `nn.Linear` FNN_L or a `MoELinearAttention` beside a
D × D FNN_R); `routing` reads MoE-MLP `Router`s and U-ViT `UViTAttention`s. The test is by the class of a block's
parts, never by family or config name. MLP-hemisphere UL-MLPs (Table 1 A1–C1), gMLP, MLP-Mixer and the ParaMixers
fit neither.
"""

import torch
from torch import nn

from ..models.families import family_of
from ..models.mixers.attention import UViTAttention
from ..models.mixers.lmlp import LMLPBlock
from ..models.mixers.moe import MoELinearAttention
from ..models.mixers.routing import Router
from .layers import layer_block, num_blocks


def first_stage(block: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A block's first-stage weights as Fig. 6 draws them (rows = outputs): left (L, L), or (H, E, L, L) experts
    for an MoE-MLP, and right (D, D); None for a block without them."""
    if not isinstance(block, LMLPBlock) or not isinstance(block.right, nn.Linear):
        return None
    if isinstance(block.left, MoELinearAttention):
        return block.left.expert_weight, block.right.weight  # (H, E, L, L), (D, D)
    if isinstance(block.left, nn.Linear):
        return block.left.weight, block.right.weight  # (L, L), (D, D)
    return None


def routes(model: nn.Module) -> bool:
    """Whether the model routes tokens through experts (an MoE-MLP: it has `Router` modules)."""
    return any(isinstance(module, Router) for module in model.modules())


def attends(model: nn.Module) -> bool:
    """Whether the model mixes tokens by self-attention (a U-ViT: it has `UViTAttention` modules)."""
    return any(isinstance(module, UViTAttention) for module in model.modules())


def lateralizes(model: nn.Module) -> bool:
    """Whether every block of the model's stack has the first stage `lateralization` draws."""
    return all(first_stage(block) is not None for block in blocks(model))


def blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks of a backbone's U-shaped stack, by layer number (layer 1 first)."""
    return [layer_block(model, layer) for layer in range(1, num_blocks(model.config["num_layers"]) + 1)]


def _name(model: nn.Module) -> str:
    family = family_of(model)
    return f"{family.label} ({family.class_name})"


def check_lateralization(model: nn.Module) -> None:
    """Raise a `ValueError` that names the subcommand that fits, unless `lateralization` can read the model."""
    if lateralizes(model):
        return
    fits = (
        "Run `routing` on it instead: it draws the attention maps of the same layers."
        if attends(model)
        else "Neither subcommand fits it: `routing` reads MoE-MLP routers and U-ViT attention."
    )
    raise ValueError(
        f"lateralization draws the first stage of L-MLP blocks, an L × L token-mixing Linear (UL-MLP) or L × L "
        f"experts (MoE-MLP) beside a D × D channel-mixing Linear, and this {_name(model)} has no such blocks. {fits}"
    )


def check_routing(model: nn.Module) -> None:
    """Raise a `ValueError` that names the subcommand that fits, unless `routing` can read the model."""
    if routes(model) or attends(model):
        return
    fits = (
        "Run `lateralization` on it instead: it draws its L × L token-mixing weights."
        if lateralizes(model)
        else "Neither subcommand fits it: `lateralization` reads UL-MLP and MoE-MLP first stages."
    )
    raise ValueError(
        f"routing draws the expert usage of MoE-MLP routers and the attention maps of U-ViT, and this "
        f"{_name(model)} has neither routers nor attention. {fits}"
    )
