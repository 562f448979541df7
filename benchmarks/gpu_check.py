"""The GPU check: one command that, in at most 8 minutes on one GPU, measures what docs/speed-gpu.md reports.

Parts, in this order (`--parts` picks some; each writes its results to `--output` as soon as it ends, a part that
fails records its error and the next one runs, and a part that would start past `--budget_s` is recorded as skipped):

- `parity`: one model of every family on the device against the same weights on the CPU (fp32, TF32 off), in fp32
  and under bf16 autocast, as max |device - CPU| over max |CPU|, each against its tolerance;
- `padding`: F2-deep's token-mixing GEMM (B·D rows, L × L) at its L = 334 and at L padded to a multiple of 8, 16 and
  64, in the speed part's precision: which multiple, if any, pays for its extra FLOPs;
- `speed`: F2-deep, 4E2H and U-ViT-S/2 (SDPA) at B = 256 then 64: images/s of sampling (one CFG forward) and training
  (one AdamW step) in each mode, the fraction of GEMM-only time, the MFU, and each model's speed over U-ViT's (best
  modes, timed in one window: `speed_vs_uvit.py`'s measurement);
- `main`: the README's main command, `--max_train_steps` cut to `MAIN_STEPS`: steps/s and its scores;
- `emoji`: `--preset emoji`, likewise.

    python benchmarks/gpu_check.py --output gpu-check.json                      # on a GPU
    python benchmarks/gpu_check.py --device cpu --quick --output gpu-check.json  # the same parts, tiny, on a CPU

The exit status is 1 when a part failed or a parity check is out of its tolerance. The goals (docs/speed-gpu.md):
F2-deep at least 1.0× U-ViT-S/2 at B = 256 for sampling and training, and at 80% or more of its GEMM-only time.
"""

import argparse
import copy
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from argparse import Namespace
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import speed_vs_uvit as speed
import torch
import torch.nn.functional as F

from diffusers_lmlp.commands import number
from diffusers_lmlp.models import family_of


ROOT = Path(__file__).resolve().parent.parent
PARTS = ("parity", "padding", "speed", "main", "emoji")
SPEED_MODELS = [speed.BASELINE, speed.REFERENCE, "4E2H"]  # the baseline and reference first: timed beside the rest
TOLERANCE = {"fp32": 1e-4, "bf16": 5e-2}  # of max |CPU output|
PAD_MULTIPLES = (8, 16, 64)
MAIN_STEPS = 1000  # of the main command's 10,400 and the emoji preset's 4,000: their speed, not their result
LAUNCH = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "examples/accelerate.yaml"]
TRAIN = [*LAUNCH, "examples/train_text_to_image.py"]
# --quick: a 2-layer backbone, the trainers at 2 steps on a slice of their world with a 2-step sampler.
QUICK_TRAINING = [
    "--max_train_steps", "2", "--validation_steps", "2", "--checkpointing_steps", "2",
    "--validation_inference_steps", "2", "--final_evaluation_inference_steps", "2", "--torch_compile", "no",
    "--report_to", "none", "--model_overrides", "hidden_size=32", "num_layers=2",
]  # fmt: skip
QUICK_DATA = {"main": ["--shapes_num_images", "256"], "emoji": ["--max_train_samples", "64"]}
COMMANDS = {"main": [], "emoji": ["--preset", "emoji"]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--quick", action="store_true", help="2-layer models at B = 2, eager, trainers at 2 steps")
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    parser.add_argument("--batch_sizes", type=number(int, 1), nargs="+", help="default: 256 64 (--quick: 2)")
    parser.add_argument("--modes", nargs="+", choices=(*speed.MODES, "graphs"), help="default: eager regional graphs")
    parser.add_argument("--repeats", type=number(int, 1), default=5, help="timed rounds; the best time counts")
    parser.add_argument("--budget_s", type=number(float, 1.0), default=450.0, help="no part starts after this")
    parser.add_argument("--output", type=Path, default=Path("gpu-check.json"), help="the JSON; the table beside it")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU, and torch sees none here; check the CPU with --device cpu.")
    args.batch_sizes = args.batch_sizes or ([2] if args.quick else [256, 64])
    args.modes = args.modes or (["eager"] if args.quick else ["eager", "regional", "graphs"])
    args.repeats = 1 if args.quick else args.repeats
    args.num_layers = 2 if args.quick else None
    args.precision = "bf16" if args.device == "cuda" else "fp32"
    return args


def parity(args: Namespace) -> list[dict]:
    """One model per family: the device's output against the CPU's, fp32 and bf16 autocast, on the same inputs."""
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False  # the patch embedding's convolution, whose default on CUDA is TF32
    records = []
    for name in speed.DEFAULT_MODELS:
        model = speed.build(name, args.num_layers).eval()
        data = speed.inputs(model.config, 2, "cpu")
        with torch.inference_mode():
            reference = model(data["latents"], data["text"], data["timesteps"]).sample  # (2, C, H, W)
        on_device = copy.deepcopy(model).to(args.device)
        moved = {key: value.to(args.device) for key, value in data.items()}
        record = {"model": name, "family": family_of(model).label}
        for precision, tolerance in TOLERANCE.items():
            with torch.inference_mode(), speed.autocast(args.device, precision):
                out = on_device(moved["latents"], moved["text"], moved["timesteps"]).sample.float().cpu()
            error = ((out - reference).abs().max() / reference.abs().max()).item()
            record[precision] = {"relative_error": error, "tolerance": tolerance, "ok": error <= tolerance}
        records.append(record)
        print(
            f"parity {name}: fp32 {record['fp32']['relative_error']:.1e}, bf16 {record['bf16']['relative_error']:.1e}"
        )
    return records


def padding(args: Namespace) -> list[dict]:
    """F2-deep's token-mixing GEMM, `F.linear` of (B·D, L) by (L, L), at L and padded: time, and time per useful FLOP
    over the unpadded one's (below 1: the padding pays)."""
    config = speed.build(speed.REFERENCE, args.num_layers, "meta").config
    length = 1 + config.text_seq_len + (config.sample_size // config.patch_size) ** 2
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    records = []
    for batch_size in args.batch_sizes:
        lengths = dict.fromkeys([length] + [math.ceil(length / m) * m for m in PAD_MULTIPLES])
        operands = {
            padded: (
                torch.randn(batch_size * config.hidden_size, padded, device=args.device, dtype=dtype),
                torch.randn(padded, padded, device=args.device, dtype=dtype),
            )
            for padded in lengths
        }
        steps = {padded: lambda x=x, w=w: F.linear(x, w) for padded, (x, w) in operands.items()}
        best = speed.time_interleaved(steps, args.repeats, args.device)
        for padded in lengths:
            records.append(
                {
                    "batch_size": batch_size,
                    "tokens": padded,
                    "multiple": next((m for m in PAD_MULTIPLES if padded % m == 0), None),
                    "seconds": best[padded],
                    "time_per_useful_flop": best[padded] / best[length],
                }
            )
    return records


def measure_speed(args: Namespace, deadline: float, publish: Callable[[list], None]) -> list[str]:
    """`speed_vs_uvit.measure_model` for each model and batch (largest first), the baseline's and reference's steps
    timed beside every later model, the rows so far `publish`ed after each model (so a kill keeps them); returns what
    would have started after `deadline`, skipped."""
    torch._dynamo.config.recompile_limit = 64  # every model, mode, pass and batch compiles in this one process
    rows, skipped = [], []
    for batch_size in args.batch_sizes:
        window = Namespace(
            num_layers=args.num_layers,
            device=args.device,
            modes=args.modes,
            batch_size=batch_size,
            repeats=args.repeats,
        )
        references: dict[str, dict] = {}
        steps = None
        for name in SPEED_MODELS:
            if time.monotonic() > deadline:
                skipped.append(f"{name} at B={batch_size}")
                continue
            model_rows, steps = speed.measure_model(name, window, args.precision, references)
            rows += model_rows
            if name in (speed.BASELINE, speed.REFERENCE):
                references[name] = speed.reference_steps(model_rows, steps)
            publish(rows)
        references = steps = None  # free the compiled copies and optimiser states before the next batch
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return skipped


def speed_records(rows: list, device: str) -> list[dict]:
    """The rows as JSON records, with the share of GEMM-only time, the MFU (on a GPU) and the speed over U-ViT's."""
    peak = speed.gpu_peak_tflops(max(row.gemm_gflops for row in rows) / 1e3)[0] if device == "cuda" else None
    return [
        {
            **asdict(row),
            "of_gemm": row.of_gemm,
            "mfu": row.gflops / 1e3 / peak if peak else None,
            "speedup_over_uvit": speed.speedup(row, rows),
        }
        for row in rows
    ]


def goals(rows: list) -> dict:
    """The issue's goals, read at the largest batch measured: F2-deep's best modes against U-ViT's, and its share of
    GEMM-only time."""
    batch = max(row.batch_size for row in rows)
    found = {}
    for (model, batch_size, _, pass_), row in speed.best_rows(rows).items():
        if model == speed.REFERENCE and batch_size == batch and (ratio := speed.speedup(row, rows)) is not None:
            found[f"{pass_} at B={batch}: F2-deep over U-ViT-S/2 >= 1.0"] = (ratio, 1.0)
            found[f"{pass_} at B={batch}: F2-deep's GEMM-only time share >= 0.8"] = (row.of_gemm, 0.8)
    return {goal: {"value": value, "least": least, "met": value >= least} for goal, (value, least) in found.items()}


def run_command(part: str, args: Namespace, timeout: float) -> dict:
    """A trainer command, as the README writes it, in a fresh output folder: its exit, wall time, steps/s, scores."""
    extra = QUICK_TRAINING + QUICK_DATA[part] if args.quick else ["--max_train_steps", str(MAIN_STEPS)]
    with tempfile.TemporaryDirectory(prefix=f"gpu-check-{part}-") as folder:
        out = Path(folder)
        argv = [*TRAIN, *COMMANDS[part], *extra, "--output_dir", str(out / "run"), "--cache_dir", str(out / "cache")]
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0")}
        if args.device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""  # accelerate puts the run on the GPU when it sees one
        start = time.monotonic()
        with open(out / "train.log", "wb") as log:
            process = subprocess.Popen(
                argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                returncode = process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                returncode = None
        record = {
            "command": shlex.join(["accelerate", "launch", *argv[len(LAUNCH) - 2 :]]),
            "returncode": returncode,
            "wall_seconds": round(time.monotonic() - start, 1),
        }
        summary_file = out / "run" / "training_summary.json"
        if returncode == 0 and summary_file.is_file():
            summary = json.loads(summary_file.read_text(encoding="utf-8"))
            record.update(steps=summary["steps"], train_seconds=summary["train_seconds"], scores=summary.get("scores"))
            record["steps_per_second"] = summary["steps"] / max(summary["train_seconds"], 1e-9)
        else:
            lines = (out / "train.log").read_text(encoding="utf-8", errors="replace").splitlines()
            record["log_tail"] = lines[-40:] if returncode is not None else [f"stopped after {timeout:.0f} s"]
    return record


def machine(args: Namespace) -> dict:
    return {
        "line": speed.machine_line(args.device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "quick": args.quick,
    }


def cell(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def markdown(results: dict) -> str:
    """The tables of docs/speed-gpu.md: parity, padding, speed (with MFU), goals and the two commands."""
    lines = [f"Machine: {results['machine']['line']} ({results['machine']['date']})", ""]

    def table(title: str, header: tuple, rows: list[tuple]) -> None:
        cells = ["| " + " | ".join(map(str, row)) + " |" for row in rows]
        lines.extend([f"## {title}", "", speed.markdown(header, cells), ""])

    if rows := results.get("parity"):
        table("Device against CPU (max |diff| / max |CPU|)", ("model", "family", "fp32", "bf16", "within tolerance"), [
            (r["model"], r["family"], f"{r['fp32']['relative_error']:.1e}", f"{r['bf16']['relative_error']:.1e}",
             "yes" if r["fp32"]["ok"] and r["bf16"]["ok"] else "**no**") for r in rows
        ])  # fmt: skip
    if rows := results.get("padding"):
        table("F2-deep's token-mixing GEMM, padded", ("B", "tokens", "ms", "time per useful FLOP"), [
            (r["batch_size"], r["tokens"], f"{r['seconds'] * 1e3:.3f}", f"{r['time_per_useful_flop']:.2f}")
            for r in rows
        ])  # fmt: skip
    if rows := results.get("speed"):
        header = ("model", "B", "precision", "pass", "mode", "images/s", "of GEMM", "MFU", "first call s", "× U-ViT")
        table("Speed (× U-ViT: best modes, one window)", header, [
            (r["model"], r["batch_size"], r["precision"], r["pass_"], r["mode"], f"{r['images_per_second']:.1f}",
             f"{r['of_gemm']:.0%}", cell(r["mfu"], ".1%"), f"{r['compile_seconds']:.0f}",
             cell(r["speedup_over_uvit"], ".2f")) for r in rows
        ])  # fmt: skip
    if goals_met := results.get("goals"):
        table("Goals", ("goal", "measured", "met"), [
            (goal, f"{g['value']:.3f}", "yes" if g["met"] else "**no**") for goal, g in goals_met.items()
        ])  # fmt: skip
    if commands := [(part, results[part]) for part in ("main", "emoji") if part in results]:
        table("The trainer's commands", ("part", "command", "exit", "wall s", "steps/s"), [
            (part, f"`{r['command']}`", r["returncode"], f"{r['wall_seconds']:.0f}", cell(r.get("steps_per_second"), ".1f"))
            for part, r in commands
        ])  # fmt: skip
    lines += [f"**{part} failed**: {message}\n" for part, message in results["errors"].items()]
    if results["skipped"]:
        lines.append(f"Skipped (past --budget_s): {', '.join(results['skipped'])}\n")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.monotonic()
    deadline = start + args.budget_s
    results = {"machine": machine(args), "errors": {}, "skipped": []}

    def write() -> None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
        args.output.with_suffix(".md").write_text(markdown(results) + "\n", encoding="utf-8")

    for part in PARTS:
        if part not in args.parts:
            continue
        if time.monotonic() > deadline:
            results["skipped"].append(part)
            continue
        print(f"\n== {part} ({time.monotonic() - start:.0f} s in)", flush=True)
        try:
            if part == "parity":
                results["parity"] = parity(args)
            elif part == "padding":
                results["padding"] = padding(args)
            elif part == "speed":
                # Leave the trainer's commands a minute and a half each when they are to run after.
                reserve = 0.0 if args.quick else 90.0 * len({"main", "emoji"} & set(args.parts))

                def publish(rows: list) -> None:
                    results["speed"], results["goals"] = speed_records(rows, args.device), goals(rows)
                    write()

                results["skipped"] += measure_speed(args, deadline - reserve, publish)
            else:
                later = [
                    other
                    for other in ("main", "emoji")
                    if other in args.parts and PARTS.index(other) > PARTS.index(part)
                ]
                timeout = max(deadline - time.monotonic() - 90.0 * len(later) * (not args.quick), 30.0)
                results[part] = run_command(part, args, timeout)
                if results[part]["returncode"] != 0:
                    results["errors"][part] = f"exit {results[part]['returncode']}"
        except Exception as error:  # the next parts still run; the traceback is printed
            traceback.print_exc()
            results["errors"][part] = f"{type(error).__name__}: {error}"
        write()
    write()
    print("\n" + markdown(results))
    print(f"Wrote {args.output} and {args.output.with_suffix('.md')} in {time.monotonic() - start:.0f} s")
    failed_parity = [r["model"] for r in results.get("parity", []) if not (r["fp32"]["ok"] and r["bf16"]["ok"])]
    return 1 if results["errors"] or failed_parity else 0


if __name__ == "__main__":
    sys.exit(main())
