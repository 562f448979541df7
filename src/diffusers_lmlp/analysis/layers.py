"""A backbone's layout as the analysis reads it: layer numbers and the parts each subcommand draws.

Layer k is the k-th block the tokens pass through, from 1 (in blocks, the mid block, out blocks), as the L-MLP
paper's reference figure script counts them; our backbones keep its block names under `stack.`. `lateralization`
reads an `LMLPBlock`'s first stage (an L × L `nn.Linear` or a `MoELinearAttention` beside a D × D `nn.Linear`);
`routing` reads MoE-MLP `Router`s and U-ViT `UViTAttention`s, tested by the class of a block's parts.
"""

import math

import torch
from torch import nn

from ..models.families import family_of
from ..models.mixers.attention import UViTAttention
from ..models.mixers.lmlp import LMLPBlock
from ..models.mixers.moe import MoELinearAttention
from ..models.mixers.routing import Router


def num_blocks(num_layers: int) -> int:
    """The blocks of a U-shaped stack of the config's `num_layers` (the reference "depth"): n in, 1 mid, n out."""
    return 2 * (num_layers // 2) + 1


def block_name(layer: int, blocks: int) -> str:
    """The stack module of `layer` (from 1) among `blocks` blocks, by the reference's names (`in_blocks.4`, ...)."""
    check_layers([layer], blocks)
    half = blocks // 2
    if layer <= half:
        return f"in_blocks.{layer - 1}"
    return "mid_block" if layer == half + 1 else f"out_blocks.{layer - half - 2}"


def layer_block(model, layer: int):
    """The block of `layer` in a backbone: its module `stack.<block_name>`."""
    return model.stack.get_submodule(block_name(layer, num_blocks(model.config["num_layers"])))


def default_layers(blocks: int) -> list[int]:
    """The paper's layers (1, 5, 9, 13, 17 of 17) adapted to the depth: first, quarter points, mid and last block,
    the first quarter rounded half up and the third mirroring it."""
    first_quarter = 1 + math.floor((blocks - 1) / 4 + 0.5)
    return sorted({1, first_quarter, blocks // 2 + 1, blocks + 1 - first_quarter, blocks})


def check_layers(layers: list[int], blocks: int) -> list[int]:
    """`layers` without repeats, in order, after checking that each is in 1 … `blocks` (else `ValueError`)."""
    wrong = [layer for layer in layers if not 1 <= layer <= blocks]
    if wrong:
        half = blocks // 2
        if half == 0:
            layout = "layer 1 is mid_block"
        elif half == 1:
            layout = f"layer 1 is in_blocks.0, layer 2 is mid_block, layer {blocks} is out_blocks.0"
        else:
            layout = (
                f"layers 1–{half} are in_blocks.0–{half - 1}, layer {half + 1} is mid_block, layers "
                f"{half + 2}–{blocks} are out_blocks.0–{half - 1}"
            )
        raise ValueError(
            f"No layer {', '.join(map(str, wrong))} in this model: it has {blocks} blocks, numbered 1–{blocks} as the "
            f"reference figure script numbers them ({layout})."
        )
    return list(dict.fromkeys(layers))


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
    blocks = num_blocks(model.config["num_layers"])
    return all(first_stage(layer_block(model, layer)) is not None for layer in range(1, blocks + 1))


def check_kind(model: nn.Module, subcommand: str) -> None:
    """Raise a `ValueError` naming the subcommand that fits, unless `subcommand` can read the model."""
    family = family_of(model)
    name = f"{family.label} ({family.class_name})"
    if subcommand == "lateralization" and not lateralizes(model):
        fits = (
            "Run `routing` on it instead: it draws the attention maps of the same layers."
            if attends(model)
            else "Neither subcommand fits it: `routing` reads MoE-MLP routers and U-ViT attention."
        )
        raise ValueError(
            "lateralization draws the first stage of L-MLP blocks, an L × L token-mixing Linear (UL-MLP) or L × L "
            f"experts (MoE-MLP) beside a D × D channel-mixing Linear, and this {name} has no such blocks. {fits}"
        )
    if subcommand == "routing" and not (routes(model) or attends(model)):
        fits = (
            "Run `lateralization` on it instead: it draws its L × L token-mixing weights."
            if lateralizes(model)
            else "Neither subcommand fits it: `lateralization` reads UL-MLP and MoE-MLP first stages."
        )
        raise ValueError(
            "routing draws the expert usage of MoE-MLP routers and the attention maps of U-ViT, and this "
            f"{name} has neither routers nor attention. {fits}"
        )
