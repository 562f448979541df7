"""Parameters and forward MACs of every block family, as torch's `FlopCounterMode` counts them on the meta device
(where SDPA takes its math path). A MAC is one multiply-add of a matrix product or convolution (FLOPs / 2); as in the
papers' tables, bias adds, norms, activations and element-wise products are left out. L-MLP Table 3 per block:

    L-MLP block        (2 + 2s)·L·D² + L²·D
    transformer block  (4 + 2s)·L·D² + 2·L²·D       (U-ViT's in/mid blocks)
"""

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from diffusers.configuration_utils import ConfigMixin
from torch.utils.flop_counter import FlopCounterMode

from .models.families import FAMILIES, family_of


@dataclass(frozen=True)
class Complexity:
    """Size and per-sample forward MACs of a backbone; `block_macs` are the mid block's (one block without a long
    skip), `seq_len` is L = 1 + text_seq_len + (sample_size / patch_size)²."""

    params: int
    macs: int
    block_macs: int
    num_blocks: int
    seq_len: int


def lmlp_block_macs(seq_len: int, hidden_size: int, mlp_ratio: float) -> int:
    """MACs of one L-MLP block per sample: (2 + 2s)·L·D² + L²·D (L-MLP Table 3)."""
    inner = int(hidden_size * mlp_ratio)
    return 2 * seq_len * hidden_size**2 + 2 * seq_len * hidden_size * inner + seq_len**2 * hidden_size


def transformer_block_macs(seq_len: int, hidden_size: int, mlp_ratio: float) -> int:
    """MACs of one transformer (U-ViT) block per sample: (4 + 2s)·L·D² + 2·L²·D (L-MLP Table 3; MoE-MLP's Table 1
    writes (3 + 2s)·L·D², at odds with its own (4 + 2s)·D² parameters)."""
    inner = int(hidden_size * mlp_ratio)
    return 4 * seq_len * hidden_size**2 + 2 * seq_len * hidden_size * inner + 2 * seq_len**2 * hidden_size


def complexity(model: Mapping | ConfigMixin | torch.nn.Module, family: str | None = None) -> Complexity:
    """Parameters and per-sample forward MACs of a backbone or its config: one counted forward on the meta device.

    A config names its family by `_class_name` or by `family` ("uvit"); missing fields take the class's defaults.
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
