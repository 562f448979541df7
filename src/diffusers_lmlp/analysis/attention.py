"""U-ViT's attention maps, the comparison the L-MLP paper makes for its Fig. 6: softmax(q·kᵀ / √(D/H)) of a block,
averaged over heads, forward passes (captions, guidance branches) and sampler timesteps.

A forward hook on each chosen block's `UViTAttention` takes the normalised tokens it was called with and runs the
module's own `qkv` projection on them (called as a module, so adapters and hooks on it apply), splitting q and k as
the module does: [q | k | v], each head-major. The map is the probability that output token i (row) reads input token
j (column), the same orientation as a token-mixing weight; `UViTAttention.forward` itself is not touched.
"""

import contextlib
import functools
from collections.abc import Iterator

import torch
from torch import nn

from ..models.mixers.attention import UViTAttention


def attention_probabilities(attention: UViTAttention, tokens: torch.Tensor) -> torch.Tensor:
    """The attention probabilities a `UViTAttention` computes on `tokens`.

    Args:
        attention (`UViTAttention`): The module.
        tokens (`torch.Tensor`): (B, L, D) its input (the block's normalised tokens).

    Returns:
        `torch.Tensor`: (B, H, L, L) float32 probabilities; each row sums to 1.
    """
    batch_size, seq_len, _ = tokens.shape
    qkv = attention.qkv(tokens).reshape(batch_size, seq_len, 3, attention.num_heads, -1)  # (B, L, 3, H, D/H)
    query, key, _ = qkv.float().permute(2, 0, 3, 1, 4).unbind(0)  # 2 × (B, H, L, D/H)
    scores = query @ key.transpose(-2, -1) * query.shape[-1] ** -0.5  # (B, H, L, L), SDPA's default scale
    return scores.softmax(-1)


class AttentionAverage:
    """Running means of attention maps, one per observed block.

    Args:
        num_blocks (`int`): The observed blocks.
    """

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
    """Average the attention maps of `blocks` over heads and over every forward pass while the context is open.

    Args:
        blocks (`list[nn.Module]`): U-ViT blocks, each with one `UViTAttention`.

    Yields:
        `AttentionAverage`: Filled as the passes run; the hooks are removed when the context closes.
    """
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
