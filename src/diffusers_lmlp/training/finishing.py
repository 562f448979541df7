"""The end of a run: the main process saves the pipeline (or LoRA adapter) with its card, summary, samples and final
scores and pushes it (`--push_to_hub`); all processes leave together; the command prints `format_run_summary`.
"""

import atexit
import faulthandler
import json
import os
import sys
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
from diffusers_lmlp.training.validation import default_validation_prompts, evaluate_splits, generate, score_summary
from diffusers_lmlp.worlds import WORLDS


logger = get_logger(__name__)

TEARDOWN_TIMEOUT_SECONDS = 120  # a longer teardown of a multi-process run has hung: dump its stacks and exit (1)
# Arguments that never leave this process: kept out of trackers, logs, the model card and training_summary.json.
SECRET_ARGUMENTS = frozenset({"hub_token"})


def public_args(args: TrainingConfig) -> dict:
    """The arguments without the secrets (`SECRET_ARGUMENTS`): all that trackers, the card and the summary see."""
    return {name: value for name, value in vars(args).items() if name not in SECRET_ARGUMENTS}


def end_run(accelerator, pipe, ema, args, train_seconds: float, exit_when_done: bool = False) -> None:
    """After the last step: check that all processes hold the same weights, `finish` on the main process, then leave
    together; `exit_when_done` ends the process here, before the caller's frames free objects whose C++ destructors
    can hang."""
    accelerator.wait_for_everyone()
    flat = torch.cat([p.detach().float().flatten() for p in pipe.transformer.parameters()])
    digest = torch.tensor([flat.sum().item(), (flat * flat).sum().item()], dtype=torch.float64, device=flat.device)
    gathered = accelerator.gather(digest[None]).view(-1, 2)
    if accelerator.is_main_process:
        finish(pipe, ema, args, accelerator.num_processes, train_seconds, bool((gathered == gathered[0]).all()))
    accelerator.wait_for_everyone()  # a rank that tore down its process group now would leave the main one waiting
    if accelerator.num_processes > 1:  # everything is saved: a teardown that hangs must not hold the job forever
        faulthandler.dump_traceback_later(TEARDOWN_TIMEOUT_SECONDS, exit=True)
    accelerator.end_training()
    if exit_when_done:
        leave_finished_process()


def finish(pipe, ema, args, num_processes: int, seconds: float, in_sync: bool) -> None:
    """Save the pipeline (EMA weights unless EMA is off) or the adapter with a card; score it on its world."""
    output_dir, model = Path(args.output_dir), pipe.transformer
    if ema is not None:
        ema.copy_to(model.parameters())
    model.eval()
    # Should this run be killed while saving, nothing may describe an earlier run's weights (the user's card text stays).
    (output_dir / SUMMARY_FILE).unlink(missing_ok=True)
    card = output_dir / "README.md"
    if card.is_file():
        card.write_text(without_block(card.read_text(encoding="utf-8"), "description"), encoding="utf-8")
    try:
        save_adapter(model, output_dir) if args.lora_rank else pipe.save_pretrained(output_dir)
    except Exception as error:
        if (stop := disk_full_exit(error, output_dir, "the pipeline")) is None:
            raise
        raise stop from None

    summary = {
        **({"base_model": recorded_base_model(args.pretrained_model_name_or_path)} if args.lora_rank else {}),
        "num_processes": num_processes, "ranks_in_sync": in_sync, "steps": args.max_train_steps,
        "train_seconds": round(seconds, 1)
    }  # fmt: skip
    grid_path = None
    if prompts := default_validation_prompts(args):
        summary["sample_prompts"] = prompts  # the card's usage snippet samples the first
        grid_path = output_dir / "samples.png"
        make_image_grid(generate(pipe, prompts, args), captions=prompts).save(grid_path)
    if args.world:
        reports = whole = evaluate_splits(pipe, args, final=True)
        summary.update(world=args.world, **score_summary(reports, args.world))
        if args.lora_rank:  # the base model, by the same evaluation: what the adapter changed
            model.disable_adapters()
            whole = {"adapted": reports, "base": evaluate_splits(pipe, args, final=True)}
            model.enable_adapters()
            summary.update(score_summary(whole["base"], args.world, suffix="_before"))
        summary["images_per_caption"] = WORLDS[args.world].final_seeds
        summary["evaluation_sampler"] = reports["train"]["sampler"]
        reports_path = output_dir / args.logging_dir / "evaluation.json"  # the whole reports; the summary has scores
        reports_path.parent.mkdir(parents=True, exist_ok=True)
        reports_path.write_text(json.dumps(whole, indent=1), encoding="utf-8")
    write_card = write_lora_card if args.lora_rank else write_model_card
    write_card(
        output_dir, model if args.lora_rank else pipe, args=public_args(args), summary=summary, sample_grid=grid_path
    )
    # Last: the summary marks the folder finished, with weights, card and scores of this run.
    write_json_durably(output_dir / SUMMARY_FILE, summary)
    # No log line from here on: `accelerate launch` relays the child's stderr through a pipe, so a log written now can
    # land after the summary, which is printed to stdout and names the folder and the Hub URL.

    hub_url = None
    if args.push_to_hub:
        # `python -m diffusers_lmlp.hub push`'s upload: never checkpoints, logs or pickles; one commit.
        from diffusers_lmlp.hub import push_lora, push_pipeline

        hub_url = (push_lora if args.lora_rank else push_pipeline)(
            output_dir, args.hub_model_id or output_dir.name, token=args.hub_token, commit_message="End of training"
        ).commit_url
    folders = {"validation_dir": output_dir / "validation", "logging_dir": output_dir / args.logging_dir}
    folders = {name: folder for name, folder in folders.items() if folder.is_dir()}
    text = format_run_summary(summary, output_dir, sample_grid=grid_path, hub_url=hub_url, **folders)
    print(f"\n{text}", flush=True)


def leave_finished_process() -> None:
    """End a finished process without the interpreter's finalization (`atexit` handlers still run), where torch's
    threads can race the GIL's destruction and hang."""
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


def score_rows(summary: dict) -> list[tuple[str, list[str]]]:
    """The score table's rows, each a name and one cell per split: images, accuracies, FID, CLIP score."""
    world = summary.get("world", "shapes")
    scores, intervals = summary["scores"], summary.get("score_intervals", {})
    fid, per_caption = summary.get(f"{world}_fid"), summary.get("images_per_caption", {})
    splits = list(scores)
    rows = []
    if fid:
        each = {split: f" ({count} per caption)" for split, count in per_caption.items()}
        rows.append(("images", [f"{fid[split]['num_images']}{each.get(split, '')}" for split in splits]))
    for metric in dict.fromkeys(metric for split in splits for metric in scores[split]):  # every split's, in order
        values = [(scores[split].get(metric), intervals.get(split, {}).get(metric)) for split in splits]
        cells = [
            "-" if v is None else f"{v:.0%}" + (f" ({i[0] * 100:.0f}-{i[1]:.0%})" if i else "") for v, i in values
        ]
        rows.append((metric, cells))  # "42% (33-51%)", "-" where a split lacks the metric
    if fid:
        digits = WORLDS[world].fid_digits
        cells = [f"{fid[split]['fid']:.{digits}f} (floor {fid[split]['fid_floor']:.{digits}f})" for split in splits]
        rows.append((f"{world}-FID", cells))
    if "clip_score" in summary:
        rows.append(("CLIP score", [f"{summary['clip_score'][split]:.1f}" for split in splits]))
    return [("", splits), *rows]


def with_base_columns(summary: dict) -> dict:
    """A LoRA run's summary with the base model's scores as columns beside the adapter's ("train: base", ...)."""
    merged = dict(summary)
    for key in ("scores", "score_intervals", f"{summary.get('world', 'shapes')}_fid", "clip_score"):
        if key in summary:
            merged[key] = {}
            for split in summary["scores"]:
                merged[key][f"{split}: base"] = summary[f"{key}_before"][split]
                merged[key][f"{split}: LoRA"] = summary[key][split]
    per_caption = summary.get("images_per_caption", {})
    merged["images_per_caption"] = {f"{s}: {m}": n for s, n in per_caption.items() for m in ("base", "LoRA")}
    return merged


def format_run_summary(
    summary: dict, output_dir: Path, *, sample_grid: Path | None = None, validation_dir: Path | None = None,
    logging_dir: Path | None = None, hub_url: str | None = None
) -> str:  # fmt: skip
    """The end-of-run summary (no final newline): steps and time, where the outputs are, the scores (a LoRA run's
    beside its base model's) and the Python that loads it."""
    processes = summary["num_processes"]
    lines = [
        f"Trained {summary['steps']:,} steps in {format_duration(summary['train_seconds'])} on {processes} "
        f"process{'es' if processes > 1 else ''}."
    ]
    if not summary.get("ranks_in_sync", True):
        lines.append(
            "WARNING: the processes ended with different weights: each trained on its own "
            "(several CPU processes need ACCELERATE_USE_CPU=1)."
        )
    lora = "base_model" in summary
    places = [("adapter" if lora else "pipeline", str(output_dir))]
    if sample_grid is not None:
        places.append(("samples", str(sample_grid)))
    if validation_dir is not None:
        places.append(("validation", f"{validation_dir} ({len(list(validation_dir.glob('*.png')))} grids)"))
    if logging_dir is not None:
        tensorboard = any(logging_dir.rglob("events.out.tfevents.*"))
        places.append(("logs", f"{logging_dir}" + (f" (tensorboard --logdir {logging_dir})" if tensorboard else "")))
    places.append(("summary", str(Path(output_dir) / SUMMARY_FILE)))
    if hub_url is not None:
        places.append(("hub", hub_url))
    width = max(len(name) for name, _ in places)
    lines += [f"  {name.ljust(width)}  {place}" for name, place in places]
    if summary.get("scores"):  # how the images were sampled, then the table, its columns left-aligned
        how = ["95% intervals over captions"] if summary.get("score_intervals") else []
        if sampler := summary.get("evaluation_sampler"):
            how.append(
                f"{sampler['num_inference_steps']} {sampler['scheduler']} steps, guidance {sampler['guidance_scale']}"
            )
        rows = score_rows(with_base_columns(summary) if "scores_before" in summary else summary)
        rows = [[name, *cells] for name, cells in rows]
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
