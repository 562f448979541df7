"""A second reader of shapes-world images, and how far it agrees with the package's scorer on a pipeline's samples.

The package's scorer (`diffusers_lmlp.shapes.scorer`) reads an image by matching it against the world's own renders
of each shape. This reader shares neither code nor method with it, and knows the world only as its documentation
describes it (six named colours, circles, squares and triangles pointing up, a 3×3 grid of positions, two sizes). It
measures the image's geometry:

- the background is the median of the border, and each pixel's coverage α its distance from the background over
  that of the shape's core (the 8 pixels farthest from it), clipped to [0, 1];
- the α map is upsampled 8 times (bilinear) and cut at α = 1/2, which gives the shape's outline to a fraction of a
  pixel. Its bounding box gives the position: the 3×3 cell of the box's centre. The shape is a triangle when the
  outline's area lies low in its box (the world's triangles point up: their centroid is a sixth of the box's height
  below its centre, a circle's and a square's at it), else a circle or a square by the share of the box it fills
  (π/4 against 1);
- the size is the half side r of the shape's bounding box from its area Σα, which blur and anti-aliasing keep
  (πr² for a circle, 4r² for a square, 2r² for a triangle), against 0.35 of a cell, midway between the world's 0.28
  and 0.42;
- the colour is the hue of the core's mean colour, the nearest of the six named hues.

It writes its own captions of the combinations (a phrasing of each drawn with its own seed) and samples them with
seeds of its own, then scores every image with both readers.

    python benchmarks/scorer_agreement.py              # the shipped shapes pipeline, at its default sampler settings
    python benchmarks/scorer_agreement.py --pipeline lmlp-shapes --output_dir scorer-agreement
"""

import argparse
import colorsys
import inspect
import json
import math
from pathlib import Path

import numpy as np
import torch
from PIL import Image


# The world's colours by name, as hues in degrees.
HUES = {"red": 0.0, "yellow": 60.0, "green": 120.0, "cyan": 180.0, "blue": 240.0, "magenta": 300.0}
POSITIONS = ("top left", "top", "top right", "left", "center", "right", "bottom left", "bottom", "bottom right")
# Half the side of a shape's bounding box, in cells, above which it is large.
LARGE_HALF_SIDE = 0.35
# How far below its box's centre an outline's centroid lies, in box heights, above which it is a triangle (1/6 for a
# triangle pointing up, 0 for a circle or square).
TRIANGLE_DROP = 0.06
# The share of its bounding box a circle fills (π/4 ≈ 0.79) and a square (1); the cut is midway.
SQUARE_FILL = (np.pi / 4 + 1) / 2
# A shape's area over the square of its half side r.
AREA_OVER_R2 = {"circle": np.pi, "square": 4.0, "triangle": 2.0}
UPSAMPLING = 8
CORE_PIXELS = 8
# Below this largest distance from the background (RGB in [0, 1]), the image shows no shape.
MIN_CONTRAST = 0.1
ATTRIBUTES = ("colour", "shape", "position", "size")


def read_shape(image: Image.Image) -> dict[str, str | float] | None:
    """What an image of the world shows, read from its geometry: its colour, shape, position and size, with the
    measures the shape was told by (`drop` and `fill`); None when nothing stands out from the background.

    Args:
        image (`PIL.Image.Image`): An RGB image of the world.
    """
    rgb = np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0  # (S, S, 3)
    side = rgb.shape[0]
    border = np.concatenate([rgb[0], rgb[-1], rgb[:, 0], rgb[:, -1]])  # (4·S, 3)
    distance = np.linalg.norm(rgb - np.median(border, axis=0), axis=-1)  # (S, S)
    core = np.argsort(distance, axis=None)[-CORE_PIXELS:]
    core_distance = float(np.median(distance.flat[core]))
    if core_distance < MIN_CONTRAST:
        return None
    alpha = np.clip(distance / core_distance, 0.0, 1.0)  # (S, S)
    fine = Image.fromarray(alpha.astype(np.float32)).resize((side * UPSAMPLING,) * 2, Image.Resampling.BILINEAR)
    rows, columns = np.nonzero(np.asarray(fine) >= 0.5)  # the outline's pixels, in the (8·S, 8·S) map
    top, bottom, left, right = rows.min(), rows.max() + 1, columns.min(), columns.max() + 1
    drop = (rows.mean() + 0.5 - (top + bottom) / 2) / (bottom - top)
    fill = len(rows) / ((bottom - top) * (right - left))
    shape = "triangle" if drop > TRIANGLE_DROP else "square" if fill > SQUARE_FILL else "circle"
    cell = side * UPSAMPLING / 3
    row, column = (min(int((low + high) / 2 // cell), 2) for low, high in ((top, bottom), (left, right)))
    half_side = np.sqrt(alpha.sum() / AREA_OVER_R2[shape]) / (side / 3)
    hue = 360.0 * colorsys.rgb_to_hsv(*rgb.reshape(-1, 3)[core].mean(axis=0))[0]
    colour = min(HUES, key=lambda name: min(abs(hue - HUES[name]), 360.0 - abs(hue - HUES[name])))
    return {
        "colour": colour,
        "shape": shape,
        "position": POSITIONS[3 * row + column],
        "size": "large" if half_side > LARGE_HALF_SIDE else "small",
        "drop": round(float(drop), 3),
        "fill": round(float(fill), 3),
    }


def own_captions(seed: int) -> dict[str, list[tuple]]:
    """The combinations to sample, `(ShapeSpec, caption)` by split, each caption in a phrasing drawn with `seed`: all
    32 held-out combinations, and as many training ones drawn with it.

    Args:
        seed (`int`): The draws' seed.
    """
    from diffusers_lmlp.shapes.world import held_out_specs, phrasings, train_specs

    rng = np.random.default_rng(seed)
    held_out, train = held_out_specs(), train_specs()
    chosen = {"held-out": held_out, "train": [train[i] for i in rng.choice(len(train), len(held_out), replace=False)]}
    return {split: [(spec, str(rng.choice(phrasings(spec)))) for spec in specs] for split, specs in chosen.items()}


def verdicts(reading: dict | None, spec) -> dict[str, bool]:
    """Whether a reading shows each attribute the spec states (all wrong when nothing was read).

    Args:
        reading (`dict`, *optional*): `read_shape`'s reading.
        spec (`ShapeSpec`): What the caption asked for.
    """
    stated = [key for key in ATTRIBUTES if getattr(spec, key) is not None]
    return {key: reading is not None and reading[key] == getattr(spec, key) for key in stated}


def summary(records: list[dict]) -> dict[str, dict[str, float]]:
    """Each scorer's accuracy of each attribute, "colour+position" and "all", and the share of images on which the
    two scorers' verdicts are the same, by attribute.

    Args:
        records (`list[dict]`): One record per image, with the verdicts `"package"` and `"independent"`.
    """
    from diffusers_lmlp.shapes.scorer import accuracies

    scores = {name: accuracies([r[name] for r in records]) for name in ("package", "independent")}

    def joint(verdict: dict[str, bool], key: str) -> bool:
        if key == "colour+position":
            return verdict["colour"] and verdict["position"]
        return all(verdict.values()) if key == "all" else verdict[key]

    scores["agree"] = {
        key: float(np.mean([joint(r["package"], key) == joint(r["independent"], key) for r in records]))
        for key in scores["package"]
    }
    return scores


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pipeline", help="a saved shapes pipeline's folder (default: the one the package ships)")
    parser.add_argument("--output_dir", type=Path, default=Path("scorer-agreement"), help="results.json and grids")
    parser.add_argument("--seed", type=int, default=1128, help="seed of the captions' phrasings and the samples")
    parser.add_argument(
        "--images_per_caption",
        type=int,
        nargs=2,
        default=(4, 3),
        metavar=("HELD_OUT", "TRAIN"),
        help="samples of each held-out and each training caption (the issue's protocol: 4 and 3)",
    )
    parser.add_argument("--num_inference_steps", type=int, help="sampler steps (default: the pipeline's, 50)")
    parser.add_argument(
        "--guidance_scale", type=float, help="classifier-free guidance, diffusers' g (default: the pipeline's, 2)"
    )
    parser.add_argument("--batch_size", type=int, default=32)
    args = parser.parse_args(argv)
    if min(args.images_per_caption) < 1 or args.batch_size < 1 or (args.num_inference_steps or 1) < 1:
        parser.error("--images_per_caption, --batch_size and --num_inference_steps must be positive")
    if args.guidance_scale is not None and not math.isfinite(args.guidance_scale):
        parser.error(f"--guidance_scale must be a finite number, not {args.guidance_scale}")
    return args


def sampler_settings(args: argparse.Namespace, pipe) -> dict[str, int | float]:
    """The sampler's steps and guidance: the ones given, else the pipeline's defaults.

    Args:
        args (`argparse.Namespace`): The parsed arguments.
        pipe (`LMLPPipeline`): The pipeline.
    """
    defaults = inspect.signature(type(pipe).__call__).parameters
    return {
        name: getattr(args, name) if getattr(args, name) is not None else defaults[name].default
        for name in ("num_inference_steps", "guidance_scale")
    }


def round_trips(vae, images: list[Image.Image]) -> list[Image.Image]:
    """The images encoded and decoded by the pipeline's VAE: the best the pipeline can draw them.

    Args:
        vae (`AutoencoderKL`): The pipeline's VAE.
        images (`list[PIL.Image.Image]`): RGB images.
    """
    pixels = np.stack([np.asarray(image, dtype=np.float32) / 127.5 - 1.0 for image in images])  # (N, S, S, 3)
    with torch.no_grad():
        latents = vae.encode(torch.from_numpy(pixels).permute(0, 3, 1, 2).to(vae.dtype)).latent_dist.mode()
        decoded = vae.decode(latents).sample.float().clamp(-1.0, 1.0)  # (N, 3, S, S)
    as_bytes = ((decoded.permute(0, 2, 3, 1) + 1.0) * 127.5).round().to(torch.uint8).numpy()  # (N, S, S, 3)
    return [Image.fromarray(array) for array in as_bytes]


def sample_and_score(pipe, items: list[tuple], args: argparse.Namespace) -> list[dict]:
    """Sample each (spec, caption, seed) once and score the image with both readers. Also score a render of the
    world with the same spec and seed, which both must read right, and its round trip through the pipeline's VAE.

    Args:
        pipe (`LMLPPipeline`): The pipeline.
        items (`list[tuple]`): `(spec, caption, seed)` per image.
        args (`argparse.Namespace`): The parsed arguments.
    """
    from tqdm.auto import tqdm

    from diffusers_lmlp.shapes.scorer import read_image, score_image
    from diffusers_lmlp.shapes.world import render

    sampler = sampler_settings(args, pipe)
    records = []
    for start in tqdm(range(0, len(items), args.batch_size), desc="sampling", unit="batch"):
        batch = items[start : start + args.batch_size]
        generators = [torch.Generator().manual_seed(seed) for _, _, seed in batch]
        images = pipe([caption for _, caption, _ in batch], generator=generators, **sampler).images
        drawn = [render(spec, rng=np.random.default_rng(seed)) for spec, _, seed in batch]
        for (spec, caption, seed), image, render_, trip in zip(batch, images, drawn, round_trips(pipe.vae, drawn)):
            reading, render_reading, trip_reading = read_shape(image), read_shape(render_), read_shape(trip)
            records.append(
                {
                    "caption": caption,
                    "seed": seed,
                    "shape": spec.shape,
                    "image": image,
                    "reading": {"package": read_image(image), "independent": reading},
                    "package": score_image(image, caption),
                    "independent": verdicts(reading, spec),
                    # the share of its box the outline fills, on the sample, the render and its round trip
                    "fill": {
                        name: None if seen_ is None else seen_["fill"]
                        for name, seen_ in (
                            ("sample", reading),
                            ("render", render_reading),
                            ("round trip", trip_reading),
                        )
                    },
                    "render": {
                        "package": score_image(render_, caption),
                        "independent": verdicts(render_reading, spec),
                    },
                    "round trip": {"package": score_image(trip, caption), "independent": verdicts(trip_reading, spec)},
                }
            )
    return records


def seen(reading: dict | None) -> str:
    """A reading in words: "small red circle, top left", or "nothing".

    Args:
        reading (`dict`, *optional*): A reading of either scorer.
    """
    if reading is None:
        return "nothing"
    return f"{reading['size']} {reading['colour']} {reading['shape']}, {reading['position']}"


def table(results: dict[str, dict]) -> str:
    """The markdown table: each split's accuracies by the package's scorer and by this one, and their agreement.

    Args:
        results (`dict[str, dict]`): `summary` by split.
    """
    keys = ("colour", "shape", "position", "size", "colour+position", "all")
    lines = ["| split | scorer | " + " | ".join(keys) + " |", "|---|---|" + "---:|" * len(keys)]
    for split, scores in results.items():
        for name in ("package", "independent", "agree"):
            cells = " | ".join(f"{100 * scores[name][key]:.1f}%" for key in keys)
            lines.append(f"| {split} | {name} | {cells} |")
    return "\n".join(lines)


def median_fills(records: list[dict]) -> dict[str, dict[str, float | int]]:
    """By the shape the caption asks for: how many images, and the median share of its box the outline fills on the
    samples, on the renders and on their round trips (images where nothing stands out are left out; None where none
    is left).

    A circle fills π/4 ≈ 0.79 of its box and a square 1; the cut between them is `SQUARE_FILL`. Samples of one shape
    whose fill moves towards the other's show a model that draws something between the two.

    Args:
        records (`list[dict]`): `sample_and_score` records.
    """
    fills = {}
    for shape in sorted({record["shape"] for record in records}):
        chosen = [record["fill"] for record in records if record["shape"] == shape]
        fills[shape] = {"images": len(chosen)}
        for name in ("sample", "render", "round trip"):
            values = [fill[name] for fill in chosen if fill[name] is not None]
            fills[shape][name] = round(float(np.median(values)), 3) if values else None
    return fills


def fill_table(fills: dict[str, dict]) -> str:
    """The markdown table of `median_fills` by split.

    Args:
        fills (`dict[str, dict]`): `median_fills` by split.
    """
    lines = [
        "| split | shape asked for | images | median fill: samples | renders | round trips |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for split, by_shape in fills.items():
        for shape, row in by_shape.items():
            cells = " | ".join(
                "—" if row[name] is None else f"{row[name]:.3f}" for name in ("sample", "render", "round trip")
            )
            lines.append(f"| {split} | {shape} | {row['images']} | {cells} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    from diffusers_lmlp import LMLPPipeline
    from diffusers_lmlp.image_grid import make_image_grid
    from diffusers_lmlp.shapes.pretrained import PIPELINE_PATH

    pipe = LMLPPipeline.from_pretrained(args.pipeline or PIPELINE_PATH)
    pipe.set_progress_bar_config(disable=True)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    results, references, disagreements, per_image, fills = {}, {"render": {}, "round trip": {}}, [], {}, {}
    for (split, captioned), repeats in zip(own_captions(args.seed).items(), args.images_per_caption):
        seeds = (args.seed + 1000 * repeat + i for repeat in range(repeats) for i in range(len(captioned)))
        items = [(spec, caption, seed) for (spec, caption), seed in zip(captioned * repeats, seeds)]
        records = sample_and_score(pipe, items, args)
        results[split] = summary(records)
        fills[split] = median_fills(records)
        for reference, scores in references.items():
            scores[split] = summary([r[reference] for r in records])
        disagreements += [r for r in records if r["package"] != r["independent"]]
        per_image[split] = [{k: v for k, v in r.items() if k not in ("image", *references)} for r in records]
    print(table(results))
    for reference, by_split in references.items():
        for split, scores in by_split.items():
            print(
                f"{reference}s of the {split} combinations, same seeds: all four {100 * scores['package']['all']:.1f}% "
                f"(package), {100 * scores['independent']['all']:.1f}% (independent)"
            )
    print(f"The share of its box each outline fills (a circle π/4 ≈ 0.785, a square 1; cut at {SQUARE_FILL:.3f}):")
    print(fill_table(fills))
    report = {
        "pipeline": str(args.pipeline or PIPELINE_PATH),
        "seed": args.seed,
        **sampler_settings(args, pipe),
        "results": results,
        "references": references,
        "median_fills": fills,
        "images": per_image,
    }
    (args.output_dir / "results.json").write_text(json.dumps(report, indent=1), encoding="utf-8")
    if disagreements:
        labels = [
            f"{r['caption']} | {seen(r['reading']['package'])} / {seen(r['reading']['independent'])}"
            for r in disagreements
        ]
        make_image_grid([r["image"] for r in disagreements], labels).save(args.output_dir / "disagreements.png")
    print(
        f"{len(disagreements)} images on which the two scorers differ (disagreements.png: caption | package's reading "
        f"/ this one's); results in {args.output_dir}"
    )
    return report


if __name__ == "__main__":
    main()
