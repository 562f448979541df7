"""Layer numbers as the L-MLP paper and its reference figure script count them: layer k is the k-th block the tokens
pass through, from 1 (in blocks, the mid block, out blocks; the paper's layers 1, 5, 9, 13, 17 of 17 blocks).

Our backbones keep the reference's block names under `stack.`, so a layer number picks the same weights in both. No
torch here: the command line checks `--layers` before loading anything.
"""

import math


def num_blocks(num_layers: int) -> int:
    """The blocks of a U-shaped stack of the config's `num_layers` (the reference "depth"): n in, 1 mid, n out."""
    return 2 * (num_layers // 2) + 1


def block_name(layer: int, blocks: int) -> str:
    """The stack module of `layer` (from 1) among `blocks` blocks, by the reference's names (`in_blocks.4`, ...)."""
    check_layers([layer], blocks)
    half = blocks // 2
    if layer <= half:
        return f"in_blocks.{layer - 1}"
    if layer == half + 1:
        return "mid_block"
    return f"out_blocks.{layer - half - 2}"


def layer_block(model, layer: int):
    """The block of `layer` in a backbone: its module `stack.<block_name>`."""
    return model.stack.get_submodule(block_name(layer, num_blocks(model.config["num_layers"])))


def default_layers(blocks: int) -> list[int]:
    """The paper's layers adapted to the depth: first, quarter points, mid and last block. The first quarter point
    rounds half up and the third mirrors it, keeping the choice symmetric about the mid block."""
    first_quarter = 1 + math.floor((blocks - 1) / 4 + 0.5)
    layers = [1, first_quarter, blocks // 2 + 1, blocks + 1 - first_quarter, blocks]
    return sorted(set(layers))


def describe_layout(blocks: int) -> str:
    """How layer numbers map to blocks, for error messages ("layers 1–8 are in_blocks.0–7, ...")."""
    half = blocks // 2
    if half == 0:
        return "layer 1 is mid_block"
    ins = "layer 1 is in_blocks.0" if half == 1 else f"layers 1–{half} are in_blocks.0–{half - 1}"
    outs = (
        f"layer {blocks} is out_blocks.0" if half == 1 else f"layers {half + 2}–{blocks} are out_blocks.0–{half - 1}"
    )
    return f"{ins}, layer {half + 1} is mid_block, {outs}"


def check_layers(layers: list[int], blocks: int) -> list[int]:
    """`layers` without repeats, in order, after checking that each is in 1 … `blocks` (else `ValueError`)."""
    wrong = [layer for layer in layers if not 1 <= layer <= blocks]
    if wrong:
        raise ValueError(
            f"No layer {', '.join(map(str, wrong))} in this model: it has {blocks} blocks, numbered 1–{blocks} as the "
            f"reference figure script numbers them ({describe_layout(blocks)})."
        )
    return list(dict.fromkeys(layers))
