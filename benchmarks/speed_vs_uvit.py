"""Speed of every block family against the U-ViT-S/2 attention baseline, measured side by side in one process.

What it measures, for each model in each of its modes (eager, `torch.compile` of the whole model, diffusers'
regional compilation of the repeated block, `compile_repeated_blocks()`, and, for sampling only, the whole model
compiled with inductor's freezing, as `LMLPPipeline.enable_inductor_freezing()` samples), and for fp32 and, where the
machine has native bf16, bf16:

- sampling: images/s of the pipeline's classifier-free-guidance forward (one forward over 2·B latents);
- training: images/s of a training step (forward, MSE loss, backward, AdamW step) at batch B;
- the achieved GFLOP/s (FLOPs counted by torch's counter on the meta device, where attention is counted too) and
  the fraction of the GEMM rate: the time of the pass's own matrix multiplies alone (every GEMM it runs, same
  shapes and layouts, as plain `torch.mm`/`torch.bmm`), timed in the same window, over the pass's time;
- the speed-up over U-ViT-S/2, each model in its best mode against U-ViT in its best mode, both timed in the same
  interleaved window (and eager against eager);
- the time over the reference UL-MLP's (F2-deep, the MoE-MLP's dense counterpart), best mode against best mode and
  eager against eager, F2-deep's best and eager modes timed in the same window as each later model;
- the pipeline's wall time for 50 steps against the sum of its parts (50 CFG forwards of the backbone, i.e. 100 image
  forwards, plus one VAE decode), so that nothing but the model costs;
- peak memory of a training step at batch B, with and without gradient checkpointing (CPU: the rise of the
  process's peak resident memory during one step, both in a fresh process per model; CUDA: `max_memory_allocated`);
- on a GPU (`--device cuda`): images/s and bf16 MFU at batches 32–256, eager and compiled, and the largest training
  batch that fits.

Only ratios measured in one run are claims; absolute times depend on the machine and its load. The script prints
Markdown tables and writes them, a JSON file and a plot (`speed.png`) to `--output_dir`.

    python benchmarks/speed_vs_uvit.py --output_dir speed-cpu                  # every family, CPU (about an hour on 2 cores)
    python benchmarks/speed_vs_uvit.py --models F2-deep 4E2H --output_dir speed-cpu-main   # the papers' headline pair
    python benchmarks/speed_vs_uvit.py --device cuda --output_dir speed-gpu    # the GPU section (batches 32–256)
"""

import argparse
import contextlib
import copy
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from PIL import Image
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from diffusers_lmlp.allocator import reuse_freed_memory
from diffusers_lmlp.analysis.figures import bar_chart
from diffusers_lmlp.commands import number
from diffusers_lmlp.cpu import this_cpu
from diffusers_lmlp.models import family_of, from_named_config, named_configs
from diffusers_lmlp.models.backbone import UShapedMixerModel
from diffusers_lmlp.pipelines.freezing import FrozenTransformer
from diffusers_lmlp.training.step import fused_adamw


BASELINE = "U-ViT-S/2"
REFERENCE = "F2-deep"  # the paper's UL-MLP, against which the MoE-MLP's cost is read
# One model per registered family (Table 1's F2 beside the reference F2-deep), the baseline first.
DEFAULT_MODELS = [BASELINE, "F2-deep", "F2", "4E2H", "A2", "A3", "ParaMixer-S", "SymMixer-S", "AsymMixer-S"]
MODES = ("eager", "compile", "regional", "frozen")
# "graphs": the whole model under inductor with CUDA graphs (`mode="reduce-overhead"`), sampling at a fixed batch; not
# a default mode, since a CPU has no graphs to replay (it runs as "compile" there).
SAMPLING_ONLY_MODES = ("frozen", "graphs")  # freezing makes the weights constants, graphs replay fixed buffers
PASSES = ("sampling", "training")
# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity) of the GPUs this project runs on, for MFU. Others: the measured
# bf16 GEMM rate is used instead, and the table says so.
GPU_BF16_PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "RTX 4090": 165.2, "L40S": 362.0}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--models",
        nargs="+",
        default=DEFAULT_MODELS,
        help="named configs (U-ViT-S/2 is always added and runs first, then F2-deep if named)",
    )
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=(*MODES, "graphs"))
    parser.add_argument("--precisions", nargs="+", choices=("fp32", "bf16"), help="default: fp32, and bf16 if native")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--batch_size", type=number(int, 1), default=8, help="B: images per step (sampling runs 2·B)")
    parser.add_argument("--gpu_batch_sizes", type=int, nargs="+", default=[32, 64, 128, 256])
    parser.add_argument(
        "--repeats", type=number(int, 1), default=3, help="timed rounds; the best time of each variant counts"
    )
    parser.add_argument("--pipeline_models", nargs="*", default=["F2-deep", "4E2H", BASELINE])
    parser.add_argument("--pipeline_batch_size", type=number(int, 1), default=1)
    parser.add_argument("--pipeline_steps", type=number(int, 1), default=50)
    parser.add_argument("--memory_models", nargs="*", help="default: --models")
    parser.add_argument("--num_layers", type=int, help="override every model's depth (a smoke run)")
    parser.add_argument("--output_dir", type=Path, default=Path("speed"))
    parser.add_argument(
        "--reuse_freed_memory",
        action="store_true",
        help="let glibc keep freed buffers (diffusers_lmlp.allocator) instead of page-faulting them back every pass",
    )
    args = parser.parse_args(argv)
    refuse_unknown_configs(parser, args.models + args.pipeline_models + (args.memory_models or []))
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU, and torch sees none here; run the CPU section without it.")
    # The baseline, then the reference, run first: every later model is timed beside their steps.
    first = [BASELINE] + [REFERENCE] * (REFERENCE in args.models)
    args.models = first + [name for name in dict.fromkeys(args.models) if name not in first]
    if args.memory_models is None:
        args.memory_models = args.models
    if args.precisions is None:
        args.precisions = ["fp32", "bf16"] if native_bf16(args.device) else ["fp32"]
    return args


def refuse_unknown_configs(parser: argparse.ArgumentParser, names: Iterable[str]) -> None:
    """Stop with a usage error that lists the named configs when one of `names` is not one (`parser.error` exits)."""
    unknown = sorted(set(names) - set(named_configs()))
    if unknown:
        parser.error(f"unknown named configs {unknown}; choose from {sorted(named_configs())}")


def native_bf16(device: str) -> bool:
    """Whether bf16 matmuls are fast here: a GPU, or a CPU with avx512_bf16 or AMX (elsewhere bf16 is 8–80× slower)."""
    return device == "cuda" or this_cpu().native_bf16 is not None


def build(name: str, num_layers: int | None = None, device: str | torch.device = "cpu") -> UShapedMixerModel:
    overrides = {} if num_layers is None else {"num_layers": num_layers}
    torch.manual_seed(0)
    with torch.device(device):
        return from_named_config(name, **overrides)


def inputs(config, batch_size: int, device: str | torch.device) -> dict[str, torch.Tensor]:
    """Random latents (B, C, h, w), text states (B, T, D_text), timesteps (B,) and a noise target like the latents."""
    gen = torch.Generator().manual_seed(0)
    size = (batch_size, config.in_channels, config.sample_size, config.sample_size)
    return {
        "latents": torch.randn(size, generator=gen).to(device),
        "text": torch.randn(batch_size, config.text_seq_len, config.text_embed_dim, generator=gen).to(device),
        "timesteps": torch.randint(0, 1000, (batch_size,), generator=gen).to(device),
        "noise": torch.randn(size, generator=gen).to(device),
    }


def autocast(device: str, precision: str) -> contextlib.AbstractContextManager:
    """bf16 runs under autocast, as `accelerate --mixed_precision bf16` trains and the pipeline samples."""
    if precision == "bf16":
        return torch.autocast(device, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def make_runner(model: torch.nn.Module, mode: str) -> Callable:
    """The model in one mode: itself, `torch.compile(model)`, a copy with its repeated blocks compiled, the
    pipeline's frozen compilation of a copy (`FrozenTransformer`; sampling only), or `torch.compile(model,
    mode="reduce-overhead")` replaying CUDA graphs (`GraphedSampling`; sampling only).

    Every mode calls every layer as a module (compilation traces the modules, it does not replace them), so hooks and
    adapters registered before compiling run in all of them.
    """
    if mode == "eager":
        return model
    if mode == "compile":
        return torch.compile(model)
    if mode == "frozen":
        return FrozenTransformer().for_sampling(copy.deepcopy(model))
    if mode == "graphs":
        return GraphedSampling(torch.compile(model, mode="reduce-overhead"))
    regional = copy.deepcopy(model)
    regional.compile_repeated_blocks()
    return regional


class GraphedSampling(torch.nn.Module):
    """A compiled model whose CUDA graphs replay: each call starts a new step, so a replay may reuse the buffers of
    the outputs before it (which the timing loop drops)."""

    def __init__(self, compiled: torch.nn.Module):
        super().__init__()
        self.compiled = compiled

    def forward(self, *args, **kwargs):
        torch.compiler.cudagraph_mark_step_begin()
        return self.compiled(*args, **kwargs)


def sampling_step(runner: torch.nn.Module, data: dict, device: str, precision: str) -> Callable[[], torch.Tensor]:
    """One CFG forward of the pipeline: the batch's latents twice (unconditional | conditional)."""
    latents = torch.cat([data["latents"], data["latents"]])
    text, timesteps = torch.cat([data["text"], data["text"]]), torch.cat([data["timesteps"], data["timesteps"]])

    def step():
        with torch.inference_mode(), autocast(device, precision):
            return runner(latents, text, timesteps).sample

    return step


def training_step(
    runner: torch.nn.Module, model: torch.nn.Module, data: dict, device: str, precision: str
) -> Callable[[], torch.Tensor]:
    """One optimisation step on the batch, as the training script takes it (MSE on ε, AdamW with the trainer's
    kernel: torch's fused one on the CPU and CUDA)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=fused_adamw(torch.device(device)))

    def step():
        optimizer.zero_grad(set_to_none=True)
        with autocast(device, precision):
            prediction = runner(data["latents"], data["text"], data["timesteps"]).sample
        loss = F.mse_loss(prediction.float(), data["noise"])
        loss.backward()
        optimizer.step()
        return loss

    return step


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def seconds(step: Callable[[], object], device: str) -> float:
    synchronize(device)
    start = time.perf_counter()
    step()
    synchronize(device)
    return time.perf_counter() - start


class _RecordMatmuls(TorchDispatchMode):
    """Record the operands (shape, strides) of every matrix multiply a pass runs, attention's included."""

    def __init__(self):
        super().__init__()
        self.operands: list[tuple[bool, tuple, tuple, tuple, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _MATMULS:
            a, b = args[1:3] if func in (torch.ops.aten.addmm.default, torch.ops.aten.baddbmm.default) else args[:2]
            self.operands.append((a.ndim == 3, tuple(a.shape), a.stride(), tuple(b.shape), b.stride()))
        return func(*args, **(kwargs or {}))


_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}
_MATMULS.add(torch.ops.aten.baddbmm.default)


def meta_pass(name: str, num_layers: int | None, rows: int, train: bool) -> tuple[int, list[tuple]]:
    """One forward (or forward + backward) of `rows` images on the meta device: its FLOPs, counted by torch, and the
    operands (batched, a's shape, a's strides, b's shape, b's strides) of every matrix multiply it runs.

    On CPU tensors torch runs attention as a fused kernel its counter does not know (it counts 0); on meta attention
    runs as its two batched matmuls, so U-ViT's attention is counted and recorded like every other matmul.
    """
    model = build(name, num_layers, device="meta")
    data = inputs(model.config, rows, "meta")
    with FlopCounterMode(display=False) as counter, _RecordMatmuls() as recorder:
        out = model(data["latents"], data["text"], data["timesteps"]).sample
        if train:
            out.pow(2).mean().backward()
    return counter.get_total_flops(), recorder.operands


def gemm_step(operands: list[tuple], device: str, precision: str) -> Callable[[], None]:
    """A pass's matrix multiplies alone (`meta_pass`): the same shapes and memory layouts, as plain
    `torch.mm`/`torch.bmm` calls in the pass's precision, in order.

    Its time is what the pass would take if everything but its GEMMs were free; that time over the model's is the
    pass's "fraction of the GEMM rate".
    """
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    tensors: dict[tuple, torch.Tensor] = {}

    def operand(shape: tuple, stride: tuple) -> torch.Tensor:
        if (shape, stride) not in tensors:
            tensors[(shape, stride)] = torch.empty_strided(shape, stride, device=device, dtype=dtype).normal_()
        return tensors[(shape, stride)]

    calls = [
        (torch.bmm if batched else torch.mm, operand(a_shape, a_stride), operand(b_shape, b_stride))
        for batched, a_shape, a_stride, b_shape, b_stride in operands
    ]

    def step():
        with torch.inference_mode():
            for matmul, a, b in calls:
                matmul(a, b)

    return step


def time_interleaved(
    steps: dict[str, Callable[[], object]], repeats: int, device: str, warm_up: bool = True
) -> dict[str, float]:
    """Best time of each step over `repeats` rounds, the order reversed every other round so no step always goes
    first; with `warm_up`, each step runs once before (a compiled step must already have compiled)."""
    for step in steps.values() if warm_up else ():
        step()
    times = {key: [] for key in steps}
    for repeat in range(repeats):
        for key in list(steps) if repeat % 2 == 0 else reversed(list(steps)):
            times[key].append(seconds(steps[key], device))
    return {key: min(values) for key, values in times.items()}


@dataclass
class Row:
    """One model in one mode, precision and pass."""

    model: str
    family: str
    params: int
    batch_size: int
    precision: str
    mode: str
    pass_: str
    images_per_second: float
    gflops: float
    gemm_gflops: float
    compile_seconds: float
    baseline_images_per_second: dict = field(default_factory=dict)  # U-ViT's mode -> images/s in the same window
    reference_images_per_second: dict = field(default_factory=dict)  # F2-deep's mode -> images/s in the same window

    @property
    def of_gemm(self) -> float:
        return self.gflops / self.gemm_gflops


def measure_model(
    name: str, args: argparse.Namespace, precision: str, references: dict[str, dict]
) -> tuple[list[Row], dict]:
    """Time one model in every mode and pass, interleaved with the steps of the models measured before it.

    Args:
        name (`str`): The named config to time.
        args (`argparse.Namespace`): The command line (batch size, modes, repeats, device).
        precision (`str`): `"fp32"` or `"bf16"`.
        references (`dict`): Model name -> pass -> mode -> step, timed in the same window: U-ViT-S/2's best and
            eager modes (`BASELINE`) and F2-deep's (`REFERENCE`), once each has been measured.

    Returns:
        The rows, and this model's steps (pass -> mode -> step).
    """
    model = build(name, args.num_layers, args.device)
    family = family_of(model).label
    params = sum(p.numel() for p in model.parameters())
    rows, own_steps = [], {}
    for pass_ in PASSES:
        modes = [mode for mode in args.modes if pass_ == "sampling" or mode not in SAMPLING_ONLY_MODES]
        if not modes:  # `--modes frozen`: no training pass, and no GEMM reference to time for one
            continue
        rows_in_step = args.batch_size * (2 if pass_ == "sampling" else 1)
        steps, compile_seconds = {}, {}
        for mode in modes:
            runner = make_runner(model, mode)
            data = inputs(model.config, args.batch_size, args.device)
            step = (
                sampling_step(runner, data, args.device, precision)
                if pass_ == "sampling"
                else training_step(runner, runner if mode == "regional" else model, data, args.device, precision)
            )
            compile_seconds[mode] = seconds(step, args.device)  # the first call compiles
            steps[mode] = step
        flops, operands = meta_pass(name, args.num_layers, rows_in_step, train=pass_ == "training")
        gemm = gemm_step(operands, args.device, precision)
        window = dict(steps)
        window["GEMM"] = gemm
        beside = {label: by_pass.get(pass_, {}) for label, by_pass in references.items()}  # label -> mode -> step
        for label, by_mode in beside.items():
            window.update({f"{label} {mode}": step for mode, step in by_mode.items()})
        best = time_interleaved(window, args.repeats, args.device)
        rates = {
            label: {mode: args.batch_size / best[f"{label} {mode}"] for mode in by_mode}
            for label, by_mode in beside.items()
        }
        for mode in steps:
            images = args.batch_size / best[mode]
            rows.append(
                Row(
                    name,
                    family,
                    params,
                    args.batch_size,
                    precision,
                    mode,
                    pass_,
                    images,
                    flops / best[mode] / 1e9,
                    flops / best["GEMM"] / 1e9,
                    compile_seconds[mode],
                    rates.get(BASELINE, {}),
                    rates.get(REFERENCE, {}),
                )
            )
            print(format_row(rows[-1]), flush=True)
        own_steps[pass_] = steps
    return rows, own_steps


def reference_steps(rows: list[Row], steps: dict) -> dict[str, dict]:
    """What of a reference model (U-ViT-S/2, F2-deep) is timed beside every later model: pass -> its best mode's step
    and its eager step (eager against eager)."""
    return {
        row.pass_: {mode: steps[row.pass_][mode] for mode in {row.mode} | ({"eager"} & set(steps[row.pass_]))}
        for row in best_rows(rows).values()
    }


def best_rows(rows: Iterable[Row]) -> dict[tuple[str, str, str], Row]:
    """(model, batch, precision, pass) -> the fastest mode's row."""
    best: dict[tuple, Row] = {}
    for row in rows:
        key = (row.model, row.batch_size, row.precision, row.pass_)
        if key not in best or row.images_per_second > best[key].images_per_second:
            best[key] = row
    return best


def speedup(row: Row, rows: list[Row]) -> float | None:
    """The row's images/s over the baseline's, both in their best modes, timed in the same window as `row`."""
    if row.model == BASELINE:
        return 1.0
    if not row.baseline_images_per_second:
        return None
    return row.images_per_second / max(row.baseline_images_per_second.values())


def format_row(row: Row, ratio: float | None = None) -> str:
    cells = [row.model, row.family, f"{row.params / 1e6:.1f}M", str(row.batch_size), row.precision, row.pass_]
    cells += [row.mode, f"{row.images_per_second:.2f}", f"{row.gflops:.0f}", f"{row.of_gemm:.0%}"]
    cells.append(f"{row.compile_seconds:.0f}")
    if ratio is not None:
        cells.append(f"{ratio:.2f}×")
    return "| " + " | ".join(cells) + " |"


THROUGHPUT_HEADER = ("model", "family", "params", "B", "precision", "pass", "mode", "images/s", "GFLOP/s")
THROUGHPUT_HEADER += ("of GEMM", "first call s", "vs U-ViT (best modes)")


def throughput_table(rows: list[Row]) -> str:
    lines, best = [], best_rows(rows)
    for row in rows:
        is_best = best[(row.model, row.batch_size, row.precision, row.pass_)] is row
        ratio = speedup(row, rows) if is_best else None
        line = format_row(row, ratio)
        if ratio is None:
            line += "  |"
        if is_best:
            line = line.replace(f"| {row.mode} |", f"| **{row.mode}** |", 1)
        lines.append(line)
    return markdown(THROUGHPUT_HEADER, lines)


def reference_time_ratio(row: Row, rows: list[Row]) -> float | None:
    """The row's time over F2-deep's, both in their best modes and timed in the same window: F2-deep's steps run
    beside every later model's, and U-ViT's beside F2-deep's. `None` when F2-deep was not measured."""
    if row.model == REFERENCE:
        return 1.0
    if row.model == BASELINE:
        reference = best_rows(rows).get((REFERENCE, row.batch_size, row.precision, row.pass_))
        return speedup(reference, rows) if reference else None
    if not row.reference_images_per_second:
        return None
    return max(row.reference_images_per_second.values()) / row.images_per_second


def eager_time_ratio(row: Row, rows: list[Row]) -> float | None:
    """An eager row's time over F2-deep's eager time, timed in the same window (U-ViT's: F2-deep's eager speed-up
    over it, from F2-deep's window). `None` when F2-deep's eager mode was not measured."""
    if row.model == REFERENCE:
        return 1.0
    if row.model == BASELINE:
        key = (REFERENCE, row.batch_size, row.precision, row.pass_, "eager")
        reference = next((r for r in rows if (r.model, r.batch_size, r.precision, r.pass_, r.mode) == key), None)
        baseline = reference.baseline_images_per_second.get("eager") if reference else None
        return reference.images_per_second / baseline if baseline else None
    reference = row.reference_images_per_second.get("eager")
    return reference / row.images_per_second if reference else None


def summary_table(rows: list[Row]) -> str:
    """Best mode per model: sampling and training speed over U-ViT-S/2's (best modes against best modes, and eager
    against eager), and the time over F2-deep's (best modes against best modes, and eager against eager; same
    window)."""
    header = ("model", "B", "precision", "sampling: best mode", "× U-ViT", "training: best mode", "× U-ViT")
    header += ("eager × U-ViT (sampling / training)", "time ÷ F2-deep's (sampling / training)")
    header += ("eager time ÷ F2-deep's (sampling / training)",)
    lines, best = [], best_rows(rows)
    modes = {(r.model, r.batch_size, r.precision, r.pass_, r.mode): r for r in rows}
    for model, batch_size, precision in dict.fromkeys((row.model, row.batch_size, row.precision) for row in rows):
        cells, eager, reference, eager_reference = [model, str(batch_size), precision], [], [], []
        for pass_ in PASSES:
            row = best.get((model, batch_size, precision, pass_))
            ratio = speedup(row, rows) if row else None
            cells += [row.mode if row else "–", f"{ratio:.2f}×" if ratio else "–"]
            eager_row = modes.get((model, batch_size, precision, pass_, "eager"))
            if model == BASELINE and eager_row:
                eager.append("1.00×")
            elif eager_row and "eager" in eager_row.baseline_images_per_second:
                eager.append(f"{eager_row.images_per_second / eager_row.baseline_images_per_second['eager']:.2f}×")
            time_ratio = reference_time_ratio(row, rows) if row else None
            if time_ratio:
                reference.append(f"{time_ratio:.2f}×")
            eager_ratio = eager_time_ratio(eager_row, rows) if eager_row else None
            if eager_ratio:
                eager_reference.append(f"{eager_ratio:.2f}×")
        cells += [" / ".join(eager) or "–", " / ".join(reference) or "–", " / ".join(eager_reference) or "–"]
        lines.append("| " + " | ".join(cells) + " |")
    return markdown(header, lines)


# The Stable Diffusion KL-f8 VAE both papers decode with (`stabilityai/sd-vae-ft-ema`), randomly initialised here:
# only its cost matters, and no weights can be downloaded on an offline machine.
SD_VAE_CONFIG = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    block_out_channels=(128, 256, 512, 512),
    layers_per_block=2,
    latent_channels=4,
    sample_size=256,
    scaling_factor=0.23010,
)


def measure_pipeline(name: str, mode: str, args: argparse.Namespace) -> dict:
    """Wall time of `LMLPPipeline(...)` for `--pipeline_steps` steps against its parts timed alone: that many CFG
    forwards of the backbone (2·B images each) plus one VAE decode of B latents. fp32, best of `--repeats` rounds
    each."""
    from diffusers import AutoencoderKL

    from diffusers_lmlp import LMLPPipeline, default_scheduler

    model = build(name, args.num_layers, args.device).eval()
    frozen = mode == "frozen"  # the pipeline's own switch, fingerprint of the weights included
    runner = model if frozen else make_runner(model, mode)
    torch.manual_seed(0)
    vae = AutoencoderKL(**SD_VAE_CONFIG).to(args.device).eval()
    pipe = LMLPPipeline(vae=vae, text_encoder=None, tokenizer=None, transformer=runner, scheduler=default_scheduler())
    pipe.set_progress_bar_config(disable=True)
    if frozen:
        pipe.enable_inductor_freezing()
    batch = args.pipeline_batch_size
    data = inputs(model.config, batch, args.device)
    prompt_embeds, negative_embeds = 0.5 * data["text"], 0.5 * data["text"].roll(1, 0)
    latents = data["latents"] / vae.config.scaling_factor

    def pipeline(steps: int = args.pipeline_steps):
        return pipe(
            prompt_embeds=prompt_embeds,
            negative_prompt_embeds=negative_embeds,
            num_inference_steps=steps,
            generator=torch.Generator(args.device).manual_seed(0),
            output_type="np",
        )

    def parts():
        for _ in range(args.pipeline_steps):
            forward()
        with torch.inference_mode():
            vae.decode(latents)

    pipeline(2)  # compiles the backbone and warms the VAE, in 2 steps however many are timed
    # The parts run the pipeline's own frozen graph, compiled by the call above.
    forward = sampling_step(
        pipe._inductor_freezing.for_sampling(model) if frozen else runner, data, args.device, "fp32"
    )
    forward()
    best = time_interleaved({"pipeline": pipeline, "parts": parts}, args.repeats, args.device, warm_up=False)
    pipeline_seconds, parts_seconds = best["pipeline"], best["parts"]
    result = {
        "model": name,
        "mode": mode,
        "batch_size": batch,
        "steps": args.pipeline_steps,
        "pipeline_s": pipeline_seconds,
        "parts_s": parts_seconds,
        "ratio": pipeline_seconds / parts_seconds,
    }
    print(pipeline_row(result), flush=True)
    return result


PIPELINE_HEADER = ("model", "backbone mode", "images", "steps", "pipeline s", "forwards + decode s")
PIPELINE_HEADER += ("pipeline / parts",)


def pipeline_row(result: dict) -> str:
    cells = [result["model"], result["mode"], str(result["batch_size"]), str(result["steps"])]
    cells += [f"{result['pipeline_s']:.1f}", f"{result['parts_s']:.1f}", f"{result['ratio']:.3f}"]
    return "| " + " | ".join(cells) + " |"


def _peak_rss_kib() -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmHWM")).split()[1])


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS")).split()[1])


def training_step_memory(name: str, num_layers: int | None, batch_size: int, checkpointing: bool, device: str) -> int:
    """Bytes a training step needs above the model and its optimizer state (activations, gradients, temporaries).

    CUDA: the rise of `max_memory_allocated` during a step. CPU: the rise of the process's peak resident memory
    (Linux; the peak is reset through /proc/self/clear_refs), which is exact only when every large buffer is its own
    mapping, so call it in a fresh process started with `MALLOC_MMAP_THRESHOLD_=65536` (`memory_in_fresh_process`).
    """
    model = build(name, num_layers, device)
    if checkpointing:
        model.enable_gradient_checkpointing()
    data = inputs(model.config, batch_size, device)
    step = training_step(model, model, data, device, "fp32")
    step()  # allocates the optimizer state
    for parameter in model.parameters():
        parameter.grad = None  # the base: parameters and optimizer state only
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak resident size to the current one
    base = _rss_kib()
    step()
    return (_peak_rss_kib() - base) * 1024


def memory_in_fresh_process(name: str, num_layers: int | None, batch_size: int) -> tuple[int, int]:
    """`training_step_memory` on CPU, without and then with gradient checkpointing, in a fresh Python whose allocator
    maps every buffer of 64 KiB or more on its own, so that freeing it lowers the resident size and each peak is its
    step's: the first step's buffers are unmapped when its model is dropped, before the second step's peak is reset."""
    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parent)!r}); import speed_vs_uvit; "
        f"print(*(speed_vs_uvit.training_step_memory({name!r}, {num_layers!r}, {batch_size}, checkpointing, 'cpu') "
        "for checkpointing in (False, True)))"
    )
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    if result.returncode:
        raise RuntimeError(f"the memory probe of {name} failed:\n{result.stderr[-2000:]}")
    plain, checkpointing = result.stdout.split()[-2:]
    return int(plain), int(checkpointing)


def largest_batch(fits: Callable[[int], bool], start: int = 32, limit: int = 8192) -> int:
    """The largest batch for which `fits(batch)` holds: doubling from `start`, then bisecting (0 if none fits)."""
    if not fits(start):
        low, high = 0, start
    else:
        low = start
        while low * 2 <= limit and fits(low * 2):
            low *= 2
        high = min(low * 2, limit + 1)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def cuda_training_fits(name: str, num_layers: int | None, checkpointing: bool) -> Callable[[int], bool]:
    """Whether a bf16-autocast training step at a batch size fits on the GPU."""

    def fits(batch_size: int) -> bool:
        try:
            model = build(name, num_layers, "cuda")
            if checkpointing:
                model.enable_gradient_checkpointing()
            training_step(model, model, inputs(model.config, batch_size, "cuda"), "cuda", "bf16")()
            torch.cuda.synchronize()
            return True
        except torch.OutOfMemoryError:
            return False
        finally:
            model = None
            torch.cuda.empty_cache()

    return fits


def measure_memory(args: argparse.Namespace) -> list[dict]:
    results = []
    for name in args.memory_models:
        result = {"model": name, "batch_size": args.batch_size}
        if args.device == "cpu":
            result["bytes"], result["checkpointing_bytes"] = memory_in_fresh_process(
                name, args.num_layers, args.batch_size
            )
        else:
            for checkpointing in (False, True):
                key = "checkpointing_bytes" if checkpointing else "bytes"
                result[key] = training_step_memory(name, args.num_layers, args.batch_size, checkpointing, "cuda")
                torch.cuda.empty_cache()
                fits = cuda_training_fits(name, args.num_layers, checkpointing)
                result["largest_batch_checkpointing" if checkpointing else "largest_batch"] = largest_batch(fits)
        results.append(result)
        print(memory_row(result), flush=True)
    return results


def memory_header(device: str) -> tuple[str, ...]:
    header = ("model", "B", "training step MiB", "with checkpointing MiB", "saved")
    return header + (("largest batch (bf16)", "with checkpointing") if device == "cuda" else ())


def memory_row(result: dict) -> str:
    plain, checkpointed = result["bytes"], result["checkpointing_bytes"]
    cells = [result["model"], str(result["batch_size"]), f"{plain / 2**20:.0f}", f"{checkpointed / 2**20:.0f}"]
    cells.append(f"{1 - checkpointed / plain:.0%}" if plain > 0 else "–")
    if "largest_batch" in result:
        cells += [str(result["largest_batch"]), str(result["largest_batch_checkpointing"])]
    return "| " + " | ".join(cells) + " |"


def gpu_peak_tflops(gemm_tflops: float) -> tuple[float, str]:
    """The GPU's dense bf16 peak from its name, or the measured bf16 GEMM rate when the GPU is not listed."""
    name = torch.cuda.get_device_name()
    for key, peak in GPU_BF16_PEAK_TFLOPS.items():
        if key in name:
            return peak, f"{name}: dense bf16 peak {peak:.0f} TFLOP/s"
    return gemm_tflops, f"{name}: not in GPU_BF16_PEAK_TFLOPS; MFU against a measured bf16 GEMM ({gemm_tflops:.0f})"


def markdown(header: Iterable[str], lines: Iterable[str]) -> str:
    header = tuple(header)
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *lines])


def draw_plot(rows: list[Row], title: str) -> Image.Image:
    """Horizontal bars per model: sampling and training speed over U-ViT-S/2 (best modes), a line at 1×."""
    best = best_rows(rows)
    keys = list(dict.fromkeys((row.model, row.batch_size, row.precision) for row in rows))
    series = {
        pass_: [speedup(best[(*key, pass_)], rows) if (*key, pass_) in best else None for key in keys]
        for pass_ in PASSES
    }
    labels = [f"{model} ({precision}, B={batch_size})" for model, batch_size, precision in keys]
    return bar_chart(title, labels, [("images/s over U-ViT-S/2's (best modes)", series, ".2f")], reference=1.0)


def machine_line(device: str) -> str:
    where = torch.cuda.get_device_name() if device == "cuda" else f"{torch.get_num_threads()} CPU threads"
    return f"torch {torch.__version__}, {where}, {platform.machine()}, CPU: {this_cpu().describe()}"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    # One process compiles every model, in two passes, with and without long skips, and families share block code
    # (the MoE-MLP block runs the L-MLP block's forward): more variants of one function than dynamo's default cache
    # of 8, past which it would silently run the rest eagerly.
    torch._dynamo.config.recompile_limit = 64
    if args.reuse_freed_memory and not reuse_freed_memory():
        print("--reuse_freed_memory: no glibc here; the allocator is unchanged")
    print(machine_line(args.device) + "\n", flush=True)
    print("| " + " | ".join(THROUGHPUT_HEADER[:-1]) + " |", flush=True)
    rows: list[Row] = []
    batch_sizes = args.gpu_batch_sizes if args.device == "cuda" else [args.batch_size]
    memory_batch_size = args.batch_size  # the memory section's B, also on a GPU
    best_sampling_mode = {}
    for batch_size in batch_sizes:
        args.batch_size = batch_size
        for precision in args.precisions:
            references: dict[str, dict] = {}  # model -> pass -> mode -> step, timed beside every later model
            for name in args.models:
                model_rows, steps = measure_model(name, args, precision, references)
                rows += model_rows
                if name in (BASELINE, REFERENCE):
                    references[name] = reference_steps(model_rows, steps)
            del references, steps  # free the compiled copies and optimiser states before anything else is measured
    for (model, _, precision, pass_), row in best_rows(rows).items():
        if precision == "fp32" and pass_ == "sampling":
            best_sampling_mode[model] = row.mode

    report = [
        machine_line(args.device),
        "",
        "## Best mode per model",
        "",
        summary_table(rows),
        "",
        "## Every mode",
        "",
    ]
    report += [throughput_table(rows), ""]
    if args.device == "cuda":
        gemm_rows = [r for r in rows if r.precision == "bf16"]
        peak, source = gpu_peak_tflops(max((r.gemm_gflops for r in gemm_rows), default=0.0) / 1e3)
        mfu = [
            f"| {r.model} | {r.batch_size} | {r.pass_} | {r.mode} | {r.images_per_second:.0f} | "
            f"{r.gflops / 1e3 / peak:.1%} |"
            for r in gemm_rows
        ]
        report += ["## bf16 MFU", "", source, "", markdown(("model", "B", "pass", "mode", "images/s", "MFU"), mfu), ""]

    pipeline_results = []
    if args.pipeline_models:
        print("\n" + markdown(PIPELINE_HEADER, []), flush=True)
        for name in args.pipeline_models:
            pipeline_results.append(measure_pipeline(name, best_sampling_mode.get(name, "eager"), args))
        report += ["## The pipeline against its parts (fp32)", ""]
        report += [markdown(PIPELINE_HEADER, map(pipeline_row, pipeline_results)), ""]

    memory_results = []
    args.batch_size = memory_batch_size
    if args.memory_models:
        print("\n" + markdown(memory_header(args.device), []), flush=True)
        memory_results = measure_memory(args)
        report += ["## Memory of a training step (fp32, eager)", ""]
        report += [markdown(memory_header(args.device), map(memory_row, memory_results)), ""]

    text = "\n".join(report)
    (args.output_dir / "results.md").write_text(text + "\n")
    (args.output_dir / "results.json").write_text(
        json.dumps(
            {
                "machine": machine_line(args.device),
                "rows": [asdict(r) for r in rows],
                "pipeline": pipeline_results,
                "memory": memory_results,
            },
            indent=2,
        )
        + "\n"
    )
    draw_plot(rows, f"Speed over U-ViT-S/2, {machine_line(args.device)}").save(args.output_dir / "speed.png")
    print("\n" + text)
    print(f"\nWrote {args.output_dir / 'results.md'}, results.json and speed.png")


if __name__ == "__main__":
    main()
