"""L-MLP's Table 1 on the shapes world: every block family, trained with the same budget, scored and tabulated.

The README table: `python benchmarks/ablation_shapes.py --output_dir ablation-shapes --minutes_per_model 3`

L-MLP Table 1 (§5.2) compares block designs "under the same configuration through 100K training steps", with
"model parameters ... controlled to be comparable in each group by adjusting model hyperparameters". Here every
entry gets the shapes world's skeleton (`SHAPES_SMALL`: 8×8×8 latents, patch 2, 10 text tokens of width 64, depth 8)
and the width D that brings its parameter count closest to `shapes-S`'s (860,386), then every entry trains the same
number of steps at the shapes preset's batch in `examples/train_text_to_image.py`, whose final evaluation scores it
with the shapes scorer and shapes-FID.

The entries are, by default, every registered block family at its default block and L-MLP Table 1's named variants
A1, A2, A3, F2 and MoE-MLP's 2E1H (`--models` picks any family names and named configurations). A named
configuration keeps its block options (merging, lateral MLPs, long skips, experts, ...) and takes the shapes
skeleton. The budget: each model's training speed is measured in this process (timed forward + backward + AdamW
steps at the preset's batch), and the number of steps is what the slowest model trains in `--minutes_per_model`.
Entries run one after another, each as a training subprocess; a failed one is reported with the last line of its
log and the others go on. Run it again with the same `--output_dir` to resume: finished entries are read back,
the others (re)run with the steps of the first run (`plan.json`), an interrupted one from its latest checkpoint.

    python benchmarks/ablation_shapes.py --output_dir ablation-shapes                     # all entries, 3 min each
    python benchmarks/ablation_shapes.py --models lmlp F2 uvit --minutes_per_model 10
    python benchmarks/ablation_shapes.py --models lmlp A1 --steps 2 -- --validation_inference_steps 2   # smoke run

Arguments after `--` go to every training run. In `--output_dir`: `results.md` (the table), `results.json`,
`ablation.png` (the scores as bars), `grids/<entry>.png` (each entry's final samples), `samples.png` (all of them), `<entry>/` (each trained
pipeline, with its `training_summary.json`) and `logs/<entry>.log` (each training run's output).
"""

import argparse
import json
import math
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw, ImageFont

from diffusers_lmlp.analysis.figures import bar_chart
from diffusers_lmlp.commands import number
from diffusers_lmlp.complexity import complexity
from diffusers_lmlp.models.catalog import SHAPES_SMALL
from diffusers_lmlp.models.families import FAMILIES, BlockFamily, named_configs
from diffusers_lmlp.training.arguments import PRESETS


TRAINING_SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "train_text_to_image.py"
# The model whose parameter count every entry matches, and the Table 1 variants trained besides each family's default.
REFERENCE = "shapes-S"
TABLE_1_VARIANTS = ("A1", "A2", "A3", "F2", "2E1H")
# The widths D searched for the parameter match.
WIDTHS = range(1, 1025)
# Timed training steps per model (after one warm-up step) for the budget.
SPEED_STEPS = 3
# Training-script arguments the ablation sets itself, refused after `--`: the same budget and config for every entry.
RESERVED_TRAINING_ARGS = {
    "--max_train_steps": "--steps",
    "--train_batch_size": "nothing: every entry trains at the shapes preset's batch, at which the budget is timed",
    "--model_type": "--models",
    "--model_config": "--models",
    "--model_overrides": "--models",
    "--output_dir": "--output_dir before --",
    "--preset": "nothing: the ablation is on the shapes world",
}
# The scores of the table, from the held-out split of the final evaluation (combinations never seen in training).
SCORES = ("colour+position", "shape", "all")


@dataclass
class Entry:
    """One row of the ablation: a family, or a named configuration, on the shapes skeleton at a matched width.

    Args:
        name (`str`): A family name ("uvit") or a named configuration ("A1"); also its folder's name.
        family (`BlockFamily`): Its block family.
        config (`dict`): Every `__init__` argument of the family's model class, width matched.
        params (`int`, *optional*): Exact parameter count of the model `config` builds.
        macs (`int`, *optional*): Forward multiply-adds per sample (`complexity`).
        error (`str`, *optional*): Why the entry could not be planned, measured or trained.
        result (`dict`): What its training run reported (see `read_result`).
    """

    name: str
    family: BlockFamily
    config: dict[str, Any] = field(default_factory=dict)
    params: int | None = None
    macs: int | None = None
    error: str | None = None
    result: dict[str, Any] = field(default_factory=dict)


def default_entries() -> list[str]:
    """Every registered family, then the Table 1 variants that some family defines."""
    named = named_configs()
    return [*FAMILIES, *(name for name in TABLE_1_VARIANTS if name in named)]


def check_entry_names(names: list[str]) -> None:
    """Raise a `ValueError` naming the entries that are neither a family nor a named configuration.

    Args:
        names (`list[str]`): The `--models`.
    """
    named = named_configs()
    unknown = [name for name in names if name not in FAMILIES and name not in named]
    if unknown:
        raise ValueError(
            f"--models {' '.join(unknown)}: not a block family ({', '.join(FAMILIES)}) nor a named configuration "
            f"({', '.join(named)})."
        )
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"--models names {', '.join(repeated)} more than once; name each entry once.")


def shapes_config(name: str) -> tuple[BlockFamily, dict[str, Any]]:
    """The family and full config of an entry on the shapes skeleton, before width matching.

    A family gets its class's defaults, a named configuration its own values; `SHAPES_SMALL` then replaces the
    skeleton fields (latent and text shapes, width and depth) and keeps the block options.

    Args:
        name (`str`): A family name or a named configuration.
    """
    if name in FAMILIES:
        family, overrides = FAMILIES[name], {}
    else:
        family, overrides = named_configs()[name]
    return family, {**family.full_config(overrides), **SHAPES_SMALL}


def reference_params() -> int:
    """Parameters of the reference model (`REFERENCE`, 860,386)."""
    family, overrides = named_configs()[REFERENCE]
    return sum(p.numel() for p in build_on_meta(family, family.full_config(overrides)).parameters())


def build_on_meta(family: BlockFamily, config: Mapping) -> torch.nn.Module:
    """The model of `config`, built on the meta device (shapes only: no memory, no arithmetic)."""
    with torch.device("meta"):
        return family.model_class(**config)


def match_width(family: BlockFamily, config: Mapping, target: int) -> tuple[dict[str, Any], int]:
    """The config with the width D whose model has the parameter count closest to `target`, among the widths the
    model accepts (U-ViT's D must be a multiple of its heads: the model's own check decides).

    Args:
        family (`BlockFamily`): The config's family.
        config (`Mapping`): A full config of the family's model class.
        target (`int`): The parameter count to match.

    Returns:
        `tuple[dict, int]`: The matched config and its model's exact parameter count.

    Raises:
        `ValueError`: When the model accepts none of `WIDTHS`, with the model's reason for the closest one.
    """
    counts: dict[int, int | ValueError] = {}

    def accepted_from(width: int, step: int) -> int | None:
        """The first width from `width` on (up for step 1, down for -1) that the model accepts."""
        for candidate in range(width, WIDTHS.stop if step > 0 else WIDTHS.start - 1, step):
            if candidate not in counts:
                try:
                    model = build_on_meta(family, {**config, "hidden_size": candidate})
                    counts[candidate] = sum(p.numel() for p in model.parameters())
                except ValueError as error:  # a width the block cannot have (U-ViT's heads, gMLP's even d_ffn)
                    counts[candidate] = error
            if not isinstance(counts[candidate], ValueError):
                return candidate
        return None

    # The parameter count grows with the width: bisect for the first accepted width that reaches the target.
    low, high = WIDTHS.start, WIDTHS.stop - 1
    while low < high:
        width = accepted_from((low + high) // 2, 1)
        if width is None or counts[width] >= target:
            high = (low + high) // 2
        else:
            low = width + 1
    above, below = accepted_from(low, 1), accepted_from(low - 1, -1)
    candidates = [width for width in (above, below) if width is not None]
    if candidates:
        width = min(candidates, key=lambda w: (abs(counts[w] - target), w))
        return {**config, "hidden_size": width}, counts[width]
    refusal = next((error for error in counts.values() if isinstance(error, ValueError)), None)
    raise ValueError(f"no width in {WIDTHS.start}..{WIDTHS.stop - 1} builds a {family.label} here: {refusal}")


def plan_entry(name: str, target: int) -> Entry:
    """An entry's matched config, parameters and MACs; a config the model refuses makes a failed entry.

    Args:
        name (`str`): A family name or a named configuration.
        target (`int`): The parameter count to match.
    """
    family, config = shapes_config(name)
    entry = Entry(name, family)
    try:
        config, params = match_width(family, config, target)
        entry.config, entry.params = config, params
        entry.macs = complexity(config, family=family.name).macs
    except Exception as error:  # a family that cannot be sized is a row of the table, not the end of the ablation
        entry.error = f"{type(error).__name__}: {error}"
    return entry


def preset_batch_size() -> int:
    """The shapes preset's batch, which every training run uses: read from the trainer itself."""
    return PRESETS["shapes"].train_batch_size


def measure_speed(entry: Entry, batch_size: int, device: torch.device) -> float:
    """Training steps per second of an entry's model: forward, ε-MSE, backward and an AdamW step on random inputs
    of the shapes skeleton, `SPEED_STEPS` of them timed after one warm-up step.

    Args:
        entry (`Entry`): A planned entry.
        batch_size (`int`): Samples per step.
        device (`torch.device`): Where the training runs will train.
    """
    config = entry.config
    generator = torch.Generator().manual_seed(0)
    model = entry.family.model_class(**config).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters())
    side = config["sample_size"]
    latents = torch.randn(batch_size, config["in_channels"], side, side, generator=generator).to(device)
    text = torch.randn(batch_size, config["text_seq_len"], config["text_embed_dim"], generator=generator).to(device)
    timesteps = torch.randint(0, 1000, (batch_size,), generator=generator).to(device)
    noise = torch.randn(latents.shape, generator=generator).to(device)

    def step():
        loss = F.mse_loss(model(latents, text, timesteps).sample, noise)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(SPEED_STEPS):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return SPEED_STEPS / (time.perf_counter() - start)


def budget_steps(speeds: Mapping[str, float], minutes: float) -> int:
    """The steps every entry trains: as many as the slowest trains in `minutes` (at least one).

    Args:
        speeds (`Mapping[str, float]`): Training steps per second of each entry.
        minutes (`float`): The time budget per model.
    """
    return max(1, math.floor(minutes * 60 * min(speeds.values())))


def training_command(entry: Entry, steps: int, output_dir: Path, extra: list[str]) -> list[str]:
    """The training run of an entry: the shapes preset, the entry's full config, `steps` steps.

    One checkpoint per quarter of the run (kept: the newest), so a killed run resumes (`--resume_from_checkpoint
    latest`); no validation before the end (`--validation_steps` past the last step); the preset's final samples and
    evaluation.

    Args:
        entry (`Entry`): A planned entry.
        steps (`int`): Training steps.
        output_dir (`Path`): The ablation's folder; the run writes to `<output_dir>/<entry>`.
        extra (`list[str]`): More training-script arguments (they come last, so they win).
    """
    overrides = [f"{key}={json.dumps(value)}" for key, value in entry.config.items()]
    return [
        sys.executable, str(TRAINING_SCRIPT), "--preset", "shapes",
        "--model_type", entry.family.name, "--model_overrides", *overrides,
        "--max_train_steps", str(steps), "--output_dir", str(output_dir / entry.name),
        "--cache_dir", str(output_dir / ".lmlp-cache"), "--report_to", "none",
        "--checkpointing_steps", str(max(1, steps // 4)), "--checkpoints_total_limit", "1",
        "--validation_steps", str(steps + 1), "--resume_from_checkpoint", "latest",
        *extra,
    ]  # fmt: skip


def read_result(entry_dir: Path) -> dict[str, Any]:
    """The table's values from a finished run's `training_summary.json`.

    Args:
        entry_dir (`Path`): The run's output folder.

    Returns:
        `dict`: steps, train_seconds, steps_per_second, the held-out `SCORES` with their 95% intervals
        (`intervals`), held-out shapes-FID with its real-vs-real floor, and the number of held-out images.
    """
    summary = json.loads((entry_dir / "training_summary.json").read_text(encoding="utf-8"))
    fid = summary["shapes_fid"]["held-out"]
    return {
        "steps": summary["steps"],
        "train_seconds": summary["train_seconds"],
        "steps_per_second": summary["steps"] / max(summary["train_seconds"], 0.1),  # the summary rounds to 0.1 s
        "scores": {key: summary["scores"]["held-out"][key] for key in SCORES},
        "intervals": {key: summary["score_intervals"]["held-out"].get(key) for key in SCORES},
        "shapes_fid": fid["fid"],
        "shapes_fid_floor": fid["fid_floor"],
        "num_images": fid["num_images"],
    }


def last_line(log: Path) -> str:
    """The last non-empty line of a log (a failed run's error)."""
    lines = [line.strip() for line in log.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
    return lines[-1] if lines else "(the log is empty)"


def run_training(entry: Entry, steps: int, output_dir: Path, extra: list[str]) -> None:
    """Train an entry in a subprocess, its output in `<output_dir>/logs/<entry>.log`; fill `entry.result` or
    `entry.error`.

    Args:
        entry (`Entry`): A planned entry.
        steps (`int`): Training steps.
        output_dir (`Path`): The ablation's folder.
        extra (`list[str]`): More training-script arguments.
    """
    log = output_dir / "logs" / f"{entry.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w", encoding="utf-8") as out:
        process = subprocess.run(training_command(entry, steps, output_dir, extra), stdout=out, stderr=out)
    if process.returncode:
        entry.error = f"exit status {process.returncode}: {last_line(log)}"
    elif not (output_dir / entry.name / "training_summary.json").is_file():
        entry.error = f"the run wrote no training_summary.json (see {log})"
    else:
        entry.result = read_result(output_dir / entry.name)


def save_grid(entry: Entry, output_dir: Path) -> None:
    """Copy the run's final samples (`samples.png`: the preset's sample captions, held-out ones last) to
    `grids/<entry>.png`.

    Args:
        entry (`Entry`): A finished entry.
        output_dir (`Path`): The ablation's folder.
    """
    samples = output_dir / entry.name / "samples.png"
    if samples.is_file():
        (output_dir / "grids").mkdir(exist_ok=True)
        shutil.copyfile(samples, output_dir / "grids" / f"{entry.name}.png")


def label(entry: Entry) -> str:
    """The family's label and the family-specific part of the config ("MoE-MLP, 2 experts × 1 heads")."""
    return entry.family.label + (entry.family.details(entry.config) if entry.config else "")


def percent(value: float, interval: list[float] | None = None) -> str:
    text = f"{100 * value:.0f}%"
    return f"{text} ({100 * interval[0]:.0f}–{100 * interval[1]:.0f})" if interval else text


TABLE_HEADER = (
    "entry",
    "family",
    "D",
    "params",
    "Δ params",
    "MMACs/sample",
    "train steps/s",
    "held-out colour+position",
    "held-out shape",
    "held-out all",
    "shapes-FID",
    "notes",
)


def table_row(entry: Entry, target: int) -> tuple[str, ...]:
    """An entry's cells in `TABLE_HEADER` order; what is not known (yet) is "—".

    Args:
        entry (`Entry`): An entry, planned, failed or finished.
        target (`int`): The parameter count every entry matches.
    """
    planned = entry.params is not None
    result = entry.result
    scores, intervals = result.get("scores", {}), result.get("intervals", {})
    return (
        entry.name,
        label(entry),
        str(entry.config["hidden_size"]) if planned else "—",
        f"{entry.params:,}" if planned else "—",
        f"{100 * (entry.params - target) / target:+.1f}%" if planned else "—",
        f"{entry.macs / 1e6:.1f}" if planned else "—",
        f"{result['steps_per_second']:.2f}" if result else "—",
        *(percent(scores[key], intervals.get(key)) if result else "—" for key in SCORES),
        f"{result['shapes_fid']:.2f}" if result else "—",
        f"failed: {entry.error}".replace("|", "\\|") if entry.error else "" if result else "not trained yet",
    )


def format_table(entries: list[Entry], target: int, steps: int | None, batch_size: int | None) -> str:
    """The ablation as Markdown: one line on the budget, then the table.

    Args:
        entries (`list[Entry]`): The entries, in order.
        target (`int`): The parameter count every entry matches.
        steps (`int`, *optional*): The training steps (unknown when nothing was planned).
        batch_size (`int`, *optional*): The training batch.
    """
    images = next((e.result["num_images"] for e in entries if e.result), None)
    budget = f"{steps:,} steps at batch {batch_size}" if steps else "no training budget yet"
    scored = f"{images} held-out images" if images else "the held-out combinations"
    lines = [
        f"{budget} per entry; width D matched to {REFERENCE}'s {target:,} parameters; scores on {scored} "
        "(95% intervals over captions), shapes-FID of the held-out split.",
        "",
        "| " + " | ".join(TABLE_HEADER) + " |",
        "|" + "---|" * len(TABLE_HEADER),
    ]
    lines += ["| " + " | ".join(table_row(entry, target)) + " |" for entry in entries]
    return "\n".join(lines) + "\n"


def draw_plot(entries: list[Entry], title: str) -> Image.Image:
    """Horizontal bars per entry: held-out colour+position and shape accuracy (%), and held-out shapes-FID (lower is
    better); an entry that failed or has not run has no bars."""
    scores = {key: [100 * e.result["scores"][key] if e.result else None for e in entries]
              for key in ("colour+position", "shape")}  # fmt: skip
    fid = {"shapes-FID": [e.result["shapes_fid"] if e.result else None for e in entries]}
    labels = [e.name if e.result else f"{e.name} ({'failed' if e.error else 'not run'})" for e in entries]
    return bar_chart(
        title,
        labels,
        [("held-out accuracy (%)", scores, ".0f"), ("held-out shapes-FID (lower is better)", fid, ".1f")],
    )


def draw_samples(entries: list[Entry], grids_dir: Path, columns: int = 5, scale: float = 0.5) -> Image.Image | None:
    """Every trained entry's sample grid (`grids/<entry>.png`), scaled and labelled, side by side: one picture to
    compare the families by eye. `None` when no entry has a grid yet.

    Args:
        entries (`list[Entry]`): The entries, in order.
        grids_dir (`Path`): The `grids/` folder.
        columns (`int`, *optional*, defaults to 5): Grids per row.
        scale (`float`, *optional*, defaults to 0.5): Size of each grid relative to its file.
    """
    grids = [
        (e.name, Image.open(grids_dir / f"{e.name}.png")) for e in entries if (grids_dir / f"{e.name}.png").is_file()
    ]
    if not grids:
        return None
    font = ImageFont.load_default(size=14)
    width, height = (round(max(g.size[i] for _, g in grids) * scale) for i in (0, 1))
    label, gap = 20, 10
    rows = math.ceil(len(grids) / columns)
    sheet = Image.new("RGB", (columns * (width + gap) - gap, rows * (height + label + gap) - gap), "white")
    draw = ImageDraw.Draw(sheet)
    for i, (name, grid) in enumerate(grids):
        x, y = (i % columns) * (width + gap), (i // columns) * (height + label + gap)
        draw.text((x + 2, y + 2), name, fill="black", font=font)
        scaled = grid.convert("RGB").resize((round(grid.width * scale), round(grid.height * scale)), Image.LANCZOS)
        sheet.paste(scaled, (x, y + label))
    return sheet


def write_outputs(
    entries: list[Entry], target: int, steps: int | None, batch_size: int | None, output_dir: Path
) -> str:
    """Write `results.md`, `results.json`, `ablation.png` and `samples.png` (every entry's samples, side by side);
    return the Markdown.

    Args:
        entries (`list[Entry]`): The entries, in order.
        target (`int`): The parameter count every entry matches.
        steps (`int`, *optional*): The training steps.
        batch_size (`int`, *optional*): The training batch.
        output_dir (`Path`): The ablation's folder.
    """
    table = format_table(entries, target, steps, batch_size)
    (output_dir / "results.md").write_text(table, encoding="utf-8")
    records = [
        {
            "entry": e.name,
            "family": e.family.name,
            "label": label(e),
            "config": e.config,
            "params": e.params,
            "params_delta": (e.params - target) / target if e.params is not None else None,
            "macs": e.macs,
            "error": e.error,
            **e.result,
        }
        for e in entries
    ]
    results = {"reference": REFERENCE, "reference_params": target, "steps": steps, "train_batch_size": batch_size}
    (output_dir / "results.json").write_text(json.dumps({**results, "entries": records}, indent=1), encoding="utf-8")
    title = f"held-out scores after {steps:,} steps at batch {batch_size}" if steps else "held-out scores"
    draw_plot(entries, title).save(output_dir / "ablation.png")
    samples = draw_samples(entries, output_dir / "grids")
    if samples is not None:
        samples.save(output_dir / "samples.png")
    return table


def duration(seconds: float) -> str:
    """`seconds` for a person: "42 s", "3 min 05 s", "1 h 02 min"."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


class Progress:
    """Prints a line per stage with the elapsed time and an estimate of the time left."""

    def __init__(self):
        self.start = time.perf_counter()

    def __call__(self, stage: str, left: float | None = None, at_least: bool = False) -> None:
        elapsed = time.perf_counter() - self.start
        estimate = "" if left is None else f", {'at least ' if at_least else '~'}{duration(left)} left"
        print(f"[{duration(elapsed)} elapsed{estimate}] {stage}", flush=True)


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """The ablation's arguments, and the training-script arguments after `--`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--models", nargs="+", metavar="NAME",
        help=f"entries: block families and named configurations (default: every family, then "
        f"{', '.join(TABLE_1_VARIANTS)})",
    )  # fmt: skip
    parser.add_argument("--output_dir", default="ablation-shapes", help="where the runs and results go (resumable)")
    parser.add_argument(
        "--minutes_per_model", type=number(float, above=0), default=3.0,
        help="training time budget per model: every entry trains the steps the slowest one trains in this time",
    )  # fmt: skip
    parser.add_argument(
        "--steps", type=number(int, 1), help="train every entry this many steps instead of the budget's"
    )
    args = parser.parse_args(argv)
    if args.models:
        try:
            check_entry_names(args.models)
        except ValueError as error:
            parser.error(str(error))
    for argument in extra:
        name = argument.split("=")[0]
        if name in RESERVED_TRAINING_ARGS:
            parser.error(f"{name} after -- is set by the ablation for every entry; use {RESERVED_TRAINING_ARGS[name]}")
    return args, extra


def main(argv: list[str] | None = None) -> None:
    args, extra = parse_args(argv)
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    progress = Progress()
    target = reference_params()
    entries = [plan_entry(name, target) for name in args.models or default_entries()]
    progress(f"planned {len(entries)} entries, widths matched to {REFERENCE}'s {target:,} parameters")

    finished = [e for e in entries if e.error is None and (output_dir / e.name / "training_summary.json").is_file()]
    for entry in finished:
        entry.result = read_result(output_dir / entry.name)
        save_grid(entry, output_dir)
    pending = [e for e in entries if e.error is None and not e.result]
    if finished:
        progress(f"resuming: {', '.join(e.name for e in finished)} already trained in {output_dir}")

    plan_path = output_dir / "plan.json"
    plan = json.loads(plan_path.read_text(encoding="utf-8")) if plan_path.is_file() else None
    if plan and args.steps not in (None, plan["steps"]):
        raise SystemExit(
            f"error: {output_dir} holds runs of {plan['steps']} steps (plan.json); --steps {args.steps} would give "
            "its entries different budgets. Drop --steps to resume, or pass another --output_dir."
        )
    batch_size = plan["train_batch_size"] if plan else preset_batch_size()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    speeds = {}
    for entry in pending:
        progress(f"timing {entry.name} ({entry.params:,} parameters, D = {entry.config['hidden_size']}) on {device}")
        try:
            speeds[entry.name] = measure_speed(entry, batch_size, device)
        except Exception as error:  # a family that cannot train is a row of the table, not the end of the ablation
            entry.error = f"{type(error).__name__}: {error}"
    pending = [e for e in pending if e.error is None]
    steps = plan["steps"] if plan else args.steps or (budget_steps(speeds, args.minutes_per_model) if speeds else None)
    if steps is not None and plan is None:
        plan_path.write_text(json.dumps({"steps": steps, "train_batch_size": batch_size}), encoding="utf-8")
    for entry in entries:
        if entry.error:
            print(f"  {entry.name}: failed: {entry.error}")
        elif entry.name in speeds:
            speed = speeds[entry.name]
            delta = 100 * (entry.params - target) / target
            print(
                f"  {entry.name}: D = {entry.config['hidden_size']}, {entry.params:,} parameters ({delta:+.1f}%), "
                f"~{speed:.2f} steps/s: {steps:,} steps in ~{duration(steps / speed)}"
            )
    progress(f"plan: {steps} steps at batch {batch_size} for every entry" if steps else "nothing to train")

    overheads = []  # each run's time besides training: start-up, feature cache, final samples and evaluation
    for index, entry in enumerate(pending):
        training_left = sum(steps / speeds[e.name] for e in pending[index:])
        overhead = sum(overheads) / len(overheads) if overheads else 0.0
        progress(
            f"training {entry.name} ({index + 1}/{len(pending)}), log: {output_dir / 'logs' / entry.name}.log",
            training_left + overhead * (len(pending) - index),
            at_least=not overheads,
        )
        started = time.perf_counter()
        run_training(entry, steps, output_dir, extra)
        if entry.result:
            overheads.append(time.perf_counter() - started - entry.result["train_seconds"])
            save_grid(entry, output_dir)
        write_outputs(entries, target, steps, batch_size, output_dir)
        progress(f"{entry.name}: " + (f"failed ({entry.error})" if entry.error else "done"))

    table = write_outputs(entries, target, steps, batch_size, output_dir)
    print(f"\n{table}\nresults: {output_dir / 'results.md'}, {output_dir / 'ablation.png'}, {output_dir / 'grids'}")


if __name__ == "__main__":
    main()
