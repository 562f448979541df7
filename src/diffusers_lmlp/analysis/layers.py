"""Layer numbers as the L-MLP paper and its reference figure script count them.

The reference `nnet_vis.py` (zizhao-hu/L-MLP) draws "Layers 1, 5, 9, 13 and 17" of the depth-16 UL-MLP from the
modules `in_blocks.0`, `in_blocks.4`, `mid_block`, `out_blocks.3` and `out_blocks.7`: layer k is the k-th block in
the order the tokens pass through them, counted from 1.

    layers 1 … n          in_blocks.0 … in_blocks.(n-1)
    layer n + 1           mid_block
    layers n + 2 … 2n + 1 out_blocks.0 … out_blocks.(n-1)          (n = num_layers // 2)

Our backbones keep the reference's block names under `stack.` (a converted reference checkpoint's `in_blocks.4`
is our `stack.in_blocks.4`), so a layer number picks the same weights in both. This module needs no torch: the
command line checks `--layers` with it before loading anything.
"""

import math


def num_blocks(num_layers: int) -> int:
    """The blocks of a U-shaped stack: num_layers // 2 in blocks, one mid block, num_layers // 2 out blocks.

    Args:
        num_layers (`int`): The config's `num_layers` (the reference "depth"; 16 for F2-deep, giving 17 blocks).
    """
    return 2 * (num_layers // 2) + 1


def block_name(layer: int, blocks: int) -> str:
    """The module of layer `layer` inside the stack, by the reference's names (`in_blocks.4`, `mid_block`, ...).

    Args:
        layer (`int`): The layer number, from 1.
        blocks (`int`): The blocks of the stack (`num_blocks`), an odd number.

    Raises:
        `ValueError`: For a layer outside 1 … `blocks`.
    """
    check_layers([layer], blocks)
    half = blocks // 2
    if layer <= half:
        return f"in_blocks.{layer - 1}"
    if layer == half + 1:
        return "mid_block"
    return f"out_blocks.{layer - half - 2}"


def layer_block(model, layer: int):
    """The block of layer `layer` in a backbone: its module `stack.<block_name>`.

    Args:
        model (`UShapedMixerModel`): A backbone of the package (its config has `num_layers`).
        layer (`int`): The layer number, from 1.

    Raises:
        `ValueError`: For a layer the model does not have.
    """
    return model.stack.get_submodule(block_name(layer, num_blocks(model.config["num_layers"])))


def default_layers(blocks: int) -> list[int]:
    """The paper's choice of layers, adapted to the depth: the first block, the quarter points, the mid block and the
    last block (1, 5, 9, 13, 17 of the paper's 17 blocks; 1, 3, 5, 7, 9 of the shapes model's 9).

    Where a quarter point falls between two blocks, the first one is rounded half up and the third one mirrors it,
    so that the choice stays symmetric about the mid block (1, 4, 6, 8, 11 of 11 blocks).

    Args:
        blocks (`int`): The blocks of the stack (`num_blocks`).
    """
    first_quarter = 1 + math.floor((blocks - 1) / 4 + 0.5)
    layers = [1, first_quarter, blocks // 2 + 1, blocks + 1 - first_quarter, blocks]
    return sorted(set(layers))


def describe_layout(blocks: int) -> str:
    """How layer numbers map to blocks, for error messages ("layers 1–8 are in_blocks.0–7, layer 9 is mid_block, ...").

    Args:
        blocks (`int`): The blocks of the stack.
    """
    half = blocks // 2
    if half == 0:
        return "layer 1 is mid_block"
    ins = "layer 1 is in_blocks.0" if half == 1 else f"layers 1–{half} are in_blocks.0–{half - 1}"
    outs = (
        f"layer {blocks} is out_blocks.0" if half == 1 else f"layers {half + 2}–{blocks} are out_blocks.0–{half - 1}"
    )
    return f"{ins}, layer {half + 1} is mid_block, {outs}"


def check_layers(layers: list[int], blocks: int) -> list[int]:
    """`layers` without repeats, in the order given, after checking that each names a block.

    Args:
        layers (`list[int]`): Layer numbers, from 1.
        blocks (`int`): The blocks of the stack.

    Raises:
        `ValueError`: For a layer below 1 or above `blocks`; the message says how the layers are numbered.
    """
    wrong = [layer for layer in layers if not 1 <= layer <= blocks]
    if wrong:
        raise ValueError(
            f"No layer {', '.join(map(str, wrong))} in this model: it has {blocks} blocks, numbered 1–{blocks} as the "
            f"reference figure script numbers them ({describe_layout(blocks)})."
        )
    return list(dict.fromkeys(layers))
