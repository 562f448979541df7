"""The precision a training run computes in: `--mixed_precision auto` (the shapes preset's) picks bf16 autocast where
the hardware runs bf16 natively and float32 elsewhere, and the log says which and why.

On a CPU, native bf16 means `avx512_bf16` or AMX (`diffusers_lmlp.cpu`); elsewhere torch emulates bf16, much slower.
"""

import argparse
import os

import torch
from accelerate import Accelerator

from ..cpu import this_cpu


def choose_precision(requested: str | None) -> tuple[str | None, str]:
    """The `mixed_precision` for the `Accelerator` (None keeps accelerate's) for `--mixed_precision` `requested`, and
    the reason as " (…)" to append to the log line, or ""."""
    if requested != "auto":
        return requested, ""
    launched = os.environ.get("ACCELERATE_MIXED_PRECISION")  # `accelerate launch --mixed_precision` or its config
    if launched not in (None, "no"):
        return None, f" (auto: the launch's {launched} is kept)"
    if launch_device() == "cuda":
        if torch.cuda.is_bf16_supported():
            return "bf16", f" (auto: {torch.cuda.get_device_name()} runs bf16 natively)"
        return "no", f" (auto: {torch.cuda.get_device_name()} has no native bf16)"
    cpu = this_cpu()
    if cpu.native_bf16:
        return "bf16", f" (auto: the CPU has native bf16, {cpu.native_bf16}: {cpu.describe()})"
    return "no", f" (auto: float32, the CPU has no native bf16 (avx512_bf16 or AMX): {cpu.describe()})"


def launch_device() -> str:
    """The device type the run's `Accelerator` will train on, before it is built: "cuda" or "cpu"."""
    use_cpu = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")
    return "cuda" if torch.cuda.is_available() and not use_cpu else "cpu"


def effective_precision(accelerator: Accelerator, args: argparse.Namespace) -> str:
    """The precision the run trains in, in words for the log.

    accelerate accepts fp16 on a CPU, then trains in float32 while reporting fp16: a preset's fp16 is taken as float32
    and said so, an fp16 the user asked for is refused.
    """
    precision = accelerator.mixed_precision
    if precision != "fp16" or accelerator.device.type != "cpu":
        return precision
    if args.mixed_precision == "fp16" and args.mixed_precision_from_preset:
        return (
            f"float32: the {args.preset} preset's fp16 needs a GPU (--mixed_precision bf16 runs bf16 autocast on a CPU "
            "with native bf16: avx512_bf16 or AMX)"
        )
    raise SystemExit(
        "error: fp16 mixed precision needs a GPU, and this run is on the CPU, where accelerate would train in float32 "
        "while reporting fp16. Pass --mixed_precision no, or bf16 on a CPU with native bf16 (avx512_bf16 or AMX)."
    )
