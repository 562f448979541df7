"""Parameter and forward-MAC accounting for every block family: the papers' complexity tables as code.

A MAC is one multiply-add of a matrix product or convolution. As in the papers' tables ("lower-order terms such as
bias and normalization are omitted"), bias adds, LayerNorms, activations, softmax, element-wise products, residual
adds and the sinusoidal time token are not counted; `torch.utils.flop_counter.FlopCounterMode` leaves out the same
operations, so `measured_macs` and `analytic_complexity` count the same thing. Attention's QKᵀ and softmax(QKᵀ)·V
count L²·D each, as the flop counter counts `F.scaled_dot_product_attention` on CUDA and on the meta device. On CPU
tensors torch 2.13's counter has no formula for the CPU flash-attention kernel SDPA dispatches to and counts it as
0: measure an attention model on the meta device (`with torch.device("meta"): model = ...`).

Each family reports the cost of its own block (`<Model>.block_cost`, from the registry in
`diffusers_lmlp.models.families`); this module adds the token I/O around the blocks. The papers' per-block formulas:

    L-MLP block        (2 + 2s)·L·D² + L²·D                                    L-MLP Table 3
    transformer block  (4 + 2s)·L·D² + 2·L²·D                                  L-MLP Table 3 (U-ViT's in/mid blocks)
"""

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from diffusers.configuration_utils import ConfigMixin
from torch.utils.flop_counter import FlopCounterMode

from .models.families import FAMILIES, BlockFamily, family_of
from .models.mixers.cost import BlockCost, linear_cost


@dataclass(frozen=True)
class Complexity:
    """Size and per-sample forward cost of a backbone.

    Args:
        params (`int`): Exact number of parameters, biases, norms and positional embedding included.
        macs (`int`): Forward multiply-adds per sample, blocks and token I/O together.
        block_macs (`int`): Forward multiply-adds of one in-block per sample (without a long skip).
        num_blocks (`int`): Number of blocks (num_layers + 1).
        seq_len (`int`): Tokens per block, L = 1 + text_seq_len + (sample_size / patch_size)².
    """

    params: int
    macs: int
    block_macs: int
    num_blocks: int
    seq_len: int


def lmlp_block_macs(seq_len: int, hidden_size: int, mlp_ratio: float) -> int:
    """MACs of one L-MLP block per sample: (2 + 2s)·L·D² + L²·D (L-MLP Table 3; 0.933 G at L=334, D=512, s=4).

    Args:
        seq_len (`int`): Tokens L.
        hidden_size (`int`): Token width D.
        mlp_ratio (`float`): Joint-MLP ratio s.
    """
    inner = int(hidden_size * mlp_ratio)
    return 2 * seq_len * hidden_size**2 + 2 * seq_len * hidden_size * inner + seq_len**2 * hidden_size


def transformer_block_macs(seq_len: int, hidden_size: int, mlp_ratio: float) -> int:
    """MACs of one transformer (U-ViT) block per sample: (4 + 2s)·L·D² + 2·L²·D (L-MLP Table 3; 1.165 G at 334/512/4).

    The four D×D projections q, k, v and out cost 4·L·D², the MLP 2s·L·D², and QKᵀ and softmax(QKᵀ)·V L²·D each.
    The MoE-MLP paper's Table 1 writes (3 + 2s)·L·D² for the same block while giving it (4 + 2s)·D² parameters in
    the same row, which four projections cannot do; we follow L-MLP Table 3, whose 1.165 GMAC the tests check.

    Args:
        seq_len (`int`): Tokens L.
        hidden_size (`int`): Token width D.
        mlp_ratio (`float`): MLP ratio s.
    """
    inner = int(hidden_size * mlp_ratio)
    return 4 * seq_len * hidden_size**2 + 2 * seq_len * hidden_size * inner + 2 * seq_len**2 * hidden_size


def _token_io_cost(config: Mapping) -> BlockCost:
    """Patch embedding (a p×p stride-p convolution), text adapter, positional embedding and the output head."""
    side, patch, channels = config["sample_size"], config["patch_size"], config["in_channels"]
    out_channels = config["out_channels"] or channels
    hidden, text_dim, text_len = config["hidden_size"], config["text_embed_dim"], config["text_seq_len"]
    num_patches = (side // patch) ** 2
    seq_len = 1 + text_len + num_patches
    patch_embed = linear_cost(channels * patch * patch, hidden, rows=num_patches)
    text_adapter = linear_cost(text_dim, hidden, rows=text_len)
    if config["pooled_text_projection"]:
        text_adapter += linear_cost(text_dim, hidden, rows=1)  # one state per caption, added to every image token
    pos_embed = BlockCost(seq_len * hidden, 0)
    # The output Linear runs over all L tokens, before the time and text tokens are dropped.
    head = BlockCost(2 * hidden, 0) + linear_cost(hidden, patch * patch * out_channels, rows=seq_len)
    if config["conv_out"]:
        head += linear_cost(out_channels * 9, out_channels, rows=side * side)  # the 3×3 convolution
    return patch_embed + text_adapter + pos_embed + head


def analytic_complexity(
    model: Mapping | ConfigMixin | torch.nn.Module,
    family: str | None = None,
) -> Complexity:
    """Parameters and per-sample forward MACs of any registered backbone, from its config.

    The blocks' cost is each family's own (`<Model>.block_cost`); token I/O adds the patch embedding (N·D·C·p²),
    the text adapter (T·text_embed_dim·D) and, when configured, the pooled text projection (text_embed_dim·D), the
    output Linear over all L tokens (L·D·p²·C_out) and the optional 3×3 convolution (H·W·C_out²·9).

    Args:
        model (`Mapping` or `ConfigMixin`): A backbone, or its config. A config names its family by `_class_name`
            (saved configs do) or by `family`.
        family (`str`, *optional*): The family's registry name (e.g. "lmlp", "uvit"), for a bare config mapping.

    Returns:
        [`Complexity`]: exact parameter count and forward MACs per sample.

    Example:
        ```py
        analytic_complexity(LMLPTransformer2DModel())  # F2-deep: 47,139,122 params, ~15.89 GMAC
        analytic_complexity({"hidden_size": 256}, family="uvit")
        ```
    """
    block_family: BlockFamily = FAMILIES[family] if family is not None else family_of(model)
    config = model.config if isinstance(model, ConfigMixin) else model
    config = block_family.full_config(config)
    seq_len = 1 + config["text_seq_len"] + (config["sample_size"] // config["patch_size"]) ** 2
    half = config["num_layers"] // 2
    plain = block_family.model_class.block_cost(config, seq_len, skip=False)
    out_block = block_family.model_class.block_cost(config, seq_len, skip=block_family.model_class.long_skips(config))
    blocks = BlockCost(
        (half + 1) * plain.params + half * out_block.params, (half + 1) * plain.macs + half * out_block.macs
    )
    total = blocks + _token_io_cost(config)
    return Complexity(
        params=total.params,
        macs=total.macs,
        block_macs=plain.macs,
        num_blocks=config["num_layers"] + 1,
        seq_len=seq_len,
    )


def measured_macs(model: torch.nn.Module, batch_size: int = 1) -> float:
    """Forward MACs per sample as torch's own `torch.utils.flop_counter.FlopCounterMode` counts them (FLOPs / 2).

    Runs one forward pass without gradients on zero latents, zero text states and timestep 0, on the model's
    device and dtype.

    Args:
        model (`torch.nn.Module`): A backbone of any registered family.
        batch_size (`int`, *optional*, defaults to 1): Samples in the forward pass; the count is divided by it.

    Returns:
        `float`: multiply-adds per sample.
    """
    config = model.config
    weight = next(model.parameters())
    side = config.sample_size
    latents = weight.new_zeros(batch_size, config.in_channels, side, side)
    text_states = weight.new_zeros(batch_size, config.text_seq_len, config.text_embed_dim)
    timestep = torch.zeros(batch_size, dtype=torch.long, device=weight.device)
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        model(latents, text_states, timestep)
    return counter.get_total_flops() / 2 / batch_size
