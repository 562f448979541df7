"""What one training step of a shapes-world backbone costs, in float32 and in bf16 autocast, eager and under
torch.compile: the throughput levers of the main job (`--mixed_precision auto`).

A step is what the trainer does with a batch: the backbone's forward on noisy latents and text states, an MSE loss,
backward and an AdamW step. The timings are the median of `--steps` steps after `--warmup` (compilation happens in the
warm-up, whose time is printed too). Ratios are against eager float32 in the same run.

    python benchmarks/training_step.py                         # the shipped UL-MLP, batch 64
    python benchmarks/training_step.py --family moe_mlp --config shapes-moe-S
"""

import argparse
import contextlib
import statistics
import time

import torch

from diffusers_lmlp import FAMILIES
from diffusers_lmlp.cpu import this_cpu


MODES = ("fp32", "bf16", "compile-fp32", "compile-bf16")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="lmlp", help="the block family (diffusers_lmlp.FAMILIES)")
    parser.add_argument("--config", default="shapes-S", help="its named configuration")
    parser.add_argument("--batch_size", type=int, default=64, help="samples per step (the shapes preset's 64)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="what to time")
    parser.add_argument("--warmup", type=int, default=3, help="steps before timing (compilation happens here)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps")
    return parser.parse_args(argv)


def time_mode(args: argparse.Namespace, mode: str) -> tuple[float, float]:
    """(warm-up seconds, median seconds per step) of one mode, from the same initial weights and batch."""
    torch.manual_seed(0)
    model = FAMILIES[args.family].model_class.from_named_config(args.config)
    config = model.config
    latents = torch.randn(args.batch_size, config.in_channels, config.sample_size, config.sample_size)
    text = torch.randn(args.batch_size, config.text_seq_len, config.text_embed_dim)
    timesteps = torch.randint(0, 1000, (args.batch_size,))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    forward = torch.compile(model) if mode.startswith("compile") else model
    bf16 = mode.endswith("bf16")

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
            prediction = forward(latents, text, timesteps, return_dict=False)[0]
        loss = torch.nn.functional.mse_loss(prediction.float(), latents)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    started = time.perf_counter()
    for _ in range(args.warmup):
        step()
    warmup = time.perf_counter() - started
    seconds = []
    for _ in range(args.steps):
        started = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - started)
    return warmup, statistics.median(seconds)


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


if __name__ == "__main__":
    main()
