"""`python -m diffusers_lmlp.evaluation` (or `diffusers-lmlp-evaluate`): sample a pipeline and report FID, CLIP score
and an embedded world's accuracies; the same command continues an interrupted run. Heavy imports wait for `main`."""

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


DEFAULT_CLIP_MODEL = "openai/clip-vit-large-patch14"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
CONSOLE_SCRIPT = "diffusers-lmlp-evaluate"
PROGRESS_FOLDER = "progress"  # under --output_dir: the finished batches of an unfinished evaluation
PARTIAL_REPORT = "report.partial.json"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=commands.program_name(CONSOLE_SCRIPT, "diffusers_lmlp.evaluation"),
        description="Sample a pipeline on captions and report FID, CLIP score and (on an embedded world) its "
        "scorer's accuracies; `accelerate launch -m diffusers_lmlp.evaluation ...` shares the sampling between "
        "processes. Run an interrupted command again to continue it.",
    )
    options = {
        "--pipeline": dict(required=True, help="a pipeline folder or Hub id, or shapes or emoji (shipped)"),
        "--captions": dict(help="a COCO-2014 folder (drawn as U-ViT's FID protocol), a captions .json, a text file "
                           f"(one caption per line), or {', '.join(WORLD_SOURCES)} (default: the world of --pipeline "
                           "shapes or emoji)"),
        "--num_images": dict(type=int, help="images to sample (default: 30000 for COCO, 1000 for a world, each line "
                             "once for a file)"),
        "--seed": dict(type=int, default=0, help="seeds the caption draw and every image's noise"),
        "--fid_reference": dict(
            help="what FID compares with: an .npz of mu/sigma, a folder of real images (statistics cached), shapes or "
            "emoji (the world's real images of the same captions; the default for them), or 'none'"
        ),
        "--fid_extractor": dict(choices=("inception", "shapes", "emoji"),
                                help="the FID network (default: the world's, else inception)"),
        "--clip_model": dict(help=f"CLIP model id or folder, or 'none' (default: {DEFAULT_CLIP_MODEL}; the world's "
                             "for its captions)"),
        "--num_inference_steps": dict(type=int, default=NUM_INFERENCE_STEPS, help="sampler steps per image"),
        "--guidance_scale": dict(type=float, default=GUIDANCE_SCALE, help="diffusers' g; the papers' s = g - 1"),
        "--batch_size": dict(type=int, default=50, help="images per pipeline call (per process)"),
        "--dtype": dict(choices=sorted(DTYPES), default="float32", help="the pipeline's dtype"),
        "--output_dir": dict(type=Path, default=Path("evaluation"), help="where report.json, grid.png, progress/ go"),
        "--save_images": dict(action="store_true", help="also save every image under OUTPUT_DIR/images"),
        "--cache_dir": dict(type=Path, help="cache of reference statistics (default: $HF_HOME/diffusers_lmlp)"),
        "--num_threads": dict(type=int, help="torch's CPU threads (default on one CPU process: $OMP_NUM_THREADS, "
                              "else every core)"),
        "--keep_progress": dict(action="store_true", help="keep OUTPUT_DIR/progress after a finished run, to report "
                                "again without sampling"),
        "--no_progress": dict(action="store_true", help="no progress bar"),
    }  # fmt: skip
    for option, settings in options.items():
        parser.add_argument(option, **settings)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The parsed arguments, with the defaults that depend on the captions filled in."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if problem := pipeline_problem(args.pipeline):  # a path to nothing is not tried as a Hub id
        parser.error(problem)
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


class StopSignals:
    """Within it, the first SIGINT or SIGTERM raises `KeyboardInterrupt`; later ones (`accelerate launch` forwards
    each again, schedulers repeat SIGTERM) are ignored while progress is saved. Main thread only."""

    def __enter__(self) -> "StopSignals":
        self.received, self.previous = None, {}
        if threading.current_thread() is threading.main_thread():
            self.previous = {number: signal.signal(number, self.stop) for number in (signal.SIGINT, signal.SIGTERM)}
        return self

    def stop(self, number: int, frame) -> None:
        if self.received is None:
            self.received = number
            raise KeyboardInterrupt

    def __exit__(self, *exception) -> None:
        for number, handler in self.previous.items():
            signal.signal(number, handler)


def summary_line(report: dict, output_dir: Path) -> str:
    parts = []
    if "fid" in report:
        parts.append(f"FID {report['fid']:.2f} vs {report['fid_reference']} ({report['fid_extractor']})")
    if "fid_floor" in report:
        parts.append(f"real-vs-real floor {report['fid_floor']:.2f}")
    if "clip_score" in report:
        parts.append(f"CLIP score {report['clip_score']:.2f} ({report['clip_model']})")
    parts += [", ".join(f"{key} {value:.1%}" for key, value in report[w].items()) for w in WORLDS if w in report]
    sampler = report["sampler"]
    return (
        f"{report['model']}: {report['num_images']} images, {sampler['num_inference_steps']} steps, guidance "
        f"{sampler['guidance_scale']}: " + " · ".join(parts) + f" · report: {output_dir / 'report.json'}"
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(format="%(message)s")
    for name in ("diffusers_lmlp.evaluation", "diffusers_lmlp.threads", "diffusers_lmlp.allocator"):
        logging.getLogger(name).setLevel(logging.INFO)
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env
    from huggingface_hub.errors import LocalEntryNotFoundError

    from ..allocator import keep_freed_memory
    from ..durable import write_json_durably
    from ..pipelines import LMLPPipeline
    from ..pipelines.schedulers import check_scheduler
    from .captions import draw_captions
    from .evaluate import Processes, evaluate
    from .resume import EvaluationInterrupted, remove_progress

    # Several CPU processes need ACCELERATE_USE_CPU=1, which `Accelerator` reads and `PartialState` does not.
    state = PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"))
    progress_dir, partial_report = args.output_dir / PROGRESS_FOLDER, args.output_dir / PARTIAL_REPORT
    with StopSignals() as signals:
        try:
            set_threads(args.num_threads, "evaluation", state.num_processes == 1 and state.device.type == "cpu")
            keep_freed_memory(state.device)
            captions = draw_captions(args.captions, args.num_images, args.seed)
            path = WORLDS[args.pipeline].pipeline_path if args.pipeline in WORLDS else args.pipeline
            try:
                pipeline = LMLPPipeline.from_pretrained(path, dtype=DTYPES[args.dtype])
            except (LocalEntryNotFoundError, FileNotFoundError) as error:
                raise OSError(f"--pipeline {args.pipeline}: {error}") from None
            pipeline = pipeline.to(state.device)
            check_scheduler(pipeline.scheduler)  # before the FID reference's statistics, which can take hours
            report, grid = evaluate(
                pipeline, captions, fid_reference=None if args.fid_reference == "none" else args.fid_reference,
                fid_extractor=args.fid_extractor, clip_model=None if args.clip_model == "none" else args.clip_model,
                num_inference_steps=args.num_inference_steps, guidance_scale=args.guidance_scale,
                batch_size=args.batch_size, seed=args.seed,
                image_dir=args.output_dir / "images" if args.save_images else None,
                processes=Processes(state.process_index, state.num_processes, state.device),
                cache_dir=args.cache_dir, progress=not args.no_progress, resume_dir=progress_dir,
            )  # fmt: skip
        except KeyboardInterrupt as interruption:
            if isinstance(interruption, EvaluationInterrupted) and interruption.report is not None:
                write_json_durably(partial_report, {**interruption.report, "captions": args.captions})
                print(
                    f"Interrupted after {interruption.num_images_done} of {interruption.num_images} images. The "
                    f"finished batches are kept in {progress_dir} and reported on in {partial_report}; run the same "
                    "command again to continue.",
                    file=sys.stderr,
                )
            elif not isinstance(interruption, EvaluationInterrupted) and state.is_main_process:
                kept = f"; the finished batches are kept in {progress_dir}" if progress_dir.is_dir() else ""
                print(f"Interrupted{kept}. Run the same command again to {'continue' if kept else 'start'}.",
                      file=sys.stderr)  # fmt: skip
            sys.exit(128 + (signals.received or signal.SIGINT))  # as shells report a process a signal stopped
        except (ValueError, ImportError, OSError) as error:
            sys.exit(f"error: {error}")
    report["captions"] = args.captions
    if state.is_main_process:
        args.output_dir.mkdir(parents=True, exist_ok=True)
        write_json_durably(args.output_dir / "report.json", report)
        grid.save(args.output_dir / "grid.png")
        partial_report.unlink(missing_ok=True)
        if not args.keep_progress:
            remove_progress(progress_dir)
        print(summary_line(report, args.output_dir))


if __name__ == "__main__":
    main()
