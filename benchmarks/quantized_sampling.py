"""Sampling on a CPU with torch's dynamic int8 quantization of every nn.Linear, against float32 and bf16.

`torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)` stores each Linear's weight in int8
and quantizes its input on every call; everything else stays float32. Every layer of the MLP backbones is an
nn.Linear, the L×L token mixers included, while attention's two matmuls per block (QKᵀ and AV) are not layers and stay
float32. The script measures, in one interleaved window:

- for each model (default: U-ViT-S/2 and F2-deep at the papers' sizes, random weights), one classifier-free-guidance
  forward of the pipeline (2·B latents), eager, in float32, in bf16 autocast where the CPU runs it natively, and in
  int8: milliseconds per forward, the speed-up over U-ViT-S/2 in the same precision and over the model's own float32,
  and the prediction's relative error against float32 (‖ε̂ − ε̂_fp32‖ / ‖ε̂_fp32‖);
- the shipped shapes pipeline in float32 and in int8: the held-out captions it draws right (the shapes scorer) and
  its seconds per image at the pipeline's defaults.

    python benchmarks/quantized_sampling.py
    python benchmarks/quantized_sampling.py --models F2-deep 4E2H --batch_size 4

Run it on idle cores: only ratios measured in one window are claims.
"""

import argparse
import time
import warnings

import torch
from speed_vs_uvit import BASELINE, build, inputs, native_bf16, sampling_step, time_interleaved
from torch import nn
from torch.ao.quantization import quantize_dynamic

from diffusers_lmlp.commands import number
from diffusers_lmlp.cpu import this_cpu
from diffusers_lmlp.evaluation.captions import draw_captions
from diffusers_lmlp.models import named_configs
from diffusers_lmlp.shapes import pretrained_shapes_pipeline
from diffusers_lmlp.shapes.scorer import score_images


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=[BASELINE, "F2-deep"], help="named configs; U-ViT-S/2 is added")
    parser.add_argument("--batch_size", type=number(int, 1), default=8, help="images per CFG forward (2·B latents)")
    parser.add_argument("--repeats", type=number(int, 1), default=5, help="timed rounds per model and precision")
    parser.add_argument(
        "--num_captions", type=number(int, 1), default=32, help="held-out captions the shapes pipeline draws"
    )
    parser.add_argument("--num_inference_steps", type=number(int, 1), default=50, help="the shapes pipeline's steps")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.models) - set(named_configs()))
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose among {sorted(named_configs())}")
    args.models = list(dict.fromkeys([BASELINE, *args.models]))
    return args


def int8(model: nn.Module) -> nn.Module:
    """A copy of `model` with every nn.Linear dynamically quantized to int8."""
    with warnings.catch_warnings():  # torch 2.13 marks its eager quantization deprecated in favour of torchao
        warnings.simplefilter("ignore")
        return quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8, inplace=False)


def relative_error(prediction: torch.Tensor, reference: torch.Tensor) -> float:
    return ((prediction.float() - reference.float()).norm() / reference.float().norm()).item()


def backbone_rows(args: argparse.Namespace) -> list[dict]:
    """Each model's CFG forward in each precision, all timed in one interleaved window."""
    precisions = ["fp32", "bf16", "int8"] if native_bf16("cpu") else ["fp32", "int8"]
    steps, predictions = {}, {}
    for name in args.models:
        model = build(name).eval()
        data = inputs(model.config, args.batch_size, "cpu")
        runners = {"fp32": model, "bf16": model, "int8": int8(model)}
        for precision in precisions:
            step = sampling_step(runners[precision], data, "cpu", "bf16" if precision == "bf16" else "fp32")
            steps[name, precision] = step
            predictions[name, precision] = step()
    times = time_interleaved(steps, args.repeats, "cpu", warm_up=False)
    return [
        {
            "model": name,
            "precision": precision,
            "ms": 1000 * times[name, precision],
            "vs_baseline": times[BASELINE, precision] / times[name, precision],
            "vs_fp32": times[name, "fp32"] / times[name, precision],
            "error": relative_error(predictions[name, precision], predictions[name, "fp32"]),
        }
        for name, precision in steps
    ]


def shapes_rows(args: argparse.Namespace) -> list[dict]:
    """The shipped shapes pipeline in float32 and int8: held-out captions drawn right, and seconds per image."""
    captions = draw_captions("shapes:heldout", args.num_captions, seed=0)
    rows = []
    for precision in ("fp32", "int8"):
        pipe = pretrained_shapes_pipeline()
        pipe.set_progress_bar_config(disable=True)
        if precision == "int8":
            pipe.transformer = int8(pipe.transformer)
        images, start = [], time.perf_counter()
        for first in range(0, len(captions), 8):
            part = captions[first : first + 8]
            generator = [torch.Generator().manual_seed(first + i) for i in range(len(part))]
            images += pipe(part, num_inference_steps=args.num_inference_steps, generator=generator).images
        seconds = (time.perf_counter() - start) / len(captions)
        rows.append({"precision": precision, "scores": score_images(images, captions), "seconds": seconds})
    return rows


def main(argv: list[str] | None = None) -> tuple[list[dict], list[dict]]:
    args = parse_args(argv)
    torch.manual_seed(0)
    backbones = backbone_rows(args)
    print(f"CPU: {this_cpu().describe()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"\nOne CFG forward (batch {args.batch_size}, eager), best of {args.repeats} interleaved rounds:\n")
    print("| model | precision | ms | × U-ViT, same precision | × its float32 | error vs float32 |")
    print("|---|---|---:|---:|---:|---:|")
    for row in backbones:
        print(
            f"| {row['model']} | {row['precision']} | {row['ms']:.0f} | {row['vs_baseline']:.2f}× | "
            f"{row['vs_fp32']:.2f}× | {100 * row['error']:.2f}% |"
        )
    shapes = shapes_rows(args)
    print(
        f"\nThe shipped shapes pipeline, {args.num_captions} held-out captions, {args.num_inference_steps} steps, "
        "batches of 8:\n"
    )
    print("| precision | all four | shape | s per image |")
    print("|---|---:|---:|---:|")
    for row in shapes:
        scores = row["scores"]
        print(f"| {row['precision']} | {scores['all']:.0%} | {scores['shape']:.0%} | {row['seconds']:.3f} |")
    return backbones, shapes


if __name__ == "__main__":
    main()
