#!/usr/bin/env python
"""Train the shapes world's feature network (the Inception of "shapes-FID"), reproducibly, into the package.

    python scripts/train_shapes_features.py      # writes src/diffusers_lmlp/shapes/assets/features

The package's network was made by this command with the defaults: 114,180 parameters (0.46 MB), 1000 steps in
116 s on 2 idle CPU cores (`training_summary.json` records the seconds of the run that wrote it, on a shared machine),
every attribute right on all 2,000 fresh held-out renders. Equal arguments give bit-identical weights.

Every step renders a fresh batch drawn from all 324 combinations of the world (`all_specs()`, each render with the
world's own jitter) and trains the four heads of `ShapesFeatureNetwork` with cross-entropy. So that the features stay
meaningful on imperfect generated images, most images are augmented without changing what they show: a slight
Gaussian blur, brightness, contrast, saturation and per-channel colour shifts, and Gaussian pixel noise.

Evaluation: per-attribute and all-four accuracy on fresh renders of a seed never used in training, clean and
augmented, and on samples of the shipped pipeline (one per combination). The pipeline often draws the wrong shape,
so its samples are no ground truth: their rows compare the network with the deterministic scorer's reading
(`diffusers_lmlp.shapes.scorer.read_image`) and with the captions. The accuracies, the command, the steps and the
seconds go to `training_summary.json` beside the weights.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from diffusers_lmlp.shapes import pretrained_shapes_pipeline
from diffusers_lmlp.shapes.features import ATTRIBUTES, FEATURES_PATH, ShapesFeatureNetwork
from diffusers_lmlp.shapes.scorer import read_image
from diffusers_lmlp.shapes.world import ShapeSpec, all_specs, render


CLEAN_FRACTION = 0.25  # share of training images left unaugmented
MAX_BLUR_SIGMA = 0.9  # pixels
MAX_NOISE_STD = 0.08
MAX_BRIGHTNESS = 0.08  # additive, on [0, 1] pixels
MAX_CONTRAST = 0.2  # relative, around each image's mean
MAX_CHANNEL_SHIFT = 0.04  # additive, per channel
SATURATION_RANGE = (0.7, 1.15)  # scale of each pixel's offset from its grey value
PIPELINE_BATCH = 108  # captions per call of the shipped pipeline
EVAL_SEED_OFFSET = 1000  # evaluation renders use `seed + EVAL_SEED_OFFSET`, never a training seed


def spec_labels(specs: list[ShapeSpec]) -> torch.Tensor:
    """Labels (N, 4), one column per attribute of `ATTRIBUTES`, in its order."""
    return torch.tensor([[values.index(getattr(spec, name)) for name, values in ATTRIBUTES.items()] for spec in specs])


def render_batch(specs: list[ShapeSpec], rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Jittered renders and their labels.

    Returns:
        `tuple[torch.Tensor, torch.Tensor]`: images (N, 3, 32, 32) in [0, 1] and labels (N, 4) from `spec_labels`.
    """
    pixels = np.stack([np.asarray(render(spec, rng=rng), dtype=np.float32) for spec in specs])  # (N, H, W, 3)
    images = torch.from_numpy(pixels / 255.0).permute(0, 3, 1, 2).contiguous()  # (N, 3, H, W)
    return images, spec_labels(specs)


def uniform(generator: torch.Generator, low: float, high: float, *shape: int) -> torch.Tensor:
    """Uniform samples in [low, high)."""
    return low + (high - low) * torch.rand(shape, generator=generator)


def gaussian_blur(images: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """Blur each image with its own Gaussian (separable, 5 taps, replicated border).

    Args:
        images (`torch.Tensor`): (B, 3, H, W).
        sigmas (`torch.Tensor`): (B,) standard deviations in pixels; 0 leaves the image as it is.
    """
    b, c, h, w = images.shape
    taps = torch.arange(-2, 3, dtype=images.dtype)  # (5,)
    kernels = torch.exp(-(taps**2) / (2 * sigmas.clamp_min(1e-3)[:, None] ** 2))  # (B, 5)
    kernels = (kernels / kernels.sum(dim=1, keepdim=True)).repeat_interleave(c, dim=0)  # (B·3, 5)
    hidden = F.pad(images.reshape(1, b * c, h, w), (2, 2, 2, 2), mode="replicate")  # (1, B·3, H + 4, W + 4)
    hidden = F.conv2d(hidden, kernels[:, None, None, :], groups=b * c)  # (1, B·3, H + 4, W)
    hidden = F.conv2d(hidden, kernels[:, None, :, None], groups=b * c)  # (1, B·3, H, W)
    return hidden.reshape(b, c, h, w)


def augment(images: torch.Tensor, generator: torch.Generator, clean_fraction: float = CLEAN_FRACTION) -> torch.Tensor:
    """Perturb images the way generated ones differ from renders, keeping what they show.

    Args:
        images (`torch.Tensor`): (B, 3, H, W) in [0, 1].
        generator (`torch.Generator`): Source of every random draw.
        clean_fraction (`float`, *optional*, defaults to `CLEAN_FRACTION`): Share of images returned unchanged.

    Returns:
        `torch.Tensor`: (B, 3, H, W) in [0, 1].
    """
    b = len(images)
    out = gaussian_blur(images, uniform(generator, 0.0, MAX_BLUR_SIGMA, b))
    grey = out.mean(dim=1, keepdim=True)  # (B, 1, H, W)
    out = grey + uniform(generator, *SATURATION_RANGE, b, 1, 1, 1) * (out - grey)
    mean = out.mean(dim=(1, 2, 3), keepdim=True)  # (B, 1, 1, 1)
    out = mean + uniform(generator, 1 - MAX_CONTRAST, 1 + MAX_CONTRAST, b, 1, 1, 1) * (out - mean)
    out = out + uniform(generator, -MAX_BRIGHTNESS, MAX_BRIGHTNESS, b, 1, 1, 1)
    out = out + uniform(generator, -MAX_CHANNEL_SHIFT, MAX_CHANNEL_SHIFT, b, 3, 1, 1)
    out = out + uniform(generator, 0.0, MAX_NOISE_STD, b, 1, 1, 1) * torch.randn(out.shape, generator=generator)
    clean = torch.rand(b, 1, 1, 1, generator=generator) < clean_fraction
    return torch.where(clean, images, out.clamp(0.0, 1.0))


@torch.no_grad()
def predict(network: ShapesFeatureNetwork, images: torch.Tensor) -> torch.Tensor:
    """Predicted labels (N, 4), in the order of `ATTRIBUTES`."""
    logits = [network.classify(batch) for batch in images.split(500)]
    return torch.stack([torch.cat([x[name] for x in logits]).argmax(dim=1) for name in ATTRIBUTES], dim=1)


def accuracies(predicted: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """Per-attribute accuracy and "all" (all four right) of (N, 4) predicted against (N, 4) true labels."""
    correct = predicted == labels  # (N, 4)
    scores = {name: correct[:, i].float().mean().item() for i, name in enumerate(ATTRIBUTES)}
    scores["all"] = correct.all(dim=1).float().mean().item()
    return scores


def pipeline_scores(network: ShapesFeatureNetwork, seed: int) -> dict[str, dict[str, float]]:
    """The network on one sample of the shipped pipeline per combination: agreement with the scorer and the captions.

    Returns:
        `dict`: "vs scorer" (images where the scorer sees a shape) and "vs caption", each per attribute and "all".
    """
    pipe = pretrained_shapes_pipeline()
    pipe.set_progress_bar_config(disable=True)
    specs = all_specs()
    captions = [spec.caption for spec in specs]
    generator = torch.Generator().manual_seed(seed)
    batches = [
        pipe(captions[i : i + PIPELINE_BATCH], num_inference_steps=20, output_type="pt", generator=generator).images
        for i in range(0, len(captions), PIPELINE_BATCH)
    ]
    images = torch.cat(batches).float().clamp(0, 1)  # (324, 3, 32, 32)
    predicted = predict(network, images)  # (324, 4)
    readings = [read_image((image.permute(1, 2, 0).numpy() * 255).round()) for image in images]
    seen = [i for i, reading in enumerate(readings) if reading is not None]
    return {
        "vs scorer": accuracies(predicted[seen], spec_labels([ShapeSpec(**readings[i]) for i in seen])),
        "vs caption": accuracies(predicted, spec_labels(specs)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--num-eval-images", type=int, default=2000)
    parser.add_argument("--skip-pipeline", action="store_true", help="do not evaluate on the pipeline's samples")
    parser.add_argument("--output-dir", type=Path, default=FEATURES_PATH)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    specs = all_specs()
    network = ShapesFeatureNetwork()
    optimizer = torch.optim.AdamW(network.parameters(), lr=args.lr, weight_decay=1e-4)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=args.steps, pct_start=0.1)
    start = time.perf_counter()
    for _ in (progress := tqdm(range(args.steps), desc="training the shapes feature network")):
        images, labels = render_batch([specs[i] for i in rng.integers(0, len(specs), args.batch_size)], rng)
        logits = network.classify(augment(images, generator))
        loss = sum(F.cross_entropy(logits[name], labels[:, i]) for i, name in enumerate(ATTRIBUTES))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        progress.set_postfix(loss=f"{loss.item():.4f}")
    train_seconds = time.perf_counter() - start

    network.eval()
    eval_rng = np.random.default_rng(args.seed + EVAL_SEED_OFFSET)
    eval_specs = [specs[i % len(specs)] for i in eval_rng.permutation(args.num_eval_images)]
    images, labels = render_batch(eval_specs, eval_rng)
    eval_generator = torch.Generator().manual_seed(args.seed + EVAL_SEED_OFFSET)
    augmented = augment(images, eval_generator, clean_fraction=0.0)
    scores = {
        "renders (clean)": accuracies(predict(network, images), labels),
        "renders (augmented)": accuracies(predict(network, augmented), labels),
    }
    if not args.skip_pipeline:
        scores.update({f"pipeline {k}": v for k, v in pipeline_scores(network, args.seed + EVAL_SEED_OFFSET).items()})

    network.save_pretrained(args.output_dir)
    num_parameters = sum(p.numel() for p in network.parameters())
    summary = {
        "command": " ".join(["python", "scripts/train_shapes_features.py", *sys.argv[1:]]),
        "seed": args.seed,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "train_seconds": round(train_seconds, 1),
        "num_parameters": num_parameters,
        "num_eval_images": args.num_eval_images,
        "eval_seed": args.seed + EVAL_SEED_OFFSET,
        "accuracy": {name: {k: round(v, 4) for k, v in values.items()} for name, values in scores.items()},
    }
    (args.output_dir / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")

    columns = [*ATTRIBUTES, "all"]
    print(f"\n{'':24}" + "".join(f"{c:>10}" for c in columns))
    for name, values in scores.items():
        print(f"{name:24}" + "".join(f"{values[c]:10.4f}" for c in columns))
    print(
        f"saved {args.output_dir}: {num_parameters:,} parameters, {args.steps} steps of {args.batch_size} in "
        f"{train_seconds:.0f} s"
    )


if __name__ == "__main__":
    main()
