"""Routers: the modules that turn gate logits into expert probabilities, and how a model collects their outputs.

A mixer that routes (the MoE-MLP's multi-head MoE-linear attention) computes its gate probabilities with a `Router`
module. A model that reports router probabilities (for the load-balancing loss) wraps its forward pass in
`collect_router_probs`, which records every `Router`'s output with forward hooks. So blocks keep the plain contract
`block(x, skip) -> x`, and the stack and the token I/O need to know nothing about routing.
"""

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


class Router(nn.Module):
    """Softmax over the last axis: gate logits (..., E) to expert probabilities (..., E)."""

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        """Normalise gate logits.

        Args:
            logits (`torch.Tensor`): (..., E) gate logits.

        Returns:
            `torch.Tensor`: (..., E) probabilities that sum to 1 over the experts.
        """
        return logits.softmax(-1)


@contextlib.contextmanager
def collect_router_probs(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Record the output of every `Router` in `model` while the context is open, in call order.

    The hooks are removed when the context closes, so a gradient-checkpointing recomputation during `backward`
    (which runs the blocks again) adds nothing.

    Args:
        model (`nn.Module`): The model whose routers to observe.

    Yields:
        `list[torch.Tensor]`: Filled with one (B, ..., E) tensor per router call as the forward pass runs.
    """
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
