"""Checkpoints (atomic, pruned, verified on resume, accelerate's state beside diffusers model folders), the output
folder held by one run at a time, and what a diverging run is told."""

import contextlib
import errno
import json
import os
import shutil
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import broadcast
from diffusers.training_utils import EMAModel

from ..durable import checksum_problem, fsync_tree, hold_lock, write_checksums
from .arguments import LOCK_FILE, STATE_FILE, SUMMARY_FILE, UNDER_WAY_PATTERN, checkpoint_step, list_checkpoints
from .components import CHECKPOINT_FOLDER, load_adapter, save_adapter
from .step import DivergenceError, non_finite_parameters, plain_backbone


logger = get_logger(__name__)


@contextlib.contextmanager
def exclusive_output_dir(accelerator: Accelerator, output_dir: Path, overwrite: bool = False):
    """Hold `output_dir` for this run (a `flock`), clean up what killed runs left (with `overwrite`, the earlier run's
    checkpoints and summary too); refuse a second run on it."""
    lock = None
    if accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        if (lock := hold_lock(output_dir / LOCK_FILE)) is not None:
            for path in sorted(output_dir.glob(".checkpoint-*")):
                if not (match := UNDER_WAY_PATTERN.match(path.name)) or not path.is_dir():
                    continue
                final = output_dir / f"checkpoint-{match.group(1)}"
                if match.group(2) == "old" and not final.exists():
                    os.replace(path, final)
                    logger.warning(f"restored {final.name} from {path.name}, set aside by an interrupted run")
                else:
                    shutil.rmtree(path)
                    logger.warning(f"removed {path.name}, left by an interrupted run")
            if overwrite:
                remove_earlier_run(output_dir)
    if broadcast(torch.tensor([int(accelerator.is_main_process and lock is None)], device=accelerator.device)).item():
        message = f"another training run is using --output_dir {output_dir}: wait for it, or pass another"
        raise SystemExit(f"error: {message} --output_dir.")
    with lock if lock is not None else contextlib.nullcontext():  # closing the lock file drops it
        yield


def remove_earlier_run(output_dir: Path) -> None:
    """`--overwrite_output_dir`: remove the earlier run's checkpoints and summary."""
    earlier = list_checkpoints(output_dir)
    for path in earlier:
        remove_checkpoint(path)
    (output_dir / SUMMARY_FILE).unlink(missing_ok=True)
    if earlier:
        logger.warning(f"--overwrite_output_dir: removed the earlier run's {', '.join(p.name for p in earlier)}")


def warn_about_later_checkpoints(output_dir: Path, step: int) -> None:
    """Name the checkpoints past the `step` this run starts from: they belong to an abandoned run."""
    later = [p.name for p in list_checkpoints(output_dir) if checkpoint_step(p) > step]
    if later:
        logger.warning(
            f"this run starts at step {step}, and {output_dir} holds later checkpoints {', '.join(later)} of a run it "
            f"abandons, overwritten or pruned as it goes; until then, --resume_from_checkpoint latest picks "
            f"{later[-1]}."
        )


def save_checkpoint(
    accelerator: Accelerator, output_dir: Path, step: int, limit: int | None, train_seconds: float,
    final_step: bool = True
) -> Path:  # fmt: skip
    """Write `checkpoint-{step}` atomically, then keep the `limit` newest; the new one counts only once the next proves
    the steps after it healthy, or at the `final_step`. A full disk stops the run with the earlier ones kept."""
    final, tmp = output_dir / f"checkpoint-{step}", output_dir / f".checkpoint-{step}.tmp"
    try:
        accelerator.save_state(str(tmp))
        (tmp / STATE_FILE).write_text(json.dumps({"step": step, "train_seconds": train_seconds}), encoding="utf-8")
        write_checksums(tmp)  # verified on resume (`checkpoint_to_resume`)
        fsync_tree(tmp)
    except Exception as error:
        shutil.rmtree(tmp, ignore_errors=True)
        if (stop := disk_full_exit(error, output_dir, f"checkpoint-{step}")) is None:
            raise
        raise stop from None
    aside = output_dir / f".checkpoint-{step}.old"
    if final.exists():  # from an abandoned run (see `warn_about_later_checkpoints`)
        os.replace(final, aside)
    os.replace(tmp, final)
    fsync_tree(output_dir, recursive=False)
    shutil.rmtree(aside, ignore_errors=True)
    if limit is not None:  # keep the newest; those past `step`, an abandoned run's, go first
        limit += 0 if final_step else 1
        ordered = sorted(list_checkpoints(output_dir), key=lambda p: (checkpoint_step(p) <= step, checkpoint_step(p)))
        for path in ordered[: max(0, len(ordered) - limit)]:
            remove_checkpoint(path)
    return final


def checkpoint_to_resume(output_dir: Path, resume_from_checkpoint: str) -> Path | None:
    """The checkpoint `--resume_from_checkpoint` names (`latest`: the newest intact one, or None), verified."""
    if resume_from_checkpoint != "latest":
        path = Path(resume_from_checkpoint)
        if problem := checksum_problem(path):
            raise SystemExit(f"error: the checkpoint {path} is damaged: {problem}. Resume from another one.")
        return path
    checkpoints = list_checkpoints(output_dir)
    for path in reversed(checkpoints):
        if (problem := checksum_problem(path)) is None:
            return path
        logger.warning(f"{path.name} is damaged ({problem}): --resume_from_checkpoint latest takes an earlier one")
    if checkpoints:
        damaged = ", ".join(p.name for p in checkpoints) + " are damaged"
        raise SystemExit(f"error: no checkpoint in {output_dir} is intact ({damaged}): pass --overwrite_output_dir")
    return None


def intact_checkpoint(output_dir: Path, before: int | None = None) -> Path | None:
    """The newest checkpoint (of a step below `before`, if given) whose files match their checksums."""
    candidates = [p for p in list_checkpoints(output_dir) if before is None or checkpoint_step(p) < before]
    return next((path for path in reversed(candidates) if checksum_problem(path) is None), None)


def disk_full_exit(error: Exception, output_dir: Path, what: str) -> SystemExit | None:
    """The `SystemExit` of a save of `what` out of space (or `ulimit -f`), or None for another failure."""
    space = isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
    if not space and shutil.disk_usage(output_dir).free >= 2**20:
        return None
    earlier = ", ".join(p.name for p in list_checkpoints(output_dir))
    kept = f"the earlier checkpoints are intact: {earlier}" if earlier else "there is no earlier one"
    done = f"{what.capitalize()} is saved in part"
    if what.startswith("checkpoint"):
        done = "The partial checkpoint was removed"
    return SystemExit(
        f"error: no space left on the device (or a file-size limit, `ulimit -f`) while saving {what} in "
        f"--output_dir {output_dir} ({error}). {done}, and {kept}. Free some space, then resume with "
        "--resume_from_checkpoint latest."
    )


def remove_checkpoint(path: Path) -> None:
    """Delete a checkpoint, renamed first: a kill never leaves a partial `checkpoint-N`."""
    doomed = path.with_name(f".{path.name}.deleting")
    os.replace(path, doomed)
    shutil.rmtree(doomed)


def saved_train_seconds(checkpoint: Path) -> float:
    """The training time up to `checkpoint`, over all of its run's segments."""
    state = checkpoint / STATE_FILE
    if not state.is_file():
        logger.warning(f"{checkpoint} has no {STATE_FILE}: the summary counts the training time from here")
        return 0.0
    return float(json.loads(state.read_text(encoding="utf-8"))["train_seconds"])


def register_checkpoint_hooks(accelerator: Accelerator, model_class, ema: EMAModel | None, lora: bool = False) -> None:
    """Checkpoints hold diffusers model folders: `transformer/` and `transformer_ema/`, or the `transformer_lora/`."""

    def save_hook(models, weights, output_dir):
        if accelerator.is_main_process:
            for model in models:
                unwrapped = plain_backbone(accelerator, model)
                if lora:
                    save_adapter(unwrapped, Path(output_dir) / CHECKPOINT_FOLDER)
                else:
                    unwrapped.save_pretrained(os.path.join(output_dir, "transformer"))
                weights.pop()
            if ema is not None:
                ema.save_pretrained(os.path.join(output_dir, "transformer_ema"))

    def load_hook(models, input_dir):
        saved_lora = os.path.isdir(os.path.join(input_dir, CHECKPOINT_FOLDER))
        if saved_lora != lora:
            trained = "a LoRA adapter: resume it with" if saved_lora else "the whole backbone: resume it without"
            raise SystemExit(f"error: {input_dir} is a checkpoint of a run that trained {trained} --lora_rank")
        for _ in range(len(models)):
            model = models.pop()
            if lora:
                load_adapter(plain_backbone(accelerator, model), Path(input_dir) / CHECKPOINT_FOLDER)
                continue
            loaded = model_class.from_pretrained(input_dir, subfolder="transformer")
            plain_backbone(accelerator, model).load_state_dict(loaded.state_dict())
        if ema is None:
            return
        ema_dir = os.path.join(input_dir, "transformer_ema")
        if os.path.isdir(ema_dir):
            ema.load_state_dict(EMAModel.from_pretrained(ema_dir, model_class).state_dict())
        else:
            logger.warning(f"{input_dir} has no EMA weights (trained without --use_ema): the EMA starts from them")
            ema.load_state_dict(EMAModel(loaded.parameters(), decay=ema.decay).state_dict())

    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)


def diverged_message(
    error: DivergenceError, output_dir: Path, *, learning_rate: float, max_grad_norm: float | None,
    mixed_precision: str | None, store_path: Path | None = None,
) -> str:  # fmt: skip
    """What to say when a step diverged; the step before's checkpoint holds the weights that did: only older ones are
    confirmed. `store_path`: the run's feature store, if any."""
    confirmed = intact_checkpoint(output_dir, before=error.step - 1)
    suspect = [p.name for p in list_checkpoints(output_dir) if checkpoint_step(p) >= error.step - 1]
    kept = "no checkpoint that later steps confirmed had been written yet"
    if confirmed:
        kept = f"the newest checkpoint that later steps confirmed is {confirmed}: resume from it with "
        kept += f"--resume_from_checkpoint {confirmed}"
    if suspect:
        kept += f" ({', '.join(suspect)}, saved just before this step, may hold the diverged weights)"
    tries = [f"a lower --learning_rate (now {learning_rate:g})"]
    if max_grad_norm is None:
        tries.append("gradient clipping, --max_grad_norm 1.0")
    if mixed_precision == "fp16":
        tries.append("--mixed_precision bf16 or no (fp16 overflows)")
    if store_path is not None:
        tries.append(f"if it diverged from the first steps, deleting the feature store {store_path}")
    return f"error: {error}. Training stopped before this step's update was applied; {kept}. Try {'; '.join(tries)}."


def require_finite_weights(model, ema, step: int, output_dir: Path, learning_rate: float) -> None:
    """Stop before a checkpoint or the pipeline is written with NaN or inf weights (the model's or the EMA's)."""
    bad = non_finite_parameters(model, ema=ema)
    if bad:
        intact = intact_checkpoint(output_dir)
        kept = f"the newest intact checkpoint is {intact}" if intact else "no intact checkpoint was written"
        raise SystemExit(
            f"error: after step {step}, {len(bad)} weight tensor(s) hold NaN or inf ({', '.join(bad[:3])}"
            f"{', ...' if len(bad) > 3 else ''}), so nothing was saved; {kept}. Try a lower --learning_rate (now "
            f"{learning_rate:g}) or --max_grad_norm 1.0."
        )
