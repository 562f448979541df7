"""Mixer blocks. Each has the contract `block(x (B, L, D), skip (B, L, D) | None) -> (x, router_probs | None)`."""

from .lmlp import LMLPBlock
from .moe import MoEMLPBlock, load_balancing_loss


__all__ = ["LMLPBlock", "MoEMLPBlock", "load_balancing_loss"]
