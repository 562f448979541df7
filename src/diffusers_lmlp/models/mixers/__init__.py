"""Mixer blocks, one file per block family. Each block has the contract `block(x (B, L, D), skip (B, L, D) | None)
-> (B, L, D)`. The UL-MLP and MoE-MLP models live in `models/`; every other family's thin public model sits next
to its block. The registry of families is `diffusers_lmlp.models.families`."""

from .lmlp import LMLPBlock
from .moe import MoEMLPBlock, load_balancing_loss


__all__ = ["LMLPBlock", "MoEMLPBlock", "load_balancing_loss"]
