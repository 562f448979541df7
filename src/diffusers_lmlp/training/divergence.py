"""What a diverging run does: a step whose loss or gradient norm is NaN or inf stops the run before its update is
applied, and weights that are not finite are never saved; the message says where the good work is and what to try.
"""

import argparse
from pathlib import Path

from diffusers_lmlp.training.checkpoints import list_checkpoints
from diffusers_lmlp.training.step import NonFiniteLossError, non_finite_parameters


def diverged_message(error: NonFiniteLossError, args: argparse.Namespace, output_dir: Path, store) -> str:
    """What to say when a step's loss or gradient norm is NaN or inf; `store` is the run's feature store, if any."""
    checkpoints = list_checkpoints(output_dir)
    kept = (
        f"the last checkpoint, {checkpoints[-1]}, is intact: resume from it with --resume_from_checkpoint latest"
        if checkpoints
        else "no checkpoint had been written yet"
    )
    tries = [f"a lower --learning_rate (now {args.learning_rate:g})"]
    if args.max_grad_norm is None:
        tries.append("gradient clipping, --max_grad_norm 1.0")
    if args.mixed_precision == "fp16":
        tries.append("--mixed_precision bf16 or no (fp16 overflows)")
    if store is not None:
        tries.append(
            f"if the loss is not finite from the first steps, the cached features may be corrupted: delete {store.path} "
            "and run again to extract them anew"
        )
    return (
        f"error: {error}. Training stopped before this step's update was applied, and nothing of it was written; "
        f"{kept}. Try {'; '.join(tries)}."
    )


def require_finite_weights(model, ema, step: int, output_dir: Path, learning_rate: float) -> None:
    """Stop before a checkpoint or the pipeline is written with NaN or inf weights (the model's or the EMA's).
    Every process checks its own, equal copy, so all of them stop together."""
    bad = non_finite_parameters(model, ema=ema)
    if bad:
        checkpoints = list_checkpoints(output_dir)
        kept = f"the last checkpoint, {checkpoints[-1]}, is intact" if checkpoints else "no checkpoint was written"
        raise SystemExit(
            f"error: after step {step}, {len(bad)} weight tensor(s) hold NaN or inf ({', '.join(bad[:3])}"
            f"{', ...' if len(bad) > 3 else ''}), so nothing was saved; {kept}. Try a lower --learning_rate (now "
            f"{learning_rate:g}) or --max_grad_norm 1.0."
        )
