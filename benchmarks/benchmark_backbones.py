"""Throughput of the backbones, as a fraction of this machine's practical matrix-multiply peak.

For each model (F2 and the MoE-MLP configs) and precision, the script times a forward pass and a training step
(forward + backward), counts their FLOPs with torch's own FLOP counter, and times a plain GEMM of the model's
dominant shape, (B·L, D) × (D, s·D), in the same precision and the same process, interleaved with the model runs.
Only the ratio "achieved GFLOP/s / GEMM GFLOP/s" is a claim; absolute times depend on the machine and its load.

    python benchmarks/benchmark_backbones.py                 # the full table: batch 8, fp32 and bf16
    python benchmarks/benchmark_backbones.py --quick         # batch 2, fewer repeats; bf16 only where it is fast
    python benchmarks/benchmark_backbones.py --compile       # also time torch.compile'd models
    python benchmarks/benchmark_backbones.py --reuse-freed-memory   # glibc keeps freed buffers (see allocator.py)
"""

import argparse
import contextlib
import platform
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from diffusers_lmlp import LMLPTransformer2DModel, MoEMLPModel
from diffusers_lmlp.allocator import reuse_freed_memory
from diffusers_lmlp.complexity import flop_counter


MODELS = {"F2": LMLPTransformer2DModel, "2E1H": MoEMLPModel, "4E1H": MoEMLPModel, "4E2H": MoEMLPModel}
PRECISIONS = ["fp32", "bf16"]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--precisions", nargs="+", default=PRECISIONS, choices=PRECISIONS)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each step (the best one counts)")
    parser.add_argument("--compile", action="store_true", help="also time torch.compile(model)")
    parser.add_argument("--quick", action="store_true", help="batch 2, 2 repeats, skip precisions that are slow here")
    parser.add_argument(
        "--reuse-freed-memory", action="store_true", help="let glibc reuse freed buffers (no page fault per pass)"
    )
    parser.add_argument("--num-layers", type=int, help="override the depth (e.g. 2 for a smoke run)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.quick:
        args.batch_size, args.repeats = 2, 2
    return args


def precision_context(precision: str) -> contextlib.AbstractContextManager:
    """bf16 runs under autocast, as `accelerate --mixed_precision bf16` trains and pipelines sample."""
    if precision == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def best_seconds(step: Callable[[], object]) -> float:
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def count_flops(step: Callable[[], object]) -> int:
    with flop_counter() as counter:
        step()
    return counter.get_total_flops()


def make_steps(model: torch.nn.Module, batch_size: int, precision: str, seed: int) -> dict[str, Callable]:
    """The forward and training steps of one model on random inputs of its native shapes."""
    config = model.config
    gen = torch.Generator().manual_seed(seed)
    latents = torch.randn(batch_size, config.in_channels, config.sample_size, config.sample_size, generator=gen)
    text = torch.randn(batch_size, config.text_seq_len, config.text_embed_dim, generator=gen)
    timesteps = torch.randint(0, 1000, (batch_size,), generator=gen)

    def forward():
        with torch.inference_mode(), precision_context(precision):
            return model(latents, text, timesteps).sample

    def train_step():
        model.zero_grad(set_to_none=True)
        with precision_context(precision):
            loss = (model(latents, text, timesteps).sample.float() - latents).pow(2).mean()
        loss.backward()

    return {"forward": forward, "forward+backward": train_step}


def gemm_step(model: torch.nn.Module, batch_size: int, precision: str) -> Callable:
    """The model's dominant GEMM, the joint MLP's (B·L, D) × (D, s·D), as one bias-free `F.linear`.

    It runs in the same precision context as the model (bf16: autocast), so it takes the same kernels: on CPUs
    without native bf16, oneDNN's `linear` is much faster than a `torch.mm` of bf16 tensors.
    """
    hidden = model.config.hidden_size
    a = torch.randn(batch_size * model.seq_len, hidden)
    w = torch.randn(int(hidden * model.config.mlp_ratio), hidden)

    def step():
        with torch.inference_mode(), precision_context(precision):
            return F.linear(a, w)

    return step


def gemm_gflops(step: Callable, shape_flops: int, repeats: int) -> float:
    step()
    return shape_flops / min(best_seconds(step) for _ in range(repeats)) / 1e9


def cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next(line for line in f if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return "unknown"
    shown = [flag for flag in flags if flag.startswith(("avx512f", "avx512_bf16", "amx")) or flag == "avx2"]
    return " ".join(sorted(set(shown))) or "none of avx2/avx512/amx"


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    allocator = "glibc default"
    if args.reuse_freed_memory:
        allocator = "reusing freed memory" if reuse_freed_memory() else "glibc default (no glibc found)"
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}, "
        f"CPU flags: {cpu_flags()}, allocator: {allocator}, batch {args.batch_size}, best of {args.repeats}\n"
    )
    rows = []
    for precision in args.precisions:
        for name in args.models:
            overrides = {} if args.num_layers is None else {"num_layers": args.num_layers}
            model = MODELS[name].from_named_config(name, **overrides)
            hidden, inner = model.config.hidden_size, int(model.config.hidden_size * model.config.mlp_ratio)
            gemm = gemm_step(model, args.batch_size, precision)
            gemm_flops = 2 * args.batch_size * model.seq_len * hidden * inner
            if args.quick and precision != "fp32":
                fp32_peak = gemm_gflops(gemm_step(model, args.batch_size, "fp32"), gemm_flops, 3)
                peak = gemm_gflops(gemm, gemm_flops, 3)
                if peak < fp32_peak:
                    print(
                        f"skipped {name} {precision}: a {precision} GEMM runs at {peak:.1f} GFLOP/s here against "
                        f"{fp32_peak:.1f} in fp32 (no native {precision} on this CPU); drop --quick to time it.\n"
                    )
                    continue
            variants = {"eager": model}
            if args.compile:
                variants["compiled"] = torch.compile(model)
            for variant, runner in variants.items():
                runner.train()
                steps = make_steps(runner, args.batch_size, precision, args.seed)
                for mode, step in steps.items():
                    flops = count_flops(make_steps(model, 1, "fp32", args.seed)[mode]) * args.batch_size
                    step()  # warm-up (and compilation)
                    model_times, gemm_times = [], []
                    for _ in range(args.repeats):  # interleaved, so both see the same machine load
                        gemm_times.append(best_seconds(gemm))
                        model_times.append(best_seconds(step))
                    seconds, peak = min(model_times), gemm_flops / min(gemm_times) / 1e9
                    achieved = flops / seconds / 1e9
                    rows.append(
                        (
                            name,
                            f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M",
                            precision,
                            variant,
                            mode,
                            f"{args.batch_size / seconds:.2f}",
                            f"{achieved:.1f}",
                            f"{peak:.1f}",
                            f"{achieved / peak:.0%}",
                        )
                    )
                    print("| " + " | ".join(rows[-1]) + " |", flush=True)
    header = ("model", "params", "precision", "variant", "pass", "images/s", "GFLOP/s", "GEMM GFLOP/s", "of GEMM")
    print("\n| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
