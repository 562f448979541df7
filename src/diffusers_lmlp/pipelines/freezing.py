"""Inductor's freezing for sampling: the transformer compiled with its weights as constants of the graph.

Freezing lets inductor pre-pack every Linear's weight for oneDNN and fuse its bias and a following GELU into the
GEMM (`mkldnn._linear_pointwise` on a CPU), which a plain `torch.compile` cannot do while the weights are inputs of
the graph: plain compiling copies each bias into the GEMM's output first and runs every GELU as a kernel of its own.
The batch is left dynamic, so one graph serves every batch size; on a CPU that also sends float32 Linears to oneDNN
rather than MKL's packed GEMM. On 2 cores of a family-26 AMD EPYC (`avx512_bf16`), F2-deep's sampling forward ran
1.28× (bf16) and 2.07× (float32) as fast as under `torch.compile`, U-ViT-S/2's 1.08× and 1.98× (docs/benchmarks.md).

A frozen graph no longer reads the weights, so it would go on computing with the old ones after anything changes
them in place: a LoRA fused into them, `load_state_dict`, an edit through `.data` (which does not even bump a
tensor's version). Compiling the same module again does not help by itself either: torch reuses the first frozen
graph for an equal backend. So `FrozenTransformer` fingerprints the weights before every pipeline call and freezes
again, with a backend of its own, whenever they changed (`tests/test_inductor_freezing.py`). Every freeze, the first
one too, resets torch.compile's caches (`torch._dynamo.reset()`): each freeze adds its graphs to the same cached frame
(the forward of the model's class), and after 8 of them dynamo would stop compiling and run the transformer eagerly,
however many other pipelines had frozen a model of that class before. Freezing is for sampling many times with the
same weights; a workload that swaps weights on every call is better served by `torch.compile` or
`compile_repeated_blocks()`, which read the weights on every call.
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
    and every module's forward hooks.

    The sums catch changes that leave a tensor's storage and version as they were (`weight.data += delta`, as PEFT
    merges an adapter); the names catch layers added or removed (an adapter injected). One float64 sum per tensor
    reads the weights once, a few milliseconds for F2-deep's 45M parameters: once per pipeline call.

    Args:
        module (`nn.Module`): The transformer.

    Returns:
        `tuple`: equal for two calls exactly when nothing a frozen graph baked in has changed.
    """
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
    """Raise a `ValueError` for a transformer that freezing would make slower: one with layers that torch's dynamic
    quantization replaced. dynamo cannot trace them (their packed weights are TorchScript objects), so the graph
    breaks at each one and little is left to freeze, and the frozen int8 forward ran slower than the eager one
    (docs/pipeline.md, "Quantizing").

    Args:
        transformer (`nn.Module`): The transformer to freeze.
    """
    layers = dynamically_quantized_layers(transformer)
    if layers:
        raise ValueError(
            f"Freezing cannot compile the layers that torch's dynamic quantization replaced ({listed(layers)}): the "
            "graph breaks at each one, and such a transformer samples slower frozen than eagerly. Sample it without "
            "freezing (pipe.disable_inductor_freezing()), or freeze the float transformer instead."
        )


class FrozenTransformer:
    """A pipeline's transformer compiled by inductor with freezing, frozen again whenever its weights change.

    Frozen graphs apply where gradients are off, as in a pipeline call; elsewhere inductor compiles as usual, with
    the weights as inputs. Every layer is still called as a module while the graph is traced, so forward hooks and
    adapters present at freezing time are in it.
    """

    def __init__(self):
        self._transformer: nn.Module | None = None
        self._compiled: Callable | None = None
        self._fingerprint: tuple | None = None
        self.freezes = 0  # how many times a graph was frozen (each one compiles, on its first call)

    def for_sampling(self, transformer: nn.Module) -> Callable:
        """The callable to run `transformer` with in one pipeline call: its frozen graph, frozen again first if the
        transformer or its weights changed since the last call.

        Args:
            transformer (`nn.Module`): The pipeline's current transformer.

        Raises:
            `ValueError`: For a transformer with dynamically quantized layers (`check_freezable`).
        """
        fingerprint = weights_fingerprint(transformer)
        if transformer is not self._transformer or fingerprint != self._fingerprint:
            # Quantizing changes the fingerprint (its layers replace the Linears' weights), so this is checked here.
            check_freezable(transformer)
            if self._transformer is not None:
                logger.info(
                    "The transformer or its weights changed since it was frozen: freezing it again (this resets "
                    "torch.compile's compiled graphs, torch._dynamo.reset())."
                )
            # Each freeze adds its graphs to the frame torch.compile caches them on, the forward that every model of
            # the class shares, and after `recompile_limit` (8) of them dynamo stops compiling and runs the
            # transformer eagerly: silently, for a pipeline that is meant to sample frozen. Dropping the compiled
            # graphs at every freeze keeps each new one frozen and fast; any other compiled model compiles again on
            # its next call.
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
        # The batch is dynamic: one graph serves every batch size, and on a CPU a dynamic batch makes inductor run
        # float32 Linears through oneDNN, where a static one gets MKL's packed GEMM, which ran at half oneDNN's rate on
        # an AMD EPYC (docs/benchmarks.md).
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                torch._dynamo.maybe_mark_dynamic(value, 0)
        # dynamo must see freezing on while it traces, or it lifts the weights into graph inputs and inductor has no
        # constants to fold.
        with inductor_config.patch(freezing=True):
            return self._compiled(*args, **kwargs)
