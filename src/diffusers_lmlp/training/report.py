"""The end-of-run summary that the training script prints: where everything is, the scores, and how to load it.

`training_summary.json` holds the same numbers for programs; this is the few lines a person reads at the end of a
run. The score table is a list of rows (`score_rows`), one column per split: a new number per split is one more row.
"""

import json
from pathlib import Path

from ..hub.lora_card import load_base_code
from ..worlds import WORLDS


def format_duration(seconds: float) -> str:
    """`seconds` as a person says it: "42.3 s", "8 min 25 s", "26 h 03 min"."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, seconds = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {seconds:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def percent(value: float | None, interval: list[float] | None = None) -> str:
    """An accuracy in [0, 1] as a whole percentage, with its `[low, high]` interval if any: "42% (33-51%)"; "-" for
    None."""
    if value is None:
        return "-"
    return f"{value:.0%}" + (f" ({interval[0] * 100:.0f}-{interval[1]:.0%})" if interval else "")


def score_rows(summary: dict) -> list[tuple[str, list[str]]]:
    """The score table's rows, each a name and one cell per split: the number of images, each accuracy (with its
    interval), the world's FID with its floor and the CLIP score where measured."""
    world = summary.get("world", "shapes")
    scores, intervals = summary["scores"], summary.get("score_intervals", {})
    fid, per_caption = summary.get(f"{world}_fid"), summary.get("images_per_caption", {})
    splits = list(scores)
    rows = []
    if fid:
        each = {split: f" ({count} per caption)" for split, count in per_caption.items()}
        rows.append(("images", [f"{fid[split]['num_images']}{each.get(split, '')}" for split in splits]))
    for metric in dict.fromkeys(metric for split in splits for metric in scores[split]):  # every split's, in order
        cells = [percent(scores[split].get(metric), intervals.get(split, {}).get(metric)) for split in splits]
        rows.append((metric, cells))
    if fid:
        digits = WORLDS[world].fid_digits
        cells = [f"{fid[split]['fid']:.{digits}f} (floor {fid[split]['fid_floor']:.{digits}f})" for split in splits]
        rows.append((f"{world}-FID", cells))
    if "clip_score" in summary:
        rows.append(("CLIP score", [f"{summary['clip_score'][split]:.1f}" for split in splits]))
    return [("", splits), *rows]


def with_base_columns(summary: dict) -> dict:
    """A LoRA run's summary with the base model's scores (`"scores_before"`, ...) as columns next to the adapted
    model's: "train: base", "train: LoRA", ..."""
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


def format_table(rows: list[tuple[str, list[str]]], indent: str = "  ") -> list[str]:
    """Rows (a name and as many cells each) as text lines: each column left-aligned, two spaces apart."""
    table = [[name, *cells] for name, cells in rows]
    widths = [max(len(row[column]) for row in table) for column in range(len(table[0]))]
    return [indent + "  ".join(text.ljust(width) for text, width in zip(row, widths)).rstrip() for row in table]


def scores_heading(summary: dict) -> str:
    """The line above the score table: how the images were sampled, and what the intervals are."""
    how = []
    if summary.get("score_intervals"):
        how.append("95% intervals over captions")
    if sampler := summary.get("evaluation_sampler"):
        how.append(
            f"{sampler['num_inference_steps']} {sampler['scheduler']} steps, guidance {sampler['guidance_scale']}"
        )
    return "Scores" + (f" ({'; '.join(how)})" if how else "") + ":"


def format_run_summary(
    summary: dict,
    output_dir: Path,
    *,
    sample_grid: Path | None = None,
    validation_dir: Path | None = None,
    logging_dir: Path | None = None,
    hub_url: str | None = None,
) -> str:
    """The end-of-run summary: steps and time, where the outputs are, the scores when the run has them (a LoRA run's
    next to its base model's), and the Python that loads the pipeline (or the base pipeline and the adapter).

    Args:
        summary (`dict`): The run's `training_summary.json` content (`"steps"`, `"train_seconds"`, scores...).
        output_dir (`Path`): Where the pipeline was saved, as the user gave it (it also goes in the load line).
        sample_grid (`Path`, *optional*): The final sample grid, if one was drawn.
        validation_dir (`Path`, *optional*): The folder of validation grids, if any were drawn.
        logging_dir (`Path`, *optional*): The logs folder, if it was written.
        hub_url (`str`, *optional*): The Hub commit, if the pipeline was pushed.

    Returns:
        `str`: The summary, several lines, without a final newline.
    """
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
    places.append(("summary", str(Path(output_dir) / "training_summary.json")))
    if hub_url is not None:
        places.append(("hub", hub_url))
    width = max(len(name) for name, _ in places)
    lines += [f"  {name.ljust(width)}  {place}" for name, place in places]
    if summary.get("scores"):
        table = score_rows(with_base_columns(summary) if "scores_before" in summary else summary)
        lines += ["", scores_heading(summary), *format_table(table)]
    folder = json.dumps(str(output_dir), ensure_ascii=False)  # a Python string literal, quotes and escapes included
    lines += ["", "Load it in Python:"]
    if lora:
        lines += [f"  {line}" for line in load_base_code(summary["base_model"]).splitlines()]
        lines.append(f"  pipe.load_lora_weights({folder})")
    else:
        lines.append(f"  from diffusers_lmlp import LMLPPipeline; pipe = LMLPPipeline.from_pretrained({folder})")
    return "\n".join(lines)
