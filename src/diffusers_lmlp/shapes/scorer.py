"""Does an image show what its caption says? A deterministic reader of shapes-world images: a pixel's coverage α
is its projection onto the direction from the background (the border) to the nearest palette colour; the shape is
the world's own shape closest to the α map, the position the grid cell of its centre, the size its radius against
the midpoint of the two sizes. A caption is scored on what it states only."""

import re
from dataclasses import replace

import numpy as np
from PIL import Image

from . import world
from .world import COLOURS, POSITIONS, SHAPES, SIZES, TEMPLATES, ShapeSpec


ATTRIBUTES = ("colour", "shape", "position", "size")
# The slots of `TEMPLATES` as patterns: any words, so that a caption with an unknown word is told which word.
SLOTS = {
    "object": r"(?:a )?(?:(?P<size>\w+) )?(?P<colour>\w+) (?P<shape>\w+)",
    "position": r"(?P<position>\w+(?: \w+)?)",
}
# One pattern per template, in the order of `TEMPLATES`: the template's text with each {slot} replaced.
CAPTIONS = [re.compile(re.sub(r"\\\{(\w+)\\\}", lambda slot: SLOTS[slot[1]], re.escape(t))) for t in TEMPLATES]
# A caption's word for a size or position → its canonical name.
SIZE_NAMES = {word: size for size, words in world.SIZE_WORDS.items() for word in words}
POSITION_NAMES = {words: position for position, phrases in world.POSITION_WORDS.items() for words in phrases}
# Area of a shape of bounding-box half-side r, over r²: circle π, square 4, triangle 2.
AREA_OVER_R2 = {"circle": np.pi, "square": 4.0, "triangle": 2.0}
MIN_FOREGROUND = 0.25  # coverage below which a pixel is background
MIN_AREA = 2.0  # total coverage (pixels) below which the image shows no shape


def parse_caption(text: str) -> ShapeSpec:
    """What a world caption in any phrasing, case and spacing states ("middle: a big blue square"), `size` `None`
    when unstated; `ValueError` naming the expected forms for any other text."""
    normal = " ".join(re.sub(r"\s*([,:])", r"\1 ", text.lower()).split())
    problem = ""
    for pattern in CAPTIONS:
        if (match := pattern.fullmatch(normal)) is not None:
            size, colour, shape, position = match.group("size", "colour", "shape", "position")
            try:
                return ShapeSpec(SIZE_NAMES.get(size, size), colour, shape, POSITION_NAMES.get(position, position))
            except ValueError as error:
                problem = f"{error} "
                break
    forms = ", ".join(f"'{template}'" for template in TEMPLATES)
    words = ", ".join([*SIZE_NAMES, *COLOURS, *SHAPES, *POSITION_NAMES])
    raise ValueError(
        f"{text!r} is not a shapes-world caption: {problem}Expected one of {forms}, {{object}} being '[a] [{{size}}] "
        f"{{colour}} {{shape}}', in the words {words} (e.g. 'red circle, upper left')."
    )


def read_image(image: Image.Image | np.ndarray) -> dict[str, str] | None:
    """What the image shows: its size, colour, shape and position, or `None` when it shows no shape."""
    pixels = np.asarray(image.convert("RGB") if isinstance(image, Image.Image) else image, dtype=np.float32)
    side = pixels.shape[0]
    border = np.concatenate([pixels[0], pixels[-1], pixels[:, 0], pixels[:, -1]])  # (4·S, 3)
    background = np.median(border, axis=0)
    offset = pixels - background  # (S, S, 3)
    strength = np.linalg.norm(offset, axis=-1)  # (S, S)
    weights = strength / (strength.max() + 1e-6)
    mean_offset = (offset * weights[..., None] ** 2).sum((0, 1))
    directions = {name: np.array(rgb, np.float32) - background for name, rgb in COLOURS.items()}
    cosine = {
        name: mean_offset @ d / (np.linalg.norm(d) * np.linalg.norm(mean_offset) + 1e-6)
        for name, d in directions.items()
    }
    colour = max(cosine, key=cosine.get)
    direction = directions[colour]
    alpha = np.clip(offset @ direction / (direction @ direction), 0.0, 1.0)  # (S, S)
    alpha = np.where(alpha >= MIN_FOREGROUND, alpha, 0.0)
    area = alpha.sum()
    if area < MIN_AREA:
        return None
    ys, xs = np.mgrid[0:side, 0:side] + 0.5
    centroid = ((alpha * xs).sum() / area, (alpha * ys).sum() / area)

    def fit(shape: str) -> tuple[float, str, tuple[float, float], float]:
        radius = float(np.sqrt(area / AREA_OVER_R2[shape]))
        # A triangle's centroid lies a third of its half-side below its box centre.
        centre = (centroid[0], centroid[1] - (radius / 3 if shape == "triangle" else 0.0))
        return np.abs(world.shape_coverage(shape, centre, radius, side) - alpha).sum(), shape, centre, radius

    _, shape, centre, radius = min(map(fit, SHAPES), key=lambda fitted: fitted[0])
    cell = side / 3
    column, row = (min(int(c // cell), 2) for c in centre)
    size = SIZES[0] if radius < cell * (world.SIZE_RADII["small"] + world.SIZE_RADII["large"]) / 2 else SIZES[1]
    return {"size": size, "colour": colour, "shape": shape, "position": POSITIONS[3 * row + column]}


def score_image(image: Image.Image | np.ndarray, caption: str) -> dict[str, bool]:
    """Whether an RGB image (PIL or (H, W, 3)) shows its caption's "colour", "shape", "position" and, when stated,
    "size" (all `False` when no shape is visible)."""
    spec, seen = parse_caption(caption), read_image(image)
    stated = [key for key in ATTRIBUTES if getattr(spec, key) is not None]
    return {key: seen is not None and seen[key] == getattr(spec, key) for key in stated}


def score_images(images, captions: list[str]) -> dict[str, float]:
    """`accuracies` of `score_image` over RGB images (PIL or (H, W, 3)) and one caption each."""
    if len(images) != len(captions) or not captions:
        raise ValueError(f"Pass one caption per image (got {len(images)} images and {len(captions)} captions).")
    return accuracies([score_image(image, caption) for image, caption in zip(images, captions)])


def accuracies(results: list[dict[str, bool]]) -> dict[str, float]:
    """Accuracy of each attribute over the `score_image` results that state it, plus "colour+position" (both right)
    and "all" (every stated attribute right) over all results."""
    stated = [key for key in ATTRIBUTES if any(key in r for r in results)]
    scores = {key: float(np.mean([r[key] for r in results if key in r])) for key in stated}
    scores["colour+position"] = float(np.mean([r["colour"] and r["position"] for r in results]))
    scores["all"] = float(np.mean([all(r.values()) for r in results]))
    return scores


def is_shapes_caption(caption: str) -> bool:
    """Whether `parse_caption` reads the caption (then the scorer can score it)."""
    try:
        parse_caption(caption)
    except ValueError:
        return False
    return True


class ShapesScorer:
    """The shapes scorer as the evaluation reads a world's: per-image flags, FID's renders, accuracies, intervals."""

    FLAGS = ATTRIBUTES

    def flags(self, images: list[Image.Image], captions: list[str]) -> list[list[float]]:
        """Per image, each attribute of `FLAGS` right (1.0) or wrong (0.0), NaN where the caption leaves it out."""
        verdicts = [score_image(image, caption) for image, caption in zip(images, captions)]
        return [[float(verdict.get(key, float("nan"))) for key in ATTRIBUTES] for verdict in verdicts]

    def renders(self, captions: list[str], batch: range, seed: int, stream: int, resolution: int) -> list[Image.Image]:
        """Real shapes-world images of the captions, each jittered and seeded by (seed, stream, index), which also
        draws a size the caption leaves unstated."""
        images = []
        for caption, index in zip(captions, batch):
            spec, rng = parse_caption(caption), np.random.default_rng([seed, stream, index])
            if spec.size is None:
                spec = replace(spec, size=SIZES[rng.integers(len(SIZES))])
            images.append(world.render(spec, resolution, rng))
        return images

    accuracies = staticmethod(accuracies)

    @staticmethod
    def intervals(flags: np.ndarray, captions: list[str], seed: int) -> dict[str, list[float]]:
        from ..evaluation.intervals import bootstrap_intervals

        return bootstrap_intervals(flags, captions, seed=seed)
