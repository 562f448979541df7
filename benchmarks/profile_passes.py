"""Where a model's sampling and training passes spend their time: torch's profiler, grouped by kind of work.

For each model, the same passes `speed_vs_uvit.py` times (a CFG sampling forward over 2·B latents; a training step:
forward, MSE, backward, AdamW), in one mode and precision. Each pass runs twice to compile and warm up, then
`--steps` times under `torch.profiler`. The device time of every kernel (CPU: the self time of every operator, and
of every compiled kernel) is summed per kind:

- GEMM: matrix multiplies (cuBLAS, CUTLASS and inductor's templates; on the CPU `mm`, `addmm`, `bmm`);
- attention: fused attention kernels (FlashAttention, memory-efficient and math SDPA);
- norm: LayerNorm kernels, and compiled kernels that fuse a LayerNorm;
- layout: copies, transposes, permutes and `clone`s (compiled kernels that only move data);
- activation: compiled or eager GELU kernels;
- optimizer: AdamW's kernels;
- other: every other kernel (element-wise adds, the loss, reductions, the embeddings' small ops).

A compiled kernel fuses several ops and is named after them (`triton_per_fused_add_native_layer_norm_...`); it is
counted once, under the first kind its name matches, in the order of the list above (`KINDS`). So "norm" holds the
LayerNorms and what inductor fused into them, and inductor's GEMM templates (`triton_tem_...`) count as GEMMs with
the epilogues fused into them. The tables give each kind's share of the pass's kernel time and the
pass's most expensive kernels.

    python benchmarks/profile_passes.py --device cuda --precision bf16 --mode regional --batch_size 256
    python benchmarks/profile_passes.py --models F2-deep --mode eager --output_dir profile-cpu      # the CPU

It imports the passes from `speed_vs_uvit.py` beside it (a script's folder is on its import path).
"""

import argparse
import json
import re
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from speed_vs_uvit import (
    MODES,
    SAMPLING_ONLY_MODES,
    build,
    inputs,
    machine_line,
    make_runner,
    markdown,
    refuse_unknown_configs,
    sampling_step,
    synchronize,
    training_step,
)
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from diffusers_lmlp.commands import number


PASSES = ("sampling", "training")
# kind -> pattern on the lower-cased kernel or operator name; the first kind that matches counts the kernel.
KINDS = {
    "optimizer": r"adam|multi_tensor|foreach|_fused_adam",
    "attention": r"flash|fmha|attention|sdpa|scaled_dot_product|cudnn_.*mha",
    "GEMM": r"triton_tem_|gemm|cutlass|xmma|nvjet|sm90_|cublas|^aten::(mm|addmm|bmm|baddbmm)$|^mkl|_mm_|mkldnn",
    "norm": r"layer_norm|layernorm",
    "activation": r"gelu",
    "layout": r"copy|clone|transpose|permute|contiguous|cat_|_cat\b|^aten::(cat|stack)$",
}
# Profiler entries that are not kernels: wrappers whose self time only counts launch overhead (CPU side).
WRAPPERS = re.compile(r"^(##|profilerstep|compiledfunction|torch-compiled|cudagraph|aten::(linear|matmul)$)")


def kind_of(name: str) -> str:
    """The kind of work a kernel or operator name does (`KINDS`), "other" when no pattern matches.

    Args:
        name (`str`): The kernel's or operator's name as the profiler reports it.
    """
    lowered = name.lower()
    for kind, pattern in KINDS.items():
        if re.search(pattern, lowered):
            return kind
    return "other"


@dataclass
class Profile:
    """One model's pass: its time per step, the share of each kind, and its most expensive kernels."""

    model: str
    pass_: str
    batch_size: int
    precision: str
    mode: str
    step_ms: float  # wall time of one step, the profiler's overhead included
    kernel_ms: float  # the kernels' own time per step (device time on a GPU, operators' self time on the CPU)
    shares: dict  # kind -> fraction of kernel_ms
    top: list  # [name, kind, ms per step, calls per step]


def kernel_times(events: Iterable, device: str) -> dict[str, tuple[float, int, str]]:
    """Kernel or operator name -> (total µs, calls, kind) over the profiled steps.

    On a GPU: each kernel's own device time, from the profiler's device events (its CPU operators, which carry the
    same time again as their kernels', are left out); AdamW's kernels are fused or `multi_tensor_apply` ones. On
    the CPU: each operator's self time, wrappers left out; an operator that runs inside `Optimizer.step` counts as
    "optimizer" (the fused AdamW the passes use is one operator, but the step count's `add_` runs beside it).

    Args:
        events (`Iterable[FunctionEvent]`): The profiler's events (`prof.events()`).
        device (`str`): `"cuda"` or `"cpu"`.
    """
    times: dict[str, list] = {}
    for event in events:
        if device == "cuda":
            if event.device_type == DeviceType.CPU:
                continue
            key, kind, total = event.name, kind_of(event.name), event.device_time_total
        else:
            if event.device_type != DeviceType.CPU or WRAPPERS.search(event.name.lower()):
                continue
            key, kind, total = event.name, kind_of(event.name), event.self_cpu_time_total
            parent = event.cpu_parent
            while parent is not None:
                if parent.name.startswith("Optimizer.step"):
                    key, kind = f"{event.name} (in Optimizer.step)", "optimizer"
                parent = parent.cpu_parent
        if total > 0:
            entry = times.setdefault(key, [0.0, 0, kind])
            entry[0] += total
            entry[1] += 1
    return {key: tuple(value) for key, value in times.items()}


def profile_pass(name: str, pass_: str, args: argparse.Namespace) -> Profile:
    """Profile `args.steps` steps of one model's pass after two warm-up steps (the first compiles).

    Args:
        name (`str`): The named config.
        pass_ (`str`): `"sampling"` or `"training"`.
        args (`argparse.Namespace`): The command line (device, batch size, precision, mode, steps).
    """
    model = build(name, args.num_layers, args.device)
    runner = make_runner(model, args.mode)
    data = inputs(model.config, args.batch_size, args.device)
    if pass_ == "sampling":
        step = sampling_step(runner, data, args.device, args.precision)
    else:
        step = training_step(runner, runner if args.mode == "regional" else model, data, args.device, args.precision)
    step()
    step()
    synchronize(args.device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        synchronize(args.device)
        step_ms = (time.perf_counter() - start) / args.steps * 1e3
    times = kernel_times(prof.events(), args.device)
    total = sum(t for t, _, _ in times.values())
    shares = dict.fromkeys([*KINDS, "other"], 0.0)
    for t, _, kind in times.values():
        shares[kind] += t / total
    ranked = sorted(times.items(), key=lambda item: -item[1][0])[: args.top]
    top = [[key, kind, t / args.steps / 1e3, count // args.steps] for key, (t, count, kind) in ranked]
    return Profile(
        name, pass_, args.batch_size, args.precision, args.mode, step_ms, total / args.steps / 1e3, shares, top
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["U-ViT-S/2", "F2-deep", "4E2H"], help="named configs")
    parser.add_argument("--passes", nargs="+", default=list(PASSES), choices=PASSES)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument(
        "--mode", default="regional", choices=MODES, help="frozen (the pipeline's inductor freezing): sampling only"
    )
    parser.add_argument("--batch_size", type=number(int, 1), default=8, help="B: images per step (sampling runs 2·B)")
    parser.add_argument("--steps", type=number(int, 1), default=5, help="profiled steps, after two warm-up steps")
    parser.add_argument("--top", type=number(int, 1), default=8, help="most expensive kernels listed per pass")
    parser.add_argument("--num_layers", type=int, help="override every model's depth (a smoke run)")
    parser.add_argument("--output_dir", type=Path, default=Path("profile"))
    args = parser.parse_args(argv)
    refuse_unknown_configs(parser, args.models)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU, and torch sees none here; profile the CPU without it.")
    if args.mode in SAMPLING_ONLY_MODES and "training" in args.passes:
        parser.error(f"--mode {args.mode} compiles for inference only: add --passes sampling.")
    return args


def shares_table(profiles: list[Profile]) -> str:
    kinds = [*KINDS, "other"]
    header = ("model", "pass", "B", "precision", "mode", "step ms", "kernels ms", *kinds)
    lines = [
        "| "
        + " | ".join(
            [p.model, p.pass_, str(p.batch_size), p.precision, p.mode, f"{p.step_ms:.2f}", f"{p.kernel_ms:.2f}"]
            + [f"{p.shares[kind]:.0%}" for kind in kinds]
        )
        + " |"
        for p in profiles
    ]
    return markdown(header, lines)


def top_table(profile_: Profile) -> str:
    lines = [f"| {name[:100]} | {kind} | {ms:.3f} | {calls} |" for name, kind, ms, calls in profile_.top]
    return markdown(("kernel", "kind", "ms per step", "calls per step"), lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    torch._dynamo.config.recompile_limit = 64  # every model and pass in one process (see speed_vs_uvit.main)
    if args.device == "cpu":
        torch._inductor.config.cpp.enable_kernel_profile = True  # compiled CPU kernels appear in the profile by name
    print(machine_line(args.device) + "\n", flush=True)
    profiles = []
    for name in args.models:
        for pass_ in args.passes:
            profiles.append(profile_pass(name, pass_, args))
            print(shares_table(profiles[-1:]) + "\n\n" + top_table(profiles[-1]) + "\n", flush=True)
    report = [machine_line(args.device), "", "## Share of kernel time by kind", "", shares_table(profiles), ""]
    for p in profiles:
        report += [f"## {p.model}, {p.pass_}: the {len(p.top)} most expensive kernels", "", top_table(p), ""]
    text = "\n".join(report)
    (args.output_dir / "profile.md").write_text(text + "\n")
    results = {"machine": machine_line(args.device), "profiles": [asdict(p) for p in profiles]}
    (args.output_dir / "profile.json").write_text(json.dumps(results, indent=2) + "\n")
    print(text)
    print(f"\nWrote {args.output_dir / 'profile.md'} and profile.json")


if __name__ == "__main__":
    main()
