"""What one training step of a shapes-world backbone costs, in float32 and in bf16 autocast, eager and under
torch.compile: the throughput levers of the main job (`--mixed_precision auto`).

A step is what the trainer does with a batch: the backbone's forward on noisy latents and text states, an MSE loss,
backward and an AdamW step with the trainer's kernel (torch's fused one on the CPU and CUDA). The timings are the
median of `--steps` steps after `--warmup` (compilation happens in the warm-up, whose time is printed too). Ratios
are against eager float32 in the same run.

A second table times the optimizer and the EMA alone, on the model's weights with random gradients: torch's default
AdamW against the fused one the trainer uses on the CPU and CUDA (`diffusers_lmlp.training.step`), and
diffusers' EMA, its per-tensor loop against its `foreach` update (the trainer's).

    python benchmarks/training_step.py                         # the shipped UL-MLP, batch 64
    python benchmarks/training_step.py --family moe_mlp --config shapes-moe-S

The model is the named configuration with the shapes preset's model options (its projection of the caption), built
by the trainer's own `diffusers_lmlp.training.components.build_model`, as the main job trains it.
"""

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable

import torch
from diffusers.training_utils import EMAModel

from diffusers_lmlp.cpu import this_cpu
from diffusers_lmlp.training.arguments import parse_args as training_args
from diffusers_lmlp.training.components import build_model
from diffusers_lmlp.training.step import fused_adamw


MODES = ("fp32", "bf16", "compile-fp32", "compile-bf16")


def shapes_model(args: argparse.Namespace) -> torch.nn.Module:
    """The backbone `--family` / `--config` as the main job builds it: the trainer's own `build_model`, with the
    shapes preset's model options (nothing is written; `--output_dir` is only parsed)."""
    trainer_args = training_args(
        ["--output_dir", "unused", "--model_type", args.family, "--model_config", args.config]
    )
    return build_model(trainer_args.model_type, trainer_args.model_config, trainer_args.model_overrides)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="lmlp", help="the block family (diffusers_lmlp.FAMILIES)")
    parser.add_argument("--config", default="shapes-S", help="its named configuration")
    parser.add_argument("--batch_size", type=int, default=64, help="samples per step (the shapes preset's 64)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="what to time")
    parser.add_argument("--warmup", type=int, default=3, help="steps before timing (compilation happens here)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps")
    return parser.parse_args(argv)


def bare_step(model: torch.nn.Module, batch_size: int, mode: str) -> Callable[[], None]:
    """One bare training step of `model` in one mode: forward, MSE, backward and an AdamW step with the trainer's
    kernel (`diffusers_lmlp.training.step.fused_adamw`: fused on the CPU and CUDA) on a fixed random batch, on the
    model's device.

    Args:
        model (`torch.nn.Module`): A backbone (`diffusers_lmlp.FAMILIES`' model classes), trained in place.
        batch_size (`int`): Samples per step.
        mode (`str`): One of `MODES`.
    """
    config, device = model.config, next(model.parameters()).device
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(batch_size, config.in_channels, config.sample_size, config.sample_size, generator=generator)
    text = torch.randn(batch_size, config.text_seq_len, config.text_embed_dim, generator=generator)
    timesteps = torch.randint(0, 1000, (batch_size,), generator=generator)
    latents, text = latents.to(device), text.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused_adamw(device))
    forward = torch.compile(model) if mode.startswith("compile") else model
    bf16 = mode.endswith("bf16")

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
            prediction = forward(latents, text, timesteps, return_dict=False)[0]
        loss = torch.nn.functional.mse_loss(prediction.float(), latents)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def timed(step: Callable[[], object], steps: int, warmup: int = 2) -> tuple[float, float]:
    """(seconds of the `warmup` calls, median seconds of the `steps` calls after them) of `step()`."""
    started = time.perf_counter()
    for _ in range(warmup):
        step()
    warmed_up = time.perf_counter() - started
    seconds = []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - started)
    return warmed_up, statistics.median(seconds)


def time_mode(args: argparse.Namespace, mode: str) -> tuple[float, float]:
    """(warm-up seconds, median seconds per step) of one mode, from the same initial weights and batch."""
    torch.manual_seed(0)  # the same initial weights in every mode
    return timed(bare_step(shapes_model(args), args.batch_size, mode), args.steps, args.warmup)


def time_updates(args: argparse.Namespace) -> dict[str, float]:
    """Median seconds per step of AdamW (torch's default and fused) and of the EMA (diffusers' per-tensor loop and
    foreach update, the trainer's)."""
    torch.manual_seed(0)
    model = shapes_model(args)
    for parameter in model.parameters():
        parameter.grad = torch.randn_like(parameter)
    times = {}
    for label, fused in (("AdamW, torch's default", None), ("AdamW, fused (the trainer's)", True)):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=fused)
        times[label] = timed(optimizer.step, args.steps)[1]
    emas = {
        "EMA, diffusers' per-tensor loop": EMAModel(model.parameters(), decay=0.999, foreach=False),
        "EMA, diffusers' foreach (the trainer's)": EMAModel(model.parameters(), decay=0.999, foreach=True),
    }
    for label, ema in emas.items():
        times[label] = timed(lambda: ema.step(model.parameters()), args.steps)[1]
    return times


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print(f"{args.family} {args.config}, batch {args.batch_size}; torch {torch.__version__}, {torch.get_num_threads()} "
          f"threads; CPU: {this_cpu().describe()}")  # fmt: skip
    print("\n| mode | warm-up (s) | step (ms) | speed vs fp32 |\n|---|---:|---:|---:|")
    base = None
    for mode in args.modes:
        warmup, step = time_mode(args, mode)
        base = base or (step if mode == "fp32" else None)
        ratio = f"{base / step:.2f}×" if base else "—"
        print(f"| {mode} | {warmup:.1f} | {step * 1000:.1f} | {ratio} |", flush=True)
    tensors = sum(1 for _ in shapes_model(args).parameters())
    print(f"\nThe optimizer and the EMA alone ({tensors} weight tensors):\n\n| update | ms per step |\n|---|---:|")
    for label, seconds in time_updates(args).items():
        print(f"| {label} | {seconds * 1000:.2f} |", flush=True)


if __name__ == "__main__":
    main()
