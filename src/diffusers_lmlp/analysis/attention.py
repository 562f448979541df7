"""U-ViT's attention maps, the L-MLP paper's comparison for Fig. 6: softmax(q·kᵀ / √(D/H)) averaged over heads and
forward passes, rows = outputs as in a token-mixing weight.

A forward hook on each `UViTAttention` reruns the module's own `qkv` on its input (as a module, so adapters and hooks
apply) and splits q and k as it does; `UViTAttention.forward` itself is not touched.
"""

import contextlib
import functools
from collections.abc import Iterator

import torch
from torch import nn

from ..models.mixers.attention import UViTAttention


def attention_probabilities(attention: UViTAttention, tokens: torch.Tensor) -> torch.Tensor:
    """The (B, H, L, L) float32 attention probabilities a `UViTAttention` computes on its (B, L, D) input `tokens`."""
    batch_size, seq_len, _ = tokens.shape
    qkv = attention.qkv(tokens).reshape(batch_size, seq_len, 3, attention.num_heads, -1)  # (B, L, 3, H, D/H)
    query, key, _ = qkv.float().permute(2, 0, 3, 1, 4).unbind(0)  # 2 × (B, H, L, D/H)
    scores = query @ key.transpose(-2, -1) * query.shape[-1] ** -0.5  # (B, H, L, L), SDPA's default scale
    return scores.softmax(-1)


class AttentionAverage:
    """Running means of attention maps, one per observed block."""

    def __init__(self, num_blocks: int):
        self.sums: list[torch.Tensor | float] = [0.0] * num_blocks
        self.counts = [0] * num_blocks

    def add(self, index: int, maps: torch.Tensor) -> None:
        """Add the (B, L, L) head-averaged maps of one pass of block `index`."""
        self.sums[index] = self.sums[index] + maps.double().sum(0).cpu()  # (L, L)
        self.counts[index] += maps.shape[0]

    def means(self) -> list[torch.Tensor]:
        """The (L, L) mean map of each block over every pass added."""
        return [total / count for total, count in zip(self.sums, self.counts)]


def _record(average: AttentionAverage, index: int, module: UViTAttention, args: tuple, output: torch.Tensor) -> None:
    """The forward hook: add the head-averaged maps of this pass."""
    average.add(index, attention_probabilities(module, args[0]).mean(1))  # (B, L, L)


@contextlib.contextmanager
def record_attention(blocks: list[nn.Module]) -> Iterator[AttentionAverage]:
    """Yield an `AttentionAverage` of the maps of `blocks` (each with one `UViTAttention`) over heads and every
    forward pass while the context is open."""
    average = AttentionAverage(len(blocks))
    handles = []
    for index, block in enumerate(blocks):
        (attention,) = [module for module in block.modules() if isinstance(module, UViTAttention)]
        handles.append(attention.register_forward_hook(functools.partial(_record, average, index)))
    try:
        yield average
    finally:
        for handle in handles:
            handle.remove()
