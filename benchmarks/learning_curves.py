"""The learning curves of shapes-world training runs: the shapes scorer's accuracies on held-out and training
captions against steps and against minutes, one line per run, and a table of each run's last scores.

Every validation of a shapes-world run appends its scores to `<run>/logs/scores.jsonl` (one image of each of the 32
held-out combinations and of 32 training captions, at the validation sampler settings); the run's final evaluation
(4 and 3 images per caption) is in `<run>/training_summary.json` and is drawn as the last point of each line.

    python benchmarks/learning_curves.py lmlp-shapes other-run --labels shipped "other recipe" --output curves.png
"""

import argparse
import json
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont


# The panels: (split, attribute, title), one row each.
PANELS = (
    ("held-out", "shape", "held-out shape"),
    ("held-out", "all", "held-out all four"),
    ("train", "all", "training captions, all four"),
)
COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf")
PANEL, MARGIN, LEGEND_ROW = (420, 220), 48, 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="the runs' --output_dir folders")
    parser.add_argument("--labels", nargs="+", help="a name per run (default: the folder names)")
    parser.add_argument("--output", type=Path, default=Path("learning-curves.png"), help="the plot (PNG)")
    args = parser.parse_args(argv)
    args.labels = args.labels or [run.name for run in args.runs]
    if len(args.labels) != len(args.runs):
        parser.error(f"--labels names {len(args.labels)} runs, but {len(args.runs)} are given")
    return args


def read_run(run: Path) -> list[dict]:
    """The run's points: each validation's record (step, minutes, scores by split), then its final evaluation's.

    Raises:
        `SystemExit`: When the run has neither validation scores nor a finished evaluation.
    """
    scores = run / "logs" / "scores.jsonl"
    points = [json.loads(line) for line in scores.read_text().splitlines() if line] if scores.is_file() else []
    summary_path = run / "training_summary.json"
    if summary_path.is_file():
        summary = json.loads(summary_path.read_text())
        if "scores" in summary:
            final = {"step": summary["steps"], "minutes": round(summary["train_seconds"] / 60, 3), "final": True}
            points = [p for p in points if p["step"] != final["step"]] + [{**final, **summary["scores"]}]
    if not points:
        raise SystemExit(f"error: {run} has no {scores.relative_to(run)} and no finished training_summary.json")
    return points


def draw(runs: dict[str, list[dict]]) -> Image.Image:
    """The plot: a row per panel, steps on the left and minutes on the right, y from 0 to 100%."""
    font = ImageFont.load_default(size=13)
    width = 2 * (PANEL[0] + MARGIN) + MARGIN
    height = len(PANELS) * (PANEL[1] + MARGIN) + MARGIN + LEGEND_ROW * len(runs)
    image = Image.new("RGB", (width, height), "white")
    d = ImageDraw.Draw(image)
    for column, axis in enumerate(("step", "minutes")):
        top = max((p[axis] for points in runs.values() for p in points), default=1) or 1
        for row, (split, attribute, title) in enumerate(PANELS):
            x0, y0 = MARGIN + column * (PANEL[0] + MARGIN), MARGIN + row * (PANEL[1] + MARGIN)
            d.rectangle((x0, y0, x0 + PANEL[0], y0 + PANEL[1]), outline="black")
            d.text((x0, y0 - 14), f"{title} vs {'steps' if axis == 'step' else 'minutes'}", fill="black", font=font)
            for percent in (0, 25, 50, 75, 90, 100):
                y = y0 + PANEL[1] * (1 - percent / 100)
                d.line((x0, y, x0 + PANEL[0], y), fill="#dddddd" if percent != 90 else "#999999")
                d.text((x0 - 30, y - 5), f"{percent}%", fill="black", font=font)
            d.text((x0 + PANEL[0] - 40, y0 + PANEL[1] + 4), f"{top:,.0f}" if axis == "step" else f"{top:.1f}", fill="black", font=font)  # fmt: skip
            for colour, points in zip(COLOURS, runs.values()):
                xy = [
                    (x0 + PANEL[0] * p[axis] / top, y0 + PANEL[1] * (1 - p[split][attribute]))
                    for p in points
                    if split in p
                ]
                if len(xy) > 1:
                    d.line(xy, fill=colour, width=2)
                for x, y in xy:
                    d.ellipse((x - 2, y - 2, x + 2, y + 2), fill=colour)
    legend = len(PANELS) * (PANEL[1] + MARGIN) + MARGIN // 2
    for i, (colour, label) in enumerate(zip(COLOURS, runs)):
        y = legend + i * LEGEND_ROW
        d.line((MARGIN, y + 6, MARGIN + 24, y + 6), fill=colour, width=3)
        d.text((MARGIN + 30, y), label, fill="black", font=font)
    return image


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if len(args.runs) > len(COLOURS):
        raise SystemExit(f"error: at most {len(COLOURS)} runs fit one plot")
    runs = {label: read_run(run) for label, run in zip(args.labels, args.runs)}
    print("| run | steps | minutes | held-out shape | held-out all | train all |\n|---|---:|---:|---:|---:|---:|")
    for label, points in runs.items():
        last = points[-1]
        print(
            f"| {label} | {last['step']:,} | {last['minutes']:.1f} | {last['held-out']['shape']:.0%} | "
            f"{last['held-out']['all']:.0%} | {last['train']['all']:.0%} |"
        )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    draw(runs).save(args.output)
    print(f"\n{args.output}")


if __name__ == "__main__":
    main()
