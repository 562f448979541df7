"""Per-block cost: exact parameters and forward multiply-adds per sample, as each mixer reports its own.

A MAC is one multiply-add of a matrix product or convolution. As in the papers' tables ("lower-order terms such as
bias and normalization are omitted"), bias adds, LayerNorms, activations, softmax, element-wise products and
residual adds are not counted; `torch.utils.flop_counter.FlopCounterMode` leaves out the same operations.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class BlockCost:
    """Size and per-sample forward cost of one module.

    Args:
        params (`int`): Exact number of parameters.
        macs (`int`): Forward multiply-adds per sample.
    """

    params: int
    macs: int

    def __add__(self, other: "BlockCost") -> "BlockCost":
        return BlockCost(self.params + other.params, self.macs + other.macs)


ZERO = BlockCost(0, 0)


def linear_cost(in_features: int, out_features: int, rows: int, bias: bool = True) -> BlockCost:
    """An `nn.Linear(in_features, out_features)` applied to `rows` vectors per sample.

    Args:
        in_features (`int`): Input width.
        out_features (`int`): Output width.
        rows (`int`): Vectors per sample it is applied to (L tokens, or D channels for a token-axis Linear).
        bias (`bool`, *optional*, defaults to `True`): Whether the Linear has a bias.
    """
    return BlockCost(in_features * out_features + (out_features if bias else 0), rows * in_features * out_features)


def layer_norm_cost(*shape: int) -> BlockCost:
    """An affine `nn.LayerNorm(shape)`: weight and bias, no MACs.

    Args:
        *shape (`int`): The normalised shape.
    """
    size = 1
    for side in shape:
        size *= side
    return BlockCost(2 * size, 0)
