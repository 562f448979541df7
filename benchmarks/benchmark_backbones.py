"""Throughput of the backbones, as a fraction of this machine's practical matrix-multiply peak.

For each model (any named configuration of the registry; by default F2-deep and the MoE-MLP configs) and precision, the script times a forward pass and a training step
(forward + backward), counts their FLOPs with torch's own FLOP counter, and times a plain GEMM of the model's
dominant shape, (B·L, D) × (D, s·D), in the same precision and the same process, interleaved with the model runs.
Only the ratio "achieved GFLOP/s / GEMM GFLOP/s" is a claim; absolute times depend on the machine and its load.

    python benchmarks/benchmark_backbones.py                 # the full table: batch 8, fp32 and bf16
    python benchmarks/benchmark_backbones.py --quick         # batch 2, fewer repeats; bf16 only where it is fast
    python benchmarks/benchmark_backbones.py --compile       # also time torch.compile'd models
    python benchmarks/benchmark_backbones.py --models F2-deep --precisions fp32 --compare-bypass   # issue 9 before/after
    python benchmarks/benchmark_backbones.py --reuse-freed-memory   # glibc keeps freed buffers (see allocator.py)
"""

import argparse
import contextlib
import copy
import platform
import time
import types
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from diffusers_lmlp.allocator import reuse_freed_memory
from diffusers_lmlp.models import from_named_config, named_configs


DEFAULT_MODELS = ["F2-deep", "2E1H", "4E1H", "4E2H"]
PRECISIONS = ["fp32", "bf16"]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=DEFAULT_MODELS, choices=list(named_configs()))
    parser.add_argument("--precisions", nargs="+", default=PRECISIONS, choices=PRECISIONS)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each step (the best one counts)")
    parser.add_argument("--compile", action="store_true", help="also time torch.compile(model)")
    parser.add_argument(
        "--compare-bypass",
        action="store_true",
        help="also time the blocks as they were before issue 9 (residuals folded into addmm_ on the Linear weights)",
    )
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
    with FlopCounterMode(display=False) as counter:
        step()
    return counter.get_total_flops()


def _bypass_residual_linear(residual: torch.Tensor, x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """`residual + linear(x)` as one in-place GEMM on the Linear's weight: the removed pre-issue-9 route."""
    if not residual.dtype == x.dtype == linear.weight.dtype:
        return residual + linear(x)
    out = (residual + linear.bias).flatten(0, 1)  # (B·L, D_out)
    return out.addmm_(x.flatten(0, 1), linear.weight.t()).view_as(residual)


def _bypass_block_forward(block: nn.Module, x: torch.Tensor, skip: torch.Tensor | None = None) -> torch.Tensor:
    """An L-MLP/MoE-MLP block as it ran before issue 9: `merge`, `joint_mlp.fc2` and the L-MLP's token matrix were
    applied by reading their weights, so hooks, LoRA and FLOP counters missed them. Kept here only to measure what
    calling every layer as a module costs; the library never does this.
    """
    if skip is not None:
        x = x + skip
    x_tok = block.token_norm(x.transpose(1, 2))  # (B, D, L)
    x = block.channel_norm(x)  # (B, L, D)
    if isinstance(block.left, nn.Linear):
        weight = block.left.weight.expand(x.shape[0], -1, -1)  # (B, L, L)
        left = torch.baddbmm(block.left.bias[:, None], weight, x_tok.transpose(1, 2))
    else:
        left = block.left(x_tok).transpose(1, 2)  # (B, L, D) view
    x = _bypass_residual_linear(x, block.right(x).add_(left), block.merge)
    hidden = F.gelu(block.joint_mlp.fc1(block.channel_norm(x)))  # (B, L, s·D)
    return _bypass_residual_linear(x, hidden, block.joint_mlp.fc2)


def bypass_copy(model: nn.Module) -> nn.Module:
    """A copy of `model` whose blocks run `_bypass_block_forward` (the same weights, so the same outputs)."""
    before = copy.deepcopy(model)
    for block in [*before.stack.in_blocks, before.stack.mid_block, *before.stack.out_blocks]:
        block.forward = types.MethodType(_bypass_block_forward, block)
    return before


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
            model = from_named_config(name, **overrides)
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
            if args.compare_bypass:
                variants["before (bypass)"] = bypass_copy(model)
            if args.compile:
                variants["compiled"] = torch.compile(model)
            for runner in variants.values():
                runner.train()
            for mode in ("forward", "forward+backward"):
                # The eager model calls every layer as a module, so torch's counter sees all of its FLOPs; every
                # variant computes the same thing.
                flops = count_flops(make_steps(model, 1, "fp32", args.seed)[mode]) * args.batch_size
                steps = {
                    variant: make_steps(runner, args.batch_size, precision, args.seed)[mode]
                    for variant, runner in variants.items()
                }
                for step in steps.values():
                    step()  # warm-up (and compilation)
                model_times, gemm_times = {variant: [] for variant in steps}, []
                for repeat in range(args.repeats):  # interleaved, so all see the same machine load
                    gemm_times.append(best_seconds(gemm))
                    order = list(steps) if repeat % 2 == 0 else list(reversed(steps))  # no variant always goes first
                    for variant in order:
                        model_times[variant].append(best_seconds(steps[variant]))
                peak = gemm_flops / min(gemm_times) / 1e9
                for variant, times in model_times.items():
                    seconds = min(times)
                    achieved = flops / seconds / 1e9
                    rows.append(
                        (
                            name,
                            f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M",
                            precision,
                            variant,
                            mode,
                            f"{args.batch_size / seconds:.2f}",
                            f"{min(model_times['eager']) / seconds:.3f}",
                            f"{achieved:.1f}",
                            f"{peak:.1f}",
                            f"{achieved / peak:.0%}",
                        )
                    )
                    print("| " + " | ".join(rows[-1]) + " |", flush=True)
    header = (
        "model",
        "params",
        "precision",
        "variant",
        "pass",
        "images/s",
        "speed vs eager",
        "GFLOP/s",
        "GEMM GFLOP/s",
        "of GEMM",
    )
    print("\n| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
