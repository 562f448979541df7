"""A backbone's layout as the analysis reads it: layer k is the k-th block the tokens pass through, from 1 (in blocks,
the mid block, out blocks), as the L-MLP paper's reference figure script counts them."""

import math

import torch
from torch import nn

from ..models.families import family_of
from ..models.mixers.attention import UViTAttention
from ..models.mixers.lmlp import LMLPBlock
from ..models.mixers.moe import MoELinearAttention, Router


def num_blocks(num_layers: int) -> int:
    """The blocks of a U-shaped stack of the config's `num_layers` (the reference "depth"): n in, 1 mid, n out."""
    return 2 * (num_layers // 2) + 1


def block_name(layer: int, blocks: int) -> str:
    """The stack module of `layer` among `blocks` blocks (`in_blocks.4`, `mid_block`, ...)."""
    check_layers([layer], blocks)
    half = blocks // 2
    if layer <= half:
        return f"in_blocks.{layer - 1}"
    return "mid_block" if layer == half + 1 else f"out_blocks.{layer - half - 2}"


def layer_block(model, layer: int):
    return model.stack.get_submodule(block_name(layer, num_blocks(model.config["num_layers"])))


def default_layers(blocks: int) -> list[int]:
    """The paper's layers (1, 5, 9, 13, 17 of 17) adapted to the depth: first, quarter points (rounded half up, the
    third mirroring the first), mid and last block."""
    first_quarter = 1 + math.floor((blocks - 1) / 4 + 0.5)
    return sorted({1, first_quarter, blocks // 2 + 1, blocks + 1 - first_quarter, blocks})


def check_layers(layers: list[int], blocks: int) -> list[int]:
    """`layers` without repeats, in order, after checking that each is in 1 … `blocks` (else `ValueError`)."""
    if wrong := [layer for layer in layers if not 1 <= layer <= blocks]:
        half = blocks // 2
        shown = [k for k in sorted({1, half, half + 1, half + 2, blocks}) if 1 <= k <= blocks]
        layout = ", ".join(f"layer {k} is {block_name(k, blocks)}" for k in shown)
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


def check_kind(model: nn.Module, subcommand: str) -> None:
    """Raise a `ValueError` naming the subcommand that fits, unless `subcommand` can read the model."""
    family = family_of(model)
    blocks = range(1, num_blocks(model.config["num_layers"]) + 1)
    lateralizes = all(first_stage(layer_block(model, layer)) is not None for layer in blocks)
    attends = any(isinstance(module, UViTAttention) for module in model.modules())
    fits = {"lateralization": lateralizes, "routing": routes(model) or attends}
    if not fits[subcommand]:
        other = next(name for name in fits if name != subcommand)
        reads = (
            "L × L first stages of UL-MLP and MoE-MLP" if other == "routing" else "MoE-MLP routers and U-ViT attention"
        )
        advice = f"Run `{other}` on it instead." if fits[other] else "Neither subcommand fits it."
        raise ValueError(f"{subcommand} reads the {reads}, and this {family.label} ({family.class_name}) has no such "
                         f"blocks. {advice}")  # fmt: skip
