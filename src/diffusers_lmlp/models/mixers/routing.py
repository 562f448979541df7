"""Routers turn gate logits into expert probabilities; `collect_router_probs` records them with forward hooks, so
blocks keep the contract `block(x, skip) -> x`."""

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


class Router(nn.Module):
    """Softmax over the last axis: gate logits (..., E) to expert probabilities (..., E)."""

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.softmax(-1)


@contextlib.contextmanager
def collect_router_probs(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Yield a list that collects every `Router` output of `model` (one (B, ..., E) tensor per call, in order) while
    the context is open; a gradient-checkpointing recomputation in `backward`, after it closes, adds nothing."""
    outputs: list[torch.Tensor] = []
    handles = [
        module.register_forward_hook(lambda _module, _args, output: outputs.append(output))
        for module in model.modules()
        if isinstance(module, Router)
    ]
    try:
        yield outputs
    finally:
        for handle in handles:
            handle.remove()
