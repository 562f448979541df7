"""What each subcommand reads in a backbone, found from the modules it is built of, and the error that names the
subcommand that fits a model it cannot read.

- `lateralization` reads the first stage of the L-MLP block (`LMLPBlock`): a left hemisphere that is one L × L token
  mixing `nn.Linear` (the UL-MLP's FNN_L) or a `MoELinearAttention` (the MoE-MLP's E expert L × L matrices per head),
  and a right hemisphere that is one D × D `nn.Linear` (FNN_R).
- `routing` reads the `Router` modules of an MoE-MLP and the `UViTAttention` modules of a U-ViT.

Each family's mixer module defines these classes, so the test is by the class of a block's parts, never by a family
or config name; `family_of` only names the model in messages. A UL-MLP built with MLP hemispheres (Table 1 A1–C1)
has no single L × L Linear, and gMLP, MLP-Mixer and the ParaMixers have no hemispheres: neither subcommand reads them.
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
    """The first-stage weights of an L-MLP block, as the paper's Fig. 6 draws them (rows = outputs).

    Args:
        block (`nn.Module`): One block of a backbone's stack.

    Returns:
        `tuple` or `None`: (left, right): left is the (L, L) token-mixing weight of a UL-MLP block, or the
        (H, E, L, L) expert weights of an MoE-MLP block; right is the (D, D) channel-mixing weight. `None` for a block
        without these.
    """
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
    """Raise a `ValueError` that names the subcommand that fits, unless `lateralization` can read the model.

    Args:
        model (`nn.Module`): A backbone of the package.
    """
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
    """Raise a `ValueError` that names the subcommand that fits, unless `routing` can read the model.

    Args:
        model (`nn.Module`): A backbone of the package.
    """
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
