"""The end-of-run summary that the training script prints: where everything is, the scores, and how to load it.

`training_summary.json` holds the same numbers for programs; this is the few lines a person reads at the end of a
run (or at the end of its log file), for example::

    Trained 2,600 steps in 8 min 25 s on 1 process.
      pipeline    lmlp-shapes
      samples     lmlp-shapes/samples.png
      validation  lmlp-shapes/validation (4 grids)
      logs        lmlp-shapes/logs (tensorboard --logdir lmlp-shapes/logs)
      summary     lmlp-shapes/training_summary.json

    Scores (95% intervals over captions; 50 DPMSolverMultistepScheduler steps, guidance 2.0):
                       train               held-out
      images           96 (3 per caption)  128 (4 per caption)
      colour           100% (100-100%)     96% (91-100%)
      shape            42% (33-51%)        42% (34-50%)
      position         96% (92-99%)        98% (95-100%)
      size             88% (81-94%)        88% (82-93%)
      colour+position  96% (92-99%)        94% (89-98%)
      all              40% (31-49%)        31% (23-40%)
      shapes-FID       6.87 (floor 0.11)   7.00 (floor 0.12)

    Load it in Python:
      from diffusers_lmlp import LMLPPipeline; pipe = LMLPPipeline.from_pretrained("lmlp-shapes")

The score table is a list of rows (`score_rows`), one column per split: a new number per split is one more row.
"""

import json
from pathlib import Path

from ..hub.lora_card import load_base_code
from ..worlds import WORLDS


def format_duration(seconds: float) -> str:
    """`seconds` as a person says it: "42.3 s", "8 min 25 s", "26 h 03 min".

    Args:
        seconds (`float`): The duration.
    """
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, seconds = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {seconds:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def percent(value: float | None, interval: list[float] | None = None) -> str:
    """An accuracy as a whole percentage, with its interval when there is one: "42%", "42% (33-51%)"; "-" for none.

    Args:
        value (`float`, *optional*): The accuracy, in [0, 1], or `None` where the split has none.
        interval (`list[float]`, *optional*): Its `[low, high]`.
    """
    if value is None:
        return "-"
    return f"{value:.0%}" + (f" ({interval[0] * 100:.0f}-{interval[1]:.0%})" if interval else "")


def score_rows(summary: dict) -> list[tuple[str, list[str]]]:
    """The score table's rows, each a name and one cell per split (the columns, in `summary["scores"]`'s order): the
    number of images, each accuracy of the world's scorer (with its interval from `"score_intervals"` when the
    summary has them), then the world's FID with its real-vs-real floor and the CLIP score where measured. A new
    number per split is one more row here.

    Args:
        summary (`dict`): The run's `training_summary.json` content, with `"scores"`; optionally `"world"` (shapes
            when not given), `"score_intervals"` (split → metric → `[low, high]`), `"<world>_fid"` (split → `fid`,
            `fid_floor`, `num_images`), `"clip_score"` (split → score) and `"images_per_caption"` (split → count).
    """
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
    model's: "train: base", "train: LoRA", "held-out: base", ...

    Args:
        summary (`dict`): The run's summary, with `"scores"` and `"scores_before"`, and optionally the intervals
            (`"score_intervals"`, `"score_intervals_before"`) and shapes-FID (`"shapes_fid"`, `"shapes_fid_before"`).
    """
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
    """Rows as text lines: the names, then each column left-aligned, two spaces apart.

    Args:
        rows (`list[tuple[str, list[str]]]`): Each row's name and cells, all rows with as many cells.
        indent (`str`, *optional*, defaults to two spaces): Put before every line.
    """
    table = [[name, *cells] for name, cells in rows]
    widths = [max(len(row[column]) for row in table) for column in range(len(table[0]))]
    return [indent + "  ".join(text.ljust(width) for text, width in zip(row, widths)).rstrip() for row in table]


def scores_heading(summary: dict) -> str:
    """The line above the score table: how the images were sampled, and what the intervals are.

    Args:
        summary (`dict`): The run's summary, optionally with `"evaluation_sampler"` and `"score_intervals"`.
    """
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
    """The end-of-run summary: steps and time, where the pipeline, samples, validation grids and logs are, the scores
    when the run has them (a LoRA run's next to its base model's), and the Python that loads the pipeline (or the base
    pipeline and the adapter).

    Args:
        summary (`dict`): The run's `training_summary.json` content: `"steps"`, `"train_seconds"`, `"num_processes"`,
            `"ranks_in_sync"`, optionally `"scores"` (split → metric → accuracy) with what `score_rows` reads next to
            them, and `"evaluation_sampler"`; a LoRA run's also `"base_model"` and the base model's `"scores_before"`
            (`with_base_columns`).
        output_dir (`Path`): Where the pipeline was saved, as the user gave it (it also goes in the load line).
        sample_grid (`Path`, *optional*): The final sample grid, if one was drawn.
        validation_dir (`Path`, *optional*): The folder of validation grids, if any were drawn.
        logging_dir (`Path`, *optional*): The logs folder, if it was written (with the tensorboard command when it
            holds tensorboard's event files).
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
