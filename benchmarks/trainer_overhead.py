"""The trainer's steps/s against a bare training step of the same model, batch, precision and compilation.

It runs the training command in this process (the shapes preset unless trainer options say otherwise, with its
validations and checkpoints spaced past the run) and times, after `--skip` warm-up steps:

- the trainer's loop: each step's batch from the feature cache, the step (noise, forward, loss, backward, gradient
  norm, AdamW, EMA) and its logging (every `--logging_steps`), from one step's end to the next's;
- the trainer's step function alone (`diffusers_lmlp.training.step.training_step`), and its parts where the trainer
  calls them (the noise, forward and loss, backward, gradient norm, AdamW, EMA, ...; `STEP_PARTS`), with the logging
  between steps;
- a bare step (`benchmarks/training_step.py`): forward, MSE, backward and AdamW with the trainer's own kernel
  (fused on the CPU and CUDA) on a fixed batch, built in the precision and compilation the trainer chose. Every
  `--every` trainer steps the bare step runs `--bare_steps` times, so both are timed in the same window.

The last column is each one's steps/s over the bare step's; the project's goal for the trainer's loop is ≥ 90%.
Options this script does not know go to the trainer (`--torch_compile yes` compiles as the preset's `auto` does for
runs of 1,000 steps or more, such as the main command's 10,400):

    python benchmarks/trainer_overhead.py --torch_compile yes          # the main command's preset, 800 steps
    python benchmarks/trainer_overhead.py --max_train_steps 400 --train_batch_size 32

It imports the bare step from `training_step.py` beside it (a script's folder is on its import path).
"""

import argparse
import copy
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from accelerate import Accelerator
from training_step import bare_step

import diffusers_lmlp.training.step as step_module
import diffusers_lmlp.training.trainer as trainer
from diffusers_lmlp.commands import number
from diffusers_lmlp.cpu import this_cpu
from diffusers_lmlp.train import main as train_main


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """This script's options, and the rest: the trainer's own options."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max_train_steps", type=number(int, 1), default=800, help="the trainer's steps")
    parser.add_argument("--skip", type=int, default=100, help="warm-up steps left out of the timing (compilation)")
    parser.add_argument(
        "--every", type=number(int, 1), default=50, help="trainer steps between two bursts of bare steps"
    )
    parser.add_argument("--bare_steps", type=number(int, 1), default=5, help="bare steps per burst")
    args, trainer_argv = parser.parse_known_args(argv)
    if not 0 <= args.skip < args.max_train_steps - args.every:
        parser.error(
            f"--skip {args.skip} leaves no timed window in --max_train_steps {args.max_train_steps} "
            f"(at least --every {args.every} steps after it): raise the steps or lower --skip"
        )
    return args, trainer_argv


def bare_mode(accelerator, model: torch.nn.Module) -> str:
    """The mode of `training_step.MODES` that matches how the trainer runs its model: bf16 under bf16 mixed
    precision, else fp32, and compiled when accelerate wrapped the model in torch.compile's `OptimizedModule`.

    Args:
        accelerator (`Accelerator`): The run's accelerator.
        model (`torch.nn.Module`): The prepared model the trainer steps.
    """
    precision = "bf16" if accelerator.mixed_precision == "bf16" else "fp32"
    return f"compile-{precision}" if hasattr(model, "_orig_mod") else precision


# What the trainer's step and loop do, each timed where the trainer calls it: (owner, attribute, label). The owners
# are patched for the run and restored after; the optimizer and scheduler, made by the run, are patched on the
# instance at the first step (`INSTANCE_PARTS`, on the `training_step` arguments at these positions).
STEP_PARTS = (
    (step_module, "draw_noise", "noise and timesteps"),
    (step_module, "diffusion_loss", "forward and loss"),
    (Accelerator, "backward", "backward"),
    (step_module, "gradient_norm", "gradient norm (clipped only with --max_grad_norm)"),
    (step_module, "check_finite", "finite check of the loss and norm"),
    (step_module, "update_ema", "EMA"),
    (Accelerator, "log", "logging (`accelerator.log` every --logging_steps, between steps)"),
)
INSTANCE_PARTS = ((0, "step", "AdamW"), (0, "zero_grad", "zero_grad"), (1, "step", "learning-rate schedule"))


class Timer:
    """Stands in for `training_step` where the trainer calls it: times each call, the loop between calls, and bursts
    of a bare step built at the first call to match the trainer's model (a copy of it: same configuration and batch,
    same precision, compiled if the trainer compiled it)."""

    def __init__(self, args: argparse.Namespace, step_function: Callable):
        self.args, self.step_function = args, step_function
        self.calls = 0
        self.step_seconds: list[float] = []
        self.between_seconds: list[float] = []  # from one step's end to the next's start: the batch, the logging
        self.bare_seconds: list[float] = []
        self.last_end: float | None = None
        self.bare: Callable[[], None] | None = None
        self.bare_mode = ""
        self.timed = False
        self.part_seconds: dict[str, list[float]] = {}
        self.patched: list[tuple[object, str, object]] = []

    def timing(self, label: str, function: Callable) -> Callable:
        """`function`, recording its seconds under `label` while the window is timed."""
        seconds = self.part_seconds.setdefault(label, [])

        def timed(*args, **kwargs):
            started = time.perf_counter()
            result = function(*args, **kwargs)
            if self.timed:
                seconds.append(time.perf_counter() - started)
            return result

        return timed

    def patch(self, owner: object, name: str, label: str) -> None:
        """Time `owner.name` under `label`, until `restore`."""
        self.patched.append((owner, name, owner.__dict__.get(name)))
        setattr(owner, name, self.timing(label, getattr(owner, name)))

    def restore(self) -> None:
        for owner, name, original in reversed(self.patched):
            if original is None:
                delattr(owner, name)  # an instance's patch: the class's method shows through again
            else:
                setattr(owner, name, original)
        self.patched.clear()

    def build_bare(self, accelerator, model: torch.nn.Module, latents: torch.Tensor) -> None:
        plain = copy.deepcopy(trainer.plain_backbone(accelerator, model))
        self.bare_mode = bare_mode(accelerator, model)
        self.bare = bare_step(plain, latents.shape[0], self.bare_mode)
        self.bare()  # compiles now, outside every timed window

    def __call__(self, accelerator, model, *rest, **kwargs):
        if self.bare is None:
            self.build_bare(accelerator, model, rest[3])  # (optimizer, lr_scheduler, noise_scheduler, latents, ...)
            for position, name, label in INSTANCE_PARTS:
                self.patch(rest[position], name, label)
        self.calls += 1
        timed = self.timed = self.calls > self.args.skip
        started = time.perf_counter()
        if timed and self.last_end is not None:
            self.between_seconds.append(started - self.last_end)
        result = self.step_function(accelerator, model, *rest, **kwargs)
        if timed:
            self.step_seconds.append(time.perf_counter() - started)
        if self.calls % self.args.every == 0:
            for _ in range(self.args.bare_steps):
                bare_start = time.perf_counter()
                self.bare()
                if timed:
                    self.bare_seconds.append(time.perf_counter() - bare_start)
        self.last_end = time.perf_counter()
        return result


def main(argv: list[str] | None = None) -> dict[str, float]:
    args, trainer_argv = parse_args(argv)
    past_the_run = str(args.max_train_steps + 1)
    extra = ["--max_train_steps", str(args.max_train_steps)]
    extra += ["--validation_steps", past_the_run, "--checkpointing_steps", past_the_run]
    if "--final_evaluation_inference_steps" not in trainer_argv:
        extra += ["--final_evaluation_inference_steps", "2"]  # the final scores are not what is measured here
    timer = Timer(args, trainer.training_step)
    with tempfile.TemporaryDirectory() as scratch:
        if "--output_dir" not in trainer_argv:
            extra += ["--output_dir", str(Path(scratch) / "run")]
        trainer.training_step = timer
        for owner, name, label in STEP_PARTS:
            timer.patch(owner, name, label)
        try:
            train_main([*trainer_argv, *extra])
        finally:
            trainer.training_step = timer.step_function
            timer.restore()
    step = statistics.median(timer.step_seconds)
    loop = step + statistics.fmean(timer.between_seconds)
    bare = statistics.median(timer.bare_seconds)
    print(f"\ntorch {torch.__version__}, {torch.get_num_threads()} threads; CPU: {this_cpu().describe()}")
    print(f"the trainer's steps {args.skip + 1}–{args.max_train_steps}; the bare step ({timer.bare_mode}) "
          f"{len(timer.bare_seconds)} times between them\n")  # fmt: skip
    print("| | ms per step | steps/s | of the bare step's steps/s |\n|---|---:|---:|---:|")
    rows = {"the trainer's loop (batch, step, logging)": loop, "its step function": step, "bare step": bare}
    for label, seconds in rows.items():
        print(f"| {label} | {seconds * 1e3:.1f} | {1 / seconds:.2f} | {bare / seconds:.0%} |")
    # Means, so that a part called once per micro-batch or a rare slow call counts as it adds up over the run.
    steps, step_mean = len(timer.step_seconds), statistics.fmean(timer.step_seconds)
    parts = {label: sum(seconds) / steps for label, seconds in timer.part_seconds.items()}
    print(f"\nThe step's parts, mean ms per timed step (the step function's mean: {step_mean * 1e3:.1f} ms):\n")
    print("| part | ms per step | of the step function |\n|---|---:|---:|")
    for label, seconds in parts.items():
        print(f"| {label} | {seconds * 1e3:.2f} | {seconds / step_mean:.1%} |")
    return {"loop": loop, "step": step, "bare": bare, "parts": parts}


if __name__ == "__main__":
    main()
