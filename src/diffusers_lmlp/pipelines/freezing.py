"""Inductor's freezing for sampling: the transformer compiled with its weights as constants of the graph.

Freezing lets inductor pre-pack each Linear's weight and fuse its bias and GELU into the GEMM, which plain
`torch.compile` cannot do while the weights are graph inputs (docs/benchmarks.md). A frozen graph no longer reads the
weights, and torch reuses it for an equal backend, so `FrozenTransformer` fingerprints the weights before every call
and freezes again, with a new backend, when they changed. Each freeze resets dynamo's caches: freezes pile up on the
class's cached forward, and past the recompile limit dynamo would silently run the transformer eagerly.
"""

from collections.abc import Callable

import torch
from diffusers.utils import logging
from torch import nn
from torch._inductor import config as inductor_config
from torch._inductor.compile_fx import compile_fx

from ..models.loading import listed
from ..models.quantized import dynamically_quantized_layers


logger = logging.get_logger(__name__)


def weights_fingerprint(module: nn.Module) -> tuple:
    """What a frozen graph depends on: every parameter's and buffer's name, storage, version, dtype, shape and sum,
    and every module's forward hooks. The sums catch in-place edits that keep storage and version (PEFT merging
    through `.data`); the names catch layers added or removed (an adapter injected)."""
    tensors = list(module.named_parameters()) + list(module.named_buffers())
    layout = tuple((name, t.data_ptr(), t._version, t.dtype, t.device, tuple(t.shape)) for name, t in tensors)
    # A hook present at freezing time is traced into the graph; one added or removed later must be too.
    hooks = tuple((name, tuple(m._forward_pre_hooks), tuple(m._forward_hooks)) for name, m in module.named_modules())
    with torch.no_grad():
        sums = [t.detach().sum(dtype=torch.float64) for _, t in tensors if t.is_floating_point()]
        # As bytes: a NaN weight compares equal to itself, so it does not force a new freeze on every call.
        checksum = torch.stack(sums).cpu().numpy().tobytes() if sums else b""
    return layout, hooks, checksum


def check_freezable(transformer: nn.Module) -> None:
    """Raise a `ValueError` for a transformer with layers that torch's dynamic quantization replaced: dynamo cannot
    trace them, so the graph breaks at each one and the frozen forward runs slower than the eager one."""
    layers = dynamically_quantized_layers(transformer)
    if layers:
        raise ValueError(
            f"Freezing cannot compile the layers that torch's dynamic quantization replaced ({listed(layers)}): the "
            "graph breaks at each one, and such a transformer samples slower frozen than eagerly. Sample it without "
            "freezing (pipe.disable_inductor_freezing()), or freeze the float transformer instead."
        )


class FrozenTransformer:
    """A pipeline's transformer compiled by inductor with freezing, frozen again whenever its weights change.

    Frozen graphs apply where gradients are off, as in a pipeline call; hooks and adapters present at freezing time
    are traced into them.
    """

    def __init__(self):
        self._transformer: nn.Module | None = None
        self._compiled: Callable | None = None
        self._fingerprint: tuple | None = None
        self.freezes = 0  # how many times a graph was frozen (each one compiles, on its first call)

    def for_sampling(self, transformer: nn.Module) -> Callable:
        """The callable to run `transformer` with in one pipeline call: its frozen graph, frozen again first if the
        transformer or its weights changed (`check_freezable` raises for dynamically quantized layers)."""
        fingerprint = weights_fingerprint(transformer)
        if transformer is not self._transformer or fingerprint != self._fingerprint:
            # Quantizing changes the fingerprint (its layers replace the Linears' weights), so this is checked here.
            check_freezable(transformer)
            if self._transformer is not None:
                logger.info(
                    "The transformer or its weights changed since it was frozen: freezing it again (this resets "
                    "torch.compile's compiled graphs, torch._dynamo.reset())."
                )
            # Freezes pile up on the frame torch.compile caches them on (the class's shared forward), and past
            # `recompile_limit` (8) dynamo silently runs eagerly: resetting keeps each new graph frozen.
            torch._dynamo.reset()

            # A new backend for each freeze: dynamo reuses a compiled graph for an equal backend, and an older frozen
            # graph holds older weights.
            def backend(graph: torch.fx.GraphModule, example_inputs: list) -> Callable:
                with inductor_config.patch(freezing=True):
                    return compile_fx(graph, example_inputs)

            self._compiled = torch.compile(transformer, backend=backend)
            self._transformer, self._fingerprint = transformer, fingerprint
            self.freezes += 1
        return self._call

    def _call(self, *args, **kwargs):
        # A dynamic batch: one graph serves every batch size, and on a CPU inductor then runs float32 Linears through
        # oneDNN rather than MKL's slower packed GEMM (docs/benchmarks.md).
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                torch._dynamo.maybe_mark_dynamic(value, 0)
        # dynamo must see freezing on while it traces, or it lifts the weights into graph inputs and inductor has no
        # constants to fold.
        with inductor_config.patch(freezing=True):
            return self._compiled(*args, **kwargs)
