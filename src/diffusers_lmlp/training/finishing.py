"""The end of a run: the pipeline (or LoRA adapter) saved with its card, summary, samples and scores, and pushed."""

import atexit
import faulthandler
import json
import os
import sys
from functools import partial
from pathlib import Path

import torch
from accelerate.logging import get_logger

from diffusers_lmlp.durable import write_json_durably
from diffusers_lmlp.hub import write_model_card
from diffusers_lmlp.hub.card import without_block
from diffusers_lmlp.hub.lora_card import load_base_code, recorded_base_model, write_lora_card
from diffusers_lmlp.image_grid import make_image_grid
from diffusers_lmlp.training.arguments import SUMMARY_FILE, TrainingConfig
from diffusers_lmlp.training.checkpoints import disk_full_exit
from diffusers_lmlp.training.components import save_adapter
from diffusers_lmlp.training.validation import evaluate_splits, generate, score_summary
from diffusers_lmlp.worlds import WORLDS


logger = get_logger(__name__)

TEARDOWN_TIMEOUT_SECONDS = 120  # a longer teardown of a multi-process run has hung: dump its stacks and exit (1)
SECRET_ARGUMENTS = frozenset({"hub_token"})  # kept out of trackers, logs, the model card and the summary


def public_args(args: TrainingConfig) -> dict:
    """The arguments without the secrets (`SECRET_ARGUMENTS`): all that trackers, the card and the summary see."""
    return {name: value for name, value in vars(args).items() if name not in SECRET_ARGUMENTS}


def end_run(accelerator, pipe, ema, train_seconds: float, exit_when_done: bool = False, **outputs) -> None:
    """After the last step: check that all processes hold the same weights, `finish(**outputs)` on the main process,
    leave together; `exit_when_done` ends the process before the caller's frames free objects that can hang."""
    accelerator.wait_for_everyone()
    flat = torch.cat([p.detach().float().flatten() for p in pipe.transformer.parameters()])
    digest = torch.tensor([flat.sum().item(), (flat * flat).sum().item()], dtype=torch.float64, device=flat.device)
    gathered = accelerator.gather(digest[None]).view(-1, 2)
    if accelerator.is_main_process:
        in_sync = bool((gathered == gathered[0]).all())
        finish(pipe, ema, num_processes=accelerator.num_processes, seconds=train_seconds, in_sync=in_sync, **outputs)
    accelerator.wait_for_everyone()  # a rank that tore down its process group now would leave the main one waiting
    if accelerator.num_processes > 1:  # everything is saved: a teardown that hangs must not hold the job forever
        faulthandler.dump_traceback_later(TEARDOWN_TIMEOUT_SECONDS, exit=True)
    accelerator.end_training()
    if exit_when_done:
        leave_finished_process()


def finish(
    pipe, ema, *, output_dir: Path, logging_dir: str, card_args: dict, steps: int, num_processes: int,
    seconds: float, in_sync: bool, prompts: list[str], world: str | None, lora_base: str | None = None,
    num_inference_steps: int, guidance_scale: float, seed: int, final_inference_steps: int,
    push_to: str | None = None, hub_token: str | None = None,
) -> None:  # fmt: skip
    """Save the pipeline (EMA weights) or, with a `lora_base`, the adapter with its card; sample, score and push it."""
    model, lora = pipe.transformer, lora_base is not None
    if ema is not None:
        ema.copy_to(model.parameters())
    model.eval()
    # Should this run be killed while saving, nothing may describe an earlier run's weights.
    (output_dir / SUMMARY_FILE).unlink(missing_ok=True)
    card = output_dir / "README.md"
    if card.is_file():
        card.write_text(without_block(card.read_text(encoding="utf-8"), "description"), encoding="utf-8")
    try:
        save_adapter(model, output_dir) if lora else pipe.save_pretrained(output_dir)
    except Exception as error:
        if (stop := disk_full_exit(error, output_dir, "the pipeline")) is None:
            raise
        raise stop from None

    summary = {"base_model": recorded_base_model(lora_base)} if lora else {}
    summary.update(num_processes=num_processes, ranks_in_sync=in_sync, steps=steps, train_seconds=round(seconds, 1))
    grid_path = None
    if prompts:
        summary["sample_prompts"] = prompts  # the card's usage snippet samples the first
        grid_path = output_dir / "samples.png"
        sampling = dict(num_inference_steps=num_inference_steps, guidance_scale=guidance_scale)
        make_image_grid(generate(pipe, prompts, seed=seed, **sampling), captions=prompts).save(grid_path)
    if world:
        evaluation = partial(evaluate_splits, pipe, world, num_inference_steps=final_inference_steps, seed=seed)
        reports = whole = evaluation(final=True)
        summary.update(world=world, **score_summary(reports, world))
        if lora:  # the base model, by the same evaluation: what the adapter changed
            model.disable_adapters()
            whole = {"adapted": reports, "base": evaluation(final=True)}
            model.enable_adapters()
            summary.update(score_summary(whole["base"], world, suffix="_before"))
        summary["images_per_caption"] = WORLDS[world].final_seeds
        summary["evaluation_sampler"] = reports["train"]["sampler"]
        reports_path = output_dir / logging_dir / "evaluation.json"  # the whole reports; the summary has scores
        reports_path.parent.mkdir(parents=True, exist_ok=True)
        reports_path.write_text(json.dumps(whole, indent=1), encoding="utf-8")
    write_card = write_lora_card if lora else write_model_card
    write_card(output_dir, model if lora else pipe, args=card_args, summary=summary, sample_grid=grid_path)
    write_json_durably(output_dir / SUMMARY_FILE, summary)  # last: it marks the folder finished
    # No log line from here on: `accelerate launch` relays stderr through a pipe, so it could land after the summary.

    hub_url = None
    if push_to:
        # `python -m diffusers_lmlp.hub push`'s upload: never checkpoints, logs or pickles; one commit.
        from diffusers_lmlp.hub import push_lora, push_pipeline

        push = push_lora if lora else push_pipeline
        hub_url = push(output_dir, push_to, token=hub_token, commit_message="End of training").commit_url
    folders = {"validation_dir": output_dir / "validation", "logging_dir": output_dir / logging_dir}
    folders = {name: folder for name, folder in folders.items() if folder.is_dir()}
    text = format_run_summary(summary, output_dir, sample_grid=grid_path, hub_url=hub_url, **folders)
    print(f"\n{text}", flush=True)


def leave_finished_process() -> None:
    """End a finished process without the interpreter's finalization, where torch's threads can hang."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def format_duration(seconds: float) -> str:
    """`seconds` as a person says it: "42.3 s", "8 min 25 s", "26 h 03 min"."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, seconds = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {seconds:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def score_rows(summary: dict) -> list[list[str]]:
    """The score table's rows, a name and one cell per split each: images, accuracies, FID, CLIP score."""
    world = summary.get("world", "shapes")
    scores, intervals = summary["scores"], summary.get("score_intervals", {})
    fid, per_caption = summary.get(f"{world}_fid"), summary.get("images_per_caption", {})
    splits = list(scores)
    rows = []
    if fid:
        each = {split: f" ({count} per caption)" for split, count in per_caption.items()}
        rows.append(["images", *(f"{fid[split]['num_images']}{each.get(split, '')}" for split in splits)])
    for metric in dict.fromkeys(metric for split in splits for metric in scores[split]):  # every split's, in order
        values = [(scores[split].get(metric), intervals.get(split, {}).get(metric)) for split in splits]
        cells = (
            "-" if v is None else f"{v:.0%}" + (f" ({i[0] * 100:.0f}-{i[1]:.0%})" if i else "") for v, i in values
        )
        rows.append([metric, *cells])  # "42% (33-51%)", "-" where a split lacks the metric
    if fid:
        digits = WORLDS[world].fid_digits
        cells = [f"{fid[split]['fid']:.{digits}f} (floor {fid[split]['fid_floor']:.{digits}f})" for split in splits]
        rows.append([f"{world}-FID", *cells])
    if "clip_score" in summary:
        rows.append(["CLIP score", *(f"{summary['clip_score'][split]:.1f}" for split in splits)])
    return [["", *splits], *rows]


def with_base_columns(summary: dict) -> dict:
    """A LoRA run's summary with the base model's scores as columns beside the adapter's ("train: base", ...)."""
    merged = dict(summary)
    for key in ("scores", "score_intervals", f"{summary.get('world', 'shapes')}_fid", "clip_score"):
        if key in summary:
            pairs = (("base", f"{key}_before"), ("LoRA", key))
            merged[key] = {f"{split}: {name}": summary[k][split] for split in summary["scores"] for name, k in pairs}
    per_caption = summary.get("images_per_caption", {})
    merged["images_per_caption"] = {f"{s}: {m}": n for s, n in per_caption.items() for m in ("base", "LoRA")}
    return merged


def format_run_summary(
    summary: dict, output_dir: Path, *, sample_grid: Path | None = None, validation_dir: Path | None = None,
    logging_dir: Path | None = None, hub_url: str | None = None
) -> str:  # fmt: skip
    """The end-of-run summary: steps and time, where the outputs are, the scores and the Python that loads it."""
    processes, took = summary["num_processes"], format_duration(summary["train_seconds"])
    lines = [f"Trained {summary['steps']:,} steps in {took} on {processes} process{'es' if processes > 1 else ''}."]
    if not summary.get("ranks_in_sync", True):
        warning = "the processes ended with different weights: each trained on its own (several CPU processes"
        lines.append(f"WARNING: {warning} need ACCELERATE_USE_CPU=1).")
    lora = "base_model" in summary
    places = {"adapter" if lora else "pipeline": output_dir, "samples": sample_grid}
    if validation_dir is not None:
        places["validation"] = f"{validation_dir} ({len(list(validation_dir.glob('*.png')))} grids)"
    if logging_dir is not None:
        tensorboard = any(logging_dir.rglob("events.out.tfevents.*"))
        places["logs"] = f"{logging_dir}" + (f" (tensorboard --logdir {logging_dir})" if tensorboard else "")
    places.update(summary=Path(output_dir) / SUMMARY_FILE, hub=hub_url)
    width = max(len(name) for name, place in places.items() if place is not None)
    lines += [f"  {name.ljust(width)}  {place}" for name, place in places.items() if place is not None]
    if summary.get("scores"):  # how the images were sampled, then the table, its columns left-aligned
        how = ["95% intervals over captions"] if summary.get("score_intervals") else []
        if sampler := summary.get("evaluation_sampler"):
            steps, scheduler, guidance = (sampler[k] for k in ("num_inference_steps", "scheduler", "guidance_scale"))
            how.append(f"{steps} {scheduler} steps, guidance {guidance}")
        rows = score_rows(with_base_columns(summary) if "scores_before" in summary else summary)
        widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
        lines += ["", "Scores" + (f" ({'; '.join(how)})" if how else "") + ":"]
        lines += ["  " + "  ".join(text.ljust(width) for text, width in zip(row, widths)).rstrip() for row in rows]
    folder = json.dumps(str(output_dir), ensure_ascii=False)  # a Python string literal, quotes and escapes included
    lines += ["", "Load it in Python:"]
    if lora:
        lines += [f"  {line}" for line in load_base_code(summary["base_model"]).splitlines()]
        lines.append(f"  pipe.load_lora_weights({folder})")
    else:
        lines.append(f"  from diffusers_lmlp import LMLPPipeline; pipe = LMLPPipeline.from_pretrained({folder})")
    return "\n".join(lines)
