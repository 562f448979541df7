"""`python -m diffusers_lmlp.evaluation` (or `diffusers-lmlp-evaluate`): sample a pipeline and report FID, CLIP score
and, on the shapes world, the shapes scorer's accuracies.

    # The shipped shapes pipeline, offline: shapes-FID against renders of the same captions, and the accuracies.
    python -m diffusers_lmlp.evaluation --pipeline shapes

    # COCO FID-30k as U-ViT measures it, on 8 GPUs, against the published statistics.
    accelerate launch --multi_gpu --num_processes 8 -m diffusers_lmlp.evaluation --pipeline user/repo \\
        --captions /data/coco --fid_reference fid_stats_mscoco256_val.npz
"""

import argparse
import json
import sys
from pathlib import Path

import torch

from .captions import SHAPES_SOURCES, draw_captions
from .evaluate import Processes, evaluate
from .extractors import INCEPTION, SHAPES
from .reference import SHAPES_REFERENCE


SHIPPED_SHAPES_PIPELINE = "shapes"
DEFAULT_CLIP_MODEL = "openai/clip-vit-large-patch14"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m diffusers_lmlp.evaluation",
        description="Sample a pipeline on captions and report FID, CLIP score and (on the shapes world) the shapes "
        "scorer's accuracies. Run it with `accelerate launch -m diffusers_lmlp.evaluation ...` to share the "
        "sampling between processes.",
    )
    parser.add_argument(
        "--pipeline", required=True,
        help=f"a pipeline folder or Hub id; {SHIPPED_SHAPES_PIPELINE!r} is the shapes pipeline shipped in the package",
    )  # fmt: skip
    parser.add_argument(
        "--captions",
        help=f"a COCO-2014 folder (its annotations/captions_val2014.json, drawn as U-ViT's FID protocol), a captions "
        f".json, a text file (one caption per line), or {', '.join(sorted(SHAPES_SOURCES))} "
        f"(default: 'shapes' for --pipeline {SHIPPED_SHAPES_PIPELINE})",
    )
    parser.add_argument(
        "--num_images", type=int,
        help="images to sample (default: 30000 for COCO, 1000 for the shapes world, each line once for a text file)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="seeds the caption draw and every image's noise")
    parser.add_argument(
        "--fid_reference",
        help="what FID compares with: an .npz of mu/sigma (e.g. fid_stats_mscoco256_val.npz), a folder of real "
        f"images (statistics computed once and cached), {SHAPES_REFERENCE!r} (renders of the same captions; the "
        "default for shapes captions), or 'none'",
    )
    parser.add_argument(
        "--fid_extractor", choices=(INCEPTION, SHAPES),
        help="the FID feature network (default: shapes for the shapes reference, else inception, which needs "
        "torch-fidelity)",
    )  # fmt: skip
    parser.add_argument(
        "--clip_model",
        help=f"CLIP model id or folder for the CLIP score, or 'none' (default: {DEFAULT_CLIP_MODEL}, the "
        "papers' ViT-L/14; none for shapes captions)",
    )
    parser.add_argument("--num_inference_steps", type=int, default=50)
    parser.add_argument("--guidance_scale", type=float, default=2.0, help="diffusers' g; the papers' s = g - 1")
    parser.add_argument("--batch_size", type=int, default=50, help="images per pipeline call (per process)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="the pipeline's dtype")
    parser.add_argument(
        "--output_dir", type=Path, default=Path("evaluation"), help="where report.json and grid.png go"
    )
    parser.add_argument("--save_images", action="store_true", help="also save every image under OUTPUT_DIR/images")
    parser.add_argument(
        "--cache_dir", type=Path, help="cache of reference statistics (default: $HF_HOME/diffusers_lmlp)"
    )
    parser.add_argument("--no_progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.captions is None:
        if args.pipeline != SHIPPED_SHAPES_PIPELINE:
            parser.error("--captions is required (a COCO folder, a captions .json, a text file, or shapes)")
        args.captions = "shapes"
    shapes = args.captions in SHAPES_SOURCES
    if args.fid_reference is None:
        args.fid_reference = SHAPES_REFERENCE if shapes else "none"
    if args.clip_model is None:
        args.clip_model = "none" if shapes else DEFAULT_CLIP_MODEL
    for option in ("num_images", "batch_size", "num_inference_steps"):
        if getattr(args, option) is not None and getattr(args, option) < 1:
            parser.error(f"--{option} must be positive; got {getattr(args, option)}")
    return args


def load_pipeline(name: str, dtype: torch.dtype):
    """The pipeline of `--pipeline`: the shipped shapes pipeline, a folder or a Hub id."""
    if name == SHIPPED_SHAPES_PIPELINE:
        from ..shapes import pretrained_shapes_pipeline

        return pretrained_shapes_pipeline(dtype=dtype)
    from ..pipelines import LMLPPipeline

    return LMLPPipeline.from_pretrained(name, dtype=dtype)


def summary_line(report: dict, output_dir: Path) -> str:
    """One line: the metrics, their settings and where the report is."""
    parts = []
    if "fid" in report:
        parts.append(f"FID {report['fid']:.2f} vs {report['fid_reference']} ({report['fid_extractor']})")
    if "fid_floor" in report:
        parts.append(f"real-vs-real floor {report['fid_floor']:.2f}")
    if "clip_score" in report:
        parts.append(f"CLIP score {report['clip_score']:.2f} ({report['clip_model']})")
    if "shapes" in report:
        parts.append(", ".join(f"{key} {value:.1%}" for key, value in report["shapes"].items()))
    sampler = report["sampler"]
    return (
        f"{report['model']}: {report['num_images']} images, {sampler['num_inference_steps']} steps, guidance "
        f"{sampler['guidance_scale']}: " + " · ".join(parts) + f" · report: {output_dir / 'report.json'}"
    )


def main(argv: list[str] | None = None) -> None:
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    args = parse_args(argv)
    # Several CPU processes need ACCELERATE_USE_CPU=1, which `Accelerator` reads and `PartialState` does not.
    state = PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"))
    try:
        captions = draw_captions(args.captions, args.num_images, args.seed)
        pipeline = load_pipeline(args.pipeline, DTYPES[args.dtype]).to(state.device)
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
        )
    except (ValueError, ImportError, OSError) as error:
        sys.exit(f"error: {error}")
    report["captions"] = args.captions
    if state.is_main_process:
        args.output_dir.mkdir(parents=True, exist_ok=True)
        with open(args.output_dir / "report.json", "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
        grid.save(args.output_dir / "grid.png")
        print(summary_line(report, args.output_dir))


if __name__ == "__main__":
    main()
