"""`python -m diffusers_lmlp.evaluation` (or `diffusers-lmlp-evaluate`): sample a pipeline and report FID, CLIP score
and an embedded world's accuracies. An interrupted run keeps its finished batches and a partial report; the same
command continues it. Parsing imports only light modules (diffusers, transformers and accelerate load in `main`).
"""

import argparse
import logging
import signal
import sys
import threading
from pathlib import Path

import torch

from .. import commands
from ..sampling import GUIDANCE_SCALE, NUM_INFERENCE_STEPS
from ..threads import set_threads
from ..worlds import WORLDS, load, pipeline_problem
from .captions import WORLD_SOURCES
from .extractors import EMOJI, INCEPTION, SHAPES


DEFAULT_CLIP_MODEL = "openai/clip-vit-large-patch14"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
CONSOLE_SCRIPT = "diffusers-lmlp-evaluate"  # setup.py's console script for this command
PROGRESS_FOLDER = "progress"  # under --output_dir: the finished batches of an unfinished evaluation
PARTIAL_REPORT = "report.partial.json"


def build_parser() -> argparse.ArgumentParser:
    """The command's arguments."""
    parser = argparse.ArgumentParser(
        prog=commands.program_name(CONSOLE_SCRIPT, "diffusers_lmlp.evaluation"),
        description="Sample a pipeline on captions and report FID, CLIP score and (on an embedded world) its "
        "scorer's accuracies. Run it with `accelerate launch -m diffusers_lmlp.evaluation ...` to share the "
        "sampling between processes. An interrupted run keeps its finished batches: run the same command again to "
        "continue.",
    )
    options = {
        "--pipeline": dict(required=True, help="a pipeline folder or Hub id, or shapes or emoji (shipped)"),
        "--captions": dict(
            help="a COCO-2014 folder (its annotations/captions_val2014.json, drawn as U-ViT's FID protocol), a "
            f"captions .json, a text file (one caption per line), or {', '.join(WORLD_SOURCES)} (default: the world "
            "of --pipeline shapes or emoji)"
        ),
        "--num_images": dict(
            type=int,
            help="images to sample (default: 30000 for COCO, 1000 for a world, each line once for a text file)",
        ),
        "--seed": dict(type=int, default=0, help="seeds the caption draw and every image's noise"),
        "--fid_reference": dict(
            help="what FID compares with: an .npz of mu/sigma (e.g. fid_stats_mscoco256_val.npz), a folder of real "
            "images (statistics cached), shapes or emoji (the world's real images of the same captions; the default "
            "for its captions), or 'none'"
        ),
        "--fid_extractor": dict(
            choices=(INCEPTION, SHAPES, EMOJI),
            help="the FID feature network (default: the world's for a world's reference, else inception, which needs "
            "torch-fidelity)",
        ),
        "--clip_model": dict(
            help=f"CLIP model id or folder, or 'none' (default: {DEFAULT_CLIP_MODEL}, the papers' ViT-L/14; the emoji "
            "CLIP for emoji captions, none for shapes captions)"
        ),
        "--num_inference_steps": dict(type=int, default=NUM_INFERENCE_STEPS, help="sampler steps per image"),
        "--guidance_scale": dict(type=float, default=GUIDANCE_SCALE, help="diffusers' g; the papers' s = g - 1"),
        "--batch_size": dict(type=int, default=50, help="images per pipeline call (per process)"),
        "--dtype": dict(choices=sorted(DTYPES), default="float32", help="the pipeline's dtype"),
        "--output_dir": dict(
            type=Path,
            default=Path("evaluation"),
            help="where report.json and grid.png go (and, while unfinished, progress/ and report.partial.json)",
        ),
        "--save_images": dict(action="store_true", help="also save every image under OUTPUT_DIR/images"),
        "--cache_dir": dict(type=Path, help="cache of reference statistics (default: $HF_HOME/diffusers_lmlp)"),
        "--num_threads": dict(
            type=int,
            help="torch's CPU threads (default on one CPU process: the OMP_NUM_THREADS you set, else every core; "
            "several processes keep what their launcher set)",
        ),
        "--keep_progress": dict(
            action="store_true",
            help="keep OUTPUT_DIR/progress after a finished run: the same command then reports again without "
            "sampling, e.g. against another --fid_reference of the same feature network",
        ),
        "--no_progress": dict(action="store_true", help="no progress bar"),
    }
    for option, settings in options.items():
        parser.add_argument(option, **settings)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The parsed arguments (`sys.argv[1:]` by default), with the defaults that depend on the captions filled in."""
    parser = build_parser()
    args = parser.parse_args(argv)
    check_pipeline(parser, args.pipeline)
    if args.captions is None:
        if args.pipeline not in WORLDS:
            parser.error("--captions is required (a COCO folder, a captions .json, a text file, shapes or emoji)")
        args.captions = args.pipeline
    world = WORLDS[args.captions.split(":")[0]] if args.captions in WORLD_SOURCES else None
    if args.fid_reference is None:
        args.fid_reference = world.name if world else "none"
    if args.clip_model is None:
        args.clip_model = (
            (str(load(world.clip_model)) if world.clip_model else "none") if world else DEFAULT_CLIP_MODEL
        )
    for option in ("num_images", "batch_size", "num_inference_steps", "num_threads"):
        if getattr(args, option) is not None and getattr(args, option) < 1:
            parser.error(f"--{option} must be positive; got {getattr(args, option)}")
    return args


def check_pipeline(parser: argparse.ArgumentParser, name: str) -> None:
    """Refuse a `--pipeline` that is a path to nothing (or to a file), rather than try it as a Hub repo id."""
    if problem := pipeline_problem(name):
        parser.error(problem)


def load_pipeline(name: str, dtype: torch.dtype):
    """The pipeline of `--pipeline`: a world's shipped one, a folder or a Hub id (`OSError` if it cannot be had)."""
    from huggingface_hub.errors import LocalEntryNotFoundError

    from ..pipelines import LMLPPipeline

    if name in WORLDS:
        return LMLPPipeline.from_pretrained(WORLDS[name].pipeline_path, dtype=dtype)
    try:
        return LMLPPipeline.from_pretrained(name, dtype=dtype)
    except (LocalEntryNotFoundError, FileNotFoundError) as error:
        raise OSError(f"--pipeline {name}: {error}") from None


class StopSignals:
    """Within it, the first SIGINT or SIGTERM raises `KeyboardInterrupt` and later ones (`accelerate launch` forwards
    each again, schedulers repeat SIGTERM) are ignored while progress is saved. Main thread only."""

    def __init__(self):
        self.received, self.previous = None, {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for number in (signal.SIGINT, signal.SIGTERM):
                self.previous[number] = signal.signal(number, self.stop)
        return self

    def stop(self, number: int, frame) -> None:
        if self.received is None:
            self.received = number
            raise KeyboardInterrupt

    def __exit__(self, *exception) -> None:
        for number, handler in self.previous.items():
            signal.signal(number, handler)

    @property
    def exit_code(self) -> int:
        """128 + the signal, as shells report a process stopped by it."""
        return 128 + (self.received or signal.SIGINT)


def summary_line(report: dict, output_dir: Path) -> str:
    """One line: the metrics, their settings and where the report is."""
    parts = []
    if "fid" in report:
        parts.append(f"FID {report['fid']:.2f} vs {report['fid_reference']} ({report['fid_extractor']})")
    if "fid_floor" in report:
        parts.append(f"real-vs-real floor {report['fid_floor']:.2f}")
    if "clip_score" in report:
        parts.append(f"CLIP score {report['clip_score']:.2f} ({report['clip_model']})")
    for world in WORLDS:
        if world in report:
            parts.append(", ".join(f"{key} {value:.1%}" for key, value in report[world].items()))
    sampler = report["sampler"]
    return (
        f"{report['model']}: {report['num_images']} images, {sampler['num_inference_steps']} steps, guidance "
        f"{sampler['guidance_scale']}: " + " · ".join(parts) + f" · report: {output_dir / 'report.json'}"
    )


def main(argv: list[str] | None = None) -> None:
    """Run the command on `argv` (`sys.argv[1:]` by default)."""
    args = parse_args(argv)
    logging.basicConfig(format="%(message)s")
    for name in ("diffusers_lmlp.evaluation", "diffusers_lmlp.threads", "diffusers_lmlp.allocator"):
        logging.getLogger(name).setLevel(logging.INFO)
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    from ..allocator import keep_freed_memory
    from ..pipelines.schedulers import check_scheduler
    from .captions import draw_captions
    from .evaluate import Processes, evaluate
    from .resume import EvaluationInterrupted, remove_progress, write_json_durably

    # Several CPU processes need ACCELERATE_USE_CPU=1, which `Accelerator` reads and `PartialState` does not.
    state = PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"))
    progress_dir = args.output_dir / PROGRESS_FOLDER
    with StopSignals() as signals:
        try:
            set_threads(args.num_threads, "evaluation", state.num_processes == 1 and state.device.type == "cpu")
            keep_freed_memory(state.device)
            captions = draw_captions(args.captions, args.num_images, args.seed)
            pipeline = load_pipeline(args.pipeline, DTYPES[args.dtype]).to(state.device)
            check_scheduler(pipeline.scheduler)  # before the FID reference's statistics, which can take hours
            report, grid = evaluate(
                pipeline,
                captions,
                fid_reference=None if args.fid_reference == "none" else args.fid_reference,
                fid_extractor=args.fid_extractor,
                clip_model=None if args.clip_model == "none" else args.clip_model,
                num_inference_steps=args.num_inference_steps,
                guidance_scale=args.guidance_scale,
                batch_size=args.batch_size,
                seed=args.seed,
                image_dir=args.output_dir / "images" if args.save_images else None,
                processes=Processes.from_state(state),
                cache_dir=args.cache_dir,
                progress=not args.no_progress,
                resume_dir=progress_dir,
            )
        except EvaluationInterrupted as interruption:
            if interruption.report is not None:
                write_json_durably(
                    args.output_dir / PARTIAL_REPORT, {**interruption.report, "captions": args.captions}
                )
                print(
                    f"Interrupted after {interruption.num_images_done} of {interruption.num_images} images. The "
                    f"finished batches are kept in {progress_dir} and reported on in "
                    f"{args.output_dir / PARTIAL_REPORT}; run the same command again to continue.",
                    file=sys.stderr,
                )
            sys.exit(signals.exit_code)
        except KeyboardInterrupt:
            if state.is_main_process:
                kept = f"; the finished batches are kept in {progress_dir}" if progress_dir.is_dir() else ""
                print(
                    f"Interrupted{kept}. Run the same command again to {'continue' if kept else 'start'}.",
                    file=sys.stderr,
                )
            sys.exit(signals.exit_code)
        except (ValueError, ImportError, OSError) as error:
            sys.exit(f"error: {error}")
    report["captions"] = args.captions
    if state.is_main_process:
        args.output_dir.mkdir(parents=True, exist_ok=True)
        write_json_durably(args.output_dir / "report.json", report)
        grid.save(args.output_dir / "grid.png")
        (args.output_dir / PARTIAL_REPORT).unlink(missing_ok=True)
        if not args.keep_progress:
            remove_progress(progress_dir)
        print(summary_line(report, args.output_dir))


if __name__ == "__main__":
    main()
