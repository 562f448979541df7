"""Inductor's freezing for sampling: the transformer compiled with its weights as graph constants, so inductor can
pre-pack each Linear's weight and fuse its bias and GELU into the GEMM. A frozen graph no longer reads the weights, so
`FrozenTransformer` fingerprints them before every call and freezes again when they changed."""

from collections.abc import Callable

import torch
from diffusers.utils import logging
from torch import nn

from ..models.loading import dynamically_quantized_layers, listed


logger = logging.get_logger(__name__)


def weights_fingerprint(module: nn.Module) -> tuple:
    """What a frozen graph depends on: each parameter's and buffer's name, storage, version, dtype, shape and sum
    (sums catch in-place edits through `.data`), and each module's forward hooks (traced into the graph)."""
    tensors = list(module.named_parameters()) + list(module.named_buffers())
    layout = tuple((name, t.data_ptr(), t._version, t.dtype, t.device, tuple(t.shape)) for name, t in tensors)
    hooks = tuple((name, tuple(m._forward_pre_hooks), tuple(m._forward_hooks)) for name, m in module.named_modules())
    with torch.no_grad():
        sums = [t.detach().sum(dtype=torch.float64) for _, t in tensors if t.is_floating_point()]
        # As bytes: a NaN weight compares equal to itself, so it does not force a new freeze on every call.
        checksum = torch.stack(sums).cpu().numpy().tobytes() if sums else b""
    return layout, hooks, checksum


def check_freezable(transformer: nn.Module) -> None:
    """Refuse a transformer with dynamically quantized layers: dynamo breaks the graph at each, so frozen is slower."""
    layers = dynamically_quantized_layers(transformer)
    if layers:
        raise ValueError(
            f"Freezing cannot compile the layers that torch's dynamic quantization replaced ({listed(layers)}), and "
            "would sample slower than eagerly: sample without freezing (pipe.disable_inductor_freezing()), or freeze "
            "the float transformer."
        )


class FrozenTransformer:
    """A pipeline's transformer compiled by inductor with freezing, frozen again whenever its weights change."""

    def __init__(self):
        self._transformer: nn.Module | None = None
        self._compiled: Callable | None = None
        self._fingerprint: tuple | None = None
        self.freezes = 0  # how many times a graph was frozen

    def for_sampling(self, transformer: nn.Module) -> Callable:
        """What runs `transformer` in one pipeline call: its frozen graph, frozen again if its weights changed."""
        fingerprint = weights_fingerprint(transformer)
        if transformer is not self._transformer or fingerprint != self._fingerprint:
            check_freezable(transformer)  # here too: quantizing changes the fingerprint
            if self._transformer is not None:
                logger.info("The transformer's weights changed since it was frozen: freezing it again.")
            # Freezes pile up on the class's shared cached forward, and past `recompile_limit` dynamo silently runs
            # eagerly: resetting keeps each new graph frozen.
            torch._dynamo.reset()

            def backend(graph: torch.fx.GraphModule, example_inputs: list) -> Callable:
                from torch._inductor import config as inductor_config
                from torch._inductor.compile_fx import compile_fx

                with inductor_config.patch(freezing=True):
                    return compile_fx(graph, example_inputs)

            self._compiled = torch.compile(transformer, backend=backend)
            self._transformer, self._fingerprint = transformer, fingerprint
            self.freezes += 1
        return self._call

    def _call(self, *args, **kwargs):
        # A dynamic batch: one graph serves every batch size (and on a CPU runs through oneDNN, docs/benchmarks.md).
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                torch._dynamo.maybe_mark_dynamic(value, 0)
        # Freezing must be on while dynamo traces, or the weights become graph inputs with no constants to fold.
        from torch._inductor import config as inductor_config  # here: importing inductor takes a second

        with inductor_config.patch(freezing=True):
            return self._compiled(*args, **kwargs)
