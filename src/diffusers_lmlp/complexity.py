"""Parameters and forward MACs of every block family, as torch's own `FlopCounterMode` counts them.

A MAC is one multiply-add of a matrix product or convolution (FLOPs / 2). The counter leaves out bias adds,
LayerNorms, activations, softmax and element-wise products, as the papers' tables do ("lower-order terms ... are
omitted"). Every count runs on the meta device: no memory, no time, and SDPA takes its math path there, so attention's
QKᵀ and softmax(QKᵀ)·V count L²·D each, as the counter's CUDA formulas count them (on CPU tensors torch 2.13 counts
the CPU flash kernel as 0).

The papers' per-block formulas, which the tests check against the counter:

    L-MLP block        (2 + 2s)·L·D² + L²·D                                    L-MLP Table 3
    transformer block  (4 + 2s)·L·D² + 2·L²·D                                  L-MLP Table 3 (U-ViT's in/mid blocks)
"""

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from diffusers.configuration_utils import ConfigMixin
from torch.utils.flop_counter import FlopCounterMode

from .models.families import FAMILIES, family_of


@dataclass(frozen=True)
class Complexity:
    """Size and per-sample forward cost of a backbone.

    Args:
        params (`int`): Exact number of parameters, biases, norms and positional embedding included.
        macs (`int`): Forward multiply-adds per sample, blocks and token I/O together.
        block_macs (`int`): Forward multiply-adds per sample of one block without a long skip (the mid block).
        num_blocks (`int`): Number of blocks (num_layers + 1).
        seq_len (`int`): Tokens per block, L = 1 + text_seq_len + (sample_size / patch_size)².
    """

    params: int
    macs: int
    block_macs: int
    num_blocks: int
    seq_len: int


def lmlp_block_macs(seq_len: int, hidden_size: int, mlp_ratio: float) -> int:
    """MACs of one L-MLP block per sample: (2 + 2s)·L·D² + L²·D (L-MLP Table 3; 0.933 G at L=334, D=512, s=4)."""
    inner = int(hidden_size * mlp_ratio)
    return 2 * seq_len * hidden_size**2 + 2 * seq_len * hidden_size * inner + seq_len**2 * hidden_size


def transformer_block_macs(seq_len: int, hidden_size: int, mlp_ratio: float) -> int:
    """MACs of one transformer (U-ViT) block per sample: (4 + 2s)·L·D² + 2·L²·D (L-MLP Table 3; 1.165 G).

    The MoE-MLP paper's Table 1 writes (3 + 2s)·L·D² for the same block while giving it (4 + 2s)·D² parameters in
    the same row, which four D×D projections cannot do; we follow L-MLP Table 3.
    """
    inner = int(hidden_size * mlp_ratio)
    return 4 * seq_len * hidden_size**2 + 2 * seq_len * hidden_size * inner + 2 * seq_len**2 * hidden_size


def complexity(model: Mapping | ConfigMixin | torch.nn.Module, family: str | None = None) -> Complexity:
    """Parameters and per-sample forward MACs of any registered backbone: one counted forward on the meta device.

    Args:
        model (`torch.nn.Module`, `ConfigMixin` or `Mapping`): A backbone, or its config. A config names its family
            by `_class_name` (saved configs do) or by `family`; missing fields take the class's defaults.
        family (`str`, *optional*): The family's registry name (e.g. "lmlp", "uvit"), for a bare config mapping.

    Example:
        ```py
        complexity(LMLPTransformer2DModel())  # F2-deep: 47,139,122 params, 15,890,778,112 MACs
        complexity({"hidden_size": 256}, family="uvit")
        ```
    """
    block_family = FAMILIES[family] if family is not None else family_of(model)
    config = model.config if isinstance(model, ConfigMixin) else model
    with torch.device("meta"):
        meta = block_family.model_class(**block_family.full_config(config))
        config = meta.config
        latents = torch.zeros(1, config.in_channels, config.sample_size, config.sample_size)
        text_states = torch.zeros(1, config.text_seq_len, config.text_embed_dim)
        counter = FlopCounterMode(display=False)
        with torch.no_grad(), counter:
            meta(latents, text_states, torch.zeros(1, dtype=torch.long))
    name = type(meta).__name__
    return Complexity(
        params=sum(p.numel() for p in meta.parameters()),
        macs=counter.get_total_flops() // 2,
        block_macs=sum(counter.get_flop_counts()[f"{name}.stack.mid_block"].values()) // 2,
        num_blocks=config.num_layers + 1,
        seq_len=meta.seq_len,
    )
