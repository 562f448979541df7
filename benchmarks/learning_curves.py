"""The learning curves of runs on an embedded world (shapes or emoji): the world scorer's scores on held-out and
training captions against steps and against minutes, one line per run, and a table of each run's last scores.

Every validation of a world's run appends its scores to `<run>/logs/scores.jsonl` (one image of each of a number of
held-out and training captions, at the validation sampler settings); the run's final evaluation is in
`<run>/training_summary.json` and is drawn as the last point of each line. Needs matplotlib (`pip install
matplotlib`, or the package's `[plots]` extra).

    python benchmarks/learning_curves.py lmlp-shapes other-run --labels shipped "other recipe" --output curves.png
"""

import argparse
import json
from pathlib import Path


# The panels of each world: (split, score, title), one row each. The emoji world's pixel scores are drawn dashed.
PANELS = {
    "shapes": (
        ("held-out", "shape", "held-out shape"),
        ("held-out", "all", "held-out all four"),
        ("train", "all", "training captions, all four"),
    ),
    "emoji": (
        ("train", "top-5", "training names: the emoji among the 5 nearest"),
        ("held-out", "top-5", "held-out tone variants: the emoji among the 5 nearest"),
        ("held-out", "tone", "held-out tone variants: the tone nearest"),
    ),
}
MAX_RUNS = 10  # matplotlib's default colour cycle


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="the runs' --output_dir folders")
    parser.add_argument("--labels", nargs="+", help="a name per run (default: the folder names)")
    parser.add_argument("--output", type=Path, default=Path("learning-curves.png"), help="the plot (PNG)")
    args = parser.parse_args(argv)
    args.labels = args.labels or [run.name for run in args.runs]
    if len(args.labels) != len(args.runs):
        parser.error(f"--labels names {len(args.labels)} runs, but {len(args.runs)} are given")
    if len(args.runs) > MAX_RUNS:
        parser.error(f"at most {MAX_RUNS} runs fit one plot")
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


def world_of(points: list[dict]) -> str:
    """The world whose scores these are: the emoji world's have "top-5"."""
    return "emoji" if "top-5" in points[-1]["held-out"] else "shapes"


def draw(runs: dict[str, list[dict]], output: Path) -> None:
    """The plot: a row per panel, steps on the left and minutes on the right, y from 0 to 100%."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import PercentFormatter

    worlds = {world_of(points) for points in runs.values()}
    if len(worlds) > 1:
        raise SystemExit(f"error: the runs are of several worlds ({', '.join(sorted(worlds))}): plot each apart")
    panels = PANELS[worlds.pop()]
    figure, axes = plt.subplots(len(panels), 2, figsize=(11, 3.2 * len(panels)), squeeze=False)
    for row, (split, score, title) in enumerate(panels):
        for column, (axis, label) in enumerate((("step", "optimizer steps"), ("minutes", "training minutes"))):
            ax = axes[row][column]
            for colour, (name, points) in zip(plt.rcParams["axes.prop_cycle"].by_key()["color"], runs.items()):
                drawn = [p for p in points if split in p]
                for prefix, style in (("", "-"), ("pixel ", "--")):
                    if f"{prefix}{score}" in drawn[-1][split]:
                        ax.plot(
                            [p[axis] for p in drawn], [p[split][f"{prefix}{score}"] for p in drawn], style,
                            marker="o", markersize=3, color=colour,
                            label=f"{name}{' (pixels)' if prefix else ''}",
                        )  # fmt: skip
            ax.set_title(title, fontsize=10)
            ax.set_xlabel(label)
            ax.set_ylabel("share of images")
            ax.set_ylim(0, 1.02)
            ax.yaxis.set_major_formatter(PercentFormatter(1.0))
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    figure.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=100)
    plt.close(figure)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    runs = {label: read_run(run) for label, run in zip(args.labels, args.runs)}
    panels = PANELS[world_of(next(iter(runs.values())))]
    print("| run | steps | minutes | " + " | ".join(title for _, _, title in panels) + " |")
    print("|---|---:|---:|" + "---:|" * len(panels))
    for label, points in runs.items():
        last = points[-1]
        cells = [f"{last[split][score]:.0%}" for split, score, _ in panels]
        print(f"| {label} | {last['step']:,} | {last['minutes']:.1f} | " + " | ".join(cells) + " |")
    draw(runs, args.output)
    print(f"\n{args.output}")


if __name__ == "__main__":
    main()
