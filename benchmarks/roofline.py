"""A roofline estimate of each model's passes on a GPU: FLOPs and bytes per op, turned into time by the GPU's peaks.

An estimate, not a measurement. For each model and pass (the CFG sampling forward over 2·B latents and the training
step's forward and backward that `speed_vs_uvit.py` times, without the optimizer), every op is traced on the meta
device with the model in bf16, and each kernel is charged

    max(FLOPs / the GPU's dense bf16 tensor peak, bytes read and written / its memory bandwidth)

FLOPs are torch's own counts (`torch.utils.flop_counter`, as the speed benchmark counts them); an op's bytes are
its tensor inputs and outputs (a broadcast input counted once), so each kernel is assumed to read its operands and
write its result exactly once. Views move nothing and launch nothing; a LayerNorm over a strided view (the token
axis) copies it first, as ATen's does. U-ViT's attention is charged as one FlashAttention kernel, forward and
backward (torch's counts, with the backward's recomputation of the scores): reading Q, K, V (and O, dO in the
backward) and writing O (dQ, dK, dV), never the L × L scores.

Two bounds per pass:

- unfused: one kernel per op, as eager mode runs them; kernel launches cost nothing here;
- fused: the GEMMs and attention alone, as if every LayerNorm, GELU, residual add and copy were fused into them.

A measured time lies above the unfused bound; how far, and how much of the gap fusion could close, is what the
estimate is for. The speed-up is U-ViT-S/2's estimated time over the model's, under the same bound.

    python benchmarks/roofline.py                                   # U-ViT-S/2, F2-deep, 4E2H on an H100 and an RTX 4090
    python benchmarks/roofline.py --batch_sizes 64 256 --output_dir roofline

It imports the models from `speed_vs_uvit.py` and the kinds of work from `profile_passes.py` beside it.
"""

import argparse
import json
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from profile_passes import kind_of
from speed_vs_uvit import BASELINE, build, inputs, markdown, refuse_unknown_configs
from torch.overrides import TorchFunctionMode
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from diffusers_lmlp.commands import number


@dataclass(frozen=True)
class GPU:
    """The two peaks of the roofline."""

    bf16_tflops: float  # dense bf16 tensor-core peak with fp32 accumulation, TFLOP/s
    bandwidth_gbs: float  # memory bandwidth, GB/s


# Datasheet peaks: the H100 SXM5 80GB (HBM3), and the RTX 4090 (the L-MLP paper's GPU; 165.2 TFLOP/s is its bf16
# rate with fp32 accumulation, which torch's bf16 GEMMs use, half its fp16-accumulate rate).
GPUS = {"H100": GPU(989.0, 3350.0), "RTX 4090": GPU(165.2, 1008.0)}
KINDS = ("GEMM", "attention", "norm", "layout", "activation", "other")
PASSES = ("sampling", "training")
# Ops that launch no kernel besides views: allocations whose contents the next kernel writes, and the reshape of a
# contiguous result that autograd does not track as a view.
NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_unsafe_view"}
# Ops whose kernels read contiguous tensors only and copy any other input first, inside the op, where a dispatch
# mode does not see it (ATen's LayerNorm calls `expect_contiguous()` on its input, and on dY and X in the backward).
COPY_STRIDED_INPUTS = {"native_layer_norm", "native_layer_norm_backward"}


@dataclass
class Op:
    """One kernel of a pass: its aten name, kind of work, FLOPs and bytes moved."""

    name: str
    kind: str
    flops: int
    bytes: int

    def seconds(self, gpu: GPU) -> float:
        """The roofline time of this kernel: bound by arithmetic or by memory, whichever is slower."""
        return max(self.flops / (gpu.bf16_tflops * 1e12), self.bytes / (gpu.bandwidth_gbs * 1e9))


def distinct_bytes(tensor: torch.Tensor) -> int:
    """The bytes a kernel reads or writes for a tensor: its elements, each broadcast (stride-0) dimension once."""
    elements = 1
    for size, stride in zip(tensor.shape, tensor.stride()):
        elements *= size if stride != 0 else 1
    return elements * tensor.element_size()


class _RecordOps(TorchDispatchMode):
    """Record every kernel an op runs (`Op`), views and allocations left out."""

    def __init__(self):
        super().__init__()
        self.ops: list[Op] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._overloadpacket.__name__
        if func.is_view or name in NO_KERNEL:
            return out
        if name in COPY_STRIDED_INPUTS:
            for x in args:
                if isinstance(x, torch.Tensor) and not x.is_contiguous():
                    moved = distinct_bytes(x) + x.numel() * x.element_size()  # read as it is, written whole
                    self.ops.append(Op(f"{name} (copy of a strided input)", "layout", 0, moved))
        formula = flop_counter.flop_registry.get(func._overloadpacket)
        flops = formula(*args, **kwargs, out_val=out) if formula is not None else 0
        tensors = [x for x in tree_leaves((args, kwargs, out)) if isinstance(x, torch.Tensor)]
        kind = "GEMM" if flops else kind_of(f"aten::{name}")  # the counted ops are matmuls and convolutions
        self.ops.append(Op(name, kind, int(flops), sum(map(distinct_bytes, tensors))))
        return out


class _FlashAttention(torch.autograd.Function):
    """Scaled dot-product attention as one fused kernel each way, recorded with torch's FLOP counts; the outputs
    are shapes only (the pass runs on the meta device)."""

    @staticmethod
    def forward(ctx, recorder: _RecordOps, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
        ctx.recorder = recorder
        ctx.save_for_backward(query, key, value)
        out = query.new_empty((*query.shape[:-1], value.shape[-1]))  # (B, H, L, d_v)
        flops = flop_counter.sdpa_flop_count(query.shape, key.shape, value.shape)
        moved = sum(map(distinct_bytes, (query, key, value, out)))
        recorder.ops.append(Op("flash_attention", "attention", flops, moved))
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        query, key, value = ctx.saved_tensors
        flops = flop_counter.sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)
        # reads Q, K, V, O and dO, writes dQ, dK and dV: O is dO's size
        moved = sum(map(distinct_bytes, (query, key, value, grad_out, grad_out, query, key, value)))
        ctx.recorder.ops.append(Op("flash_attention_backward", "attention", flops, moved))
        return None, query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)


class _AsFlashAttention(TorchFunctionMode):
    """Route `F.scaled_dot_product_attention` to `_FlashAttention` instead of its decomposition."""

    def __init__(self, recorder: _RecordOps):
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            # the defaults: no mask, no dropout, not causal, the default scale
            unsupported = sorted(
                k for k, v in kwargs.items() if not (v is None or v is False or (isinstance(v, float) and v == 0.0))
            )
            if len(args) != 3 or unsupported:
                raise NotImplementedError(f"the roofline models plain attention only, not {unsupported}")
            return _FlashAttention.apply(self.recorder, *args)
        return func(*args, **kwargs)


@contextmanager
def recording() -> Iterator[_RecordOps]:
    """Record the kernels the code inside runs, attention as FlashAttention."""
    recorder = _RecordOps()
    with _AsFlashAttention(recorder), recorder:
        yield recorder


def trace(name: str, batch_size: int, pass_: str, num_layers: int | None = None) -> list[Op]:
    """The kernels of one pass of a named model in bf16, on the meta device.

    Args:
        name (`str`): A named configuration (`U-ViT-S/2`, `F2-deep`, ...).
        batch_size (`int`): B; the sampling pass runs 2·B latents (classifier-free guidance), the training pass B.
        pass_ (`str`): `"sampling"` (one forward) or `"training"` (forward, MSE against noise, backward).
        num_layers (`int`, *optional*): Override the depth (a smoke run).
    """
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16, as `from_pretrained(..., torch_dtype=torch.bfloat16)`
    try:
        model = build(name, num_layers, device="meta")
    finally:
        torch.set_default_dtype(default_dtype)
    rows = 2 * batch_size if pass_ == "sampling" else batch_size
    data = {
        k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in inputs(model.config, rows, "meta").items()
    }
    if pass_ == "sampling":
        model.requires_grad_(False)
    with recording() as recorder:
        out = model(data["latents"], data["text"], data["timesteps"]).sample
        if pass_ == "training":
            F.mse_loss(out, torch.empty_like(out)).backward()
    return recorder.ops


@dataclass
class Estimate:
    """One model's pass on one GPU: totals, and the estimated time by kind and under each bound."""

    model: str
    pass_: str
    batch_size: int
    gpu: str
    kernels: int
    gflop: float
    gigabytes: float  # read and written, every kernel
    unfused_ms: float  # every kernel's roofline time, summed
    fused_ms: float  # the GEMMs' and attention's alone
    ms_by_kind: dict = field(default_factory=dict)  # kind -> unfused ms
    gigabytes_by_kind: dict = field(default_factory=dict)


def estimate(model: str, pass_: str, batch_size: int, gpu_name: str, ops: list[Op]) -> Estimate:
    """Sum a traced pass's kernels (`trace`) into its estimate on `gpu_name` (`GPUS`)."""
    gpu = GPUS[gpu_name]
    ms, moved = defaultdict(float), defaultdict(float)
    for op in ops:
        ms[op.kind] += 1e3 * op.seconds(gpu)
        moved[op.kind] += op.bytes / 1e9
    return Estimate(
        model=model,
        pass_=pass_,
        batch_size=batch_size,
        gpu=gpu_name,
        kernels=len(ops),
        gflop=sum(op.flops for op in ops) / 1e9,
        gigabytes=sum(moved.values()),
        unfused_ms=sum(ms.values()),
        fused_ms=ms["GEMM"] + ms["attention"],
        ms_by_kind={kind: ms[kind] for kind in KINDS},
        gigabytes_by_kind={kind: moved[kind] for kind in KINDS},
    )


def speedup(row: Estimate, rows: list[Estimate], bound: str) -> float:
    """U-ViT-S/2's estimated time over the row's, same pass, batch, GPU and bound (`"unfused"` or `"fused"`)."""
    baseline = next(
        r for r in rows if (r.model, r.pass_, r.batch_size, r.gpu) == (BASELINE, row.pass_, row.batch_size, row.gpu)
    )
    return getattr(baseline, f"{bound}_ms") / getattr(row, f"{bound}_ms")


SUMMARY_HEADER = (
    "GPU", "B", "model", "pass", "kernels", "GFLOP", "GB moved", "unfused ms", "images/s", "vs U-ViT",
    "fused ms", "images/s", "vs U-ViT",
)  # fmt: skip
KIND_HEADER = ("GPU", "B", "model", "pass", *(f"{kind} ms" for kind in KINDS), "non-GEMM share")


def summary_table(rows: list[Estimate]) -> str:
    """Totals and both bounds of every row, with images/s and the speed-up over U-ViT-S/2."""
    lines = [
        f"| {r.gpu} | {r.batch_size} | {r.model} | {r.pass_} | {r.kernels:,} | {r.gflop:,.0f} | {r.gigabytes:,.1f} | "
        f"{r.unfused_ms:.2f} | {1e3 * r.batch_size / r.unfused_ms:,.0f} | {speedup(r, rows, 'unfused'):.2f}× | "
        f"{r.fused_ms:.2f} | {1e3 * r.batch_size / r.fused_ms:,.0f} | {speedup(r, rows, 'fused'):.2f}× |"
        for r in rows
    ]
    return markdown(SUMMARY_HEADER, lines)


def kind_table(rows: list[Estimate]) -> str:
    """The unfused estimate split by kind of work, and the share outside the GEMMs and attention."""
    lines = [
        f"| {r.gpu} | {r.batch_size} | {r.model} | {r.pass_} | "
        + " | ".join(f"{r.ms_by_kind[kind]:.2f}" for kind in KINDS)
        + f" | {1 - r.fused_ms / r.unfused_ms:.0%} |"
        for r in rows
    ]
    return markdown(KIND_HEADER, lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=[BASELINE, "F2-deep", "4E2H"], help="named configs")
    parser.add_argument("--gpus", nargs="+", default=list(GPUS), choices=list(GPUS))
    parser.add_argument("--batch_sizes", type=number(int, 1), nargs="+", default=[256], help="B: images per step")
    parser.add_argument("--num_layers", type=int, help="override every model's depth (a smoke run)")
    parser.add_argument("--output_dir", type=Path, default=Path("roofline"))
    args = parser.parse_args(argv)
    refuse_unknown_configs(parser, args.models)
    args.models = [BASELINE] + [name for name in dict.fromkeys(args.models) if name != BASELINE]
    return args


def main(argv: list[str] | None = None) -> list[Estimate]:
    args = parse_args(argv)
    rows = []
    for batch_size in args.batch_sizes:
        for model in args.models:
            for pass_ in PASSES:
                ops = trace(model, batch_size, pass_, args.num_layers)
                rows += [estimate(model, pass_, batch_size, gpu, ops) for gpu in args.gpus]
    rows.sort(key=lambda r: (args.gpus.index(r.gpu), r.batch_size, PASSES.index(r.pass_)))
    peaks = "; ".join(
        f"{name}: {gpu.bf16_tflops:g} TFLOP/s bf16, {gpu.bandwidth_gbs:g} GB/s" for name, gpu in GPUS.items()
    )
    text = "\n\n".join(
        [
            f"An estimate, not a measurement: bf16, the roofline of each kernel ({peaks}).",
            summary_table(rows),
            "The unfused estimate by kind of work (ms):",
            kind_table(rows),
        ]
    )
    print(text)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / "roofline.md").write_text(text + "\n")
    (args.output_dir / "roofline.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return rows


if __name__ == "__main__":
    main()
