"""Does an image show what its caption says? A deterministic reader of shapes-world images.

The background is estimated from the image border; each pixel's coverage α is its projection onto the direction
from the background to the nearest palette colour. The colour is that palette colour; the shape is the template
(rendered by the world itself at the measured centre and size) closest to the α map; the position is the grid
cell of the shape's centre; the size compares the shape's radius with the midpoint of the world's two sizes.
"""

import re

import numpy as np
from PIL import Image

from .world import COLOURS, POSITIONS, SHAPES, SIZE_RADII, SIZES, ShapeSpec, shape_coverage


CAPTION = re.compile(r"^a (\w+) (\w+) (\w+) at the (.+)$")
# Area of a shape of bounding-box half-side r, over r²: circle π, square 4, triangle 2.
AREA_OVER_R2 = {"circle": np.pi, "square": 4.0, "triangle": 2.0}
MIN_FOREGROUND = 0.25  # coverage below which a pixel is background
MIN_AREA = 2.0  # total coverage (pixels) below which the image shows no shape


def parse_caption(text: str) -> ShapeSpec:
    """Read a world caption such as "a small red circle at the top left".

    Raises:
        ValueError: for text that is not a caption of the world.
    """
    match = CAPTION.match(text.strip().lower())
    if match is None:
        raise ValueError(f"{text!r} is not a shapes-world caption: expected 'a {{size}} {{colour}} {{shape}} at the "
                         "{position}', e.g. 'a small red circle at the top left'.")  # fmt: skip
    try:
        return ShapeSpec(*match.groups())
    except ValueError as error:
        raise ValueError(f"{text!r} is not a shapes-world caption: {error}") from None


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

    best = None
    for shape in SHAPES:
        radius = float(np.sqrt(area / AREA_OVER_R2[shape]))
        # A triangle's centroid lies a third of its half-side below its box centre.
        centre = (centroid[0], centroid[1] - (radius / 3 if shape == "triangle" else 0.0))
        error = np.abs(shape_coverage(shape, centre, radius, side) - alpha).sum()
        if best is None or error < best[0]:
            best = (error, shape, centre, radius)
    _, shape, centre, radius = best
    cell = side / 3
    column, row = (min(int(c // cell), 2) for c in centre)
    size = SIZES[0] if radius < cell * (SIZE_RADII["small"] + SIZE_RADII["large"]) / 2 else SIZES[1]
    return {"size": size, "colour": colour, "shape": shape, "position": POSITIONS[3 * row + column]}


def score_image(image: Image.Image | np.ndarray, caption: str) -> dict[str, bool]:
    """Whether the image shows the caption's colour, shape, position and size.

    Args:
        image (`PIL.Image.Image` or `np.ndarray`): An RGB image of the world (H, W, 3).
        caption (`str`): Its caption.

    Returns:
        `dict[str, bool]`: keys "colour", "shape", "position", "size" (all `False` when no shape is visible).
    """
    spec = parse_caption(caption)
    seen = read_image(image)
    keys = ("colour", "shape", "position", "size")
    if seen is None:
        return dict.fromkeys(keys, False)
    return {key: seen[key] == getattr(spec, key) for key in keys}


def score_images(images, captions: list[str]) -> dict[str, float]:
    """Accuracy of each attribute over a set of images, plus "colour+position" (both right) and "all".

    Args:
        images (`list`): RGB images (PIL or (H, W, 3) arrays).
        captions (`list[str]`): One caption per image.
    """
    if len(images) != len(captions) or not captions:
        raise ValueError(f"Pass one caption per image (got {len(images)} images and {len(captions)} captions).")
    return accuracies([score_image(image, caption) for image, caption in zip(images, captions)])


def accuracies(results: list[dict[str, bool]]) -> dict[str, float]:
    """Accuracy of each attribute over `score_image` results, plus "colour+position" (both right) and "all".

    Args:
        results (`list[dict[str, bool]]`): One `score_image` result per image.
    """
    scores = {key: float(np.mean([r[key] for r in results])) for key in results[0]}
    scores["colour+position"] = float(np.mean([r["colour"] and r["position"] for r in results]))
    scores["all"] = float(np.mean([all(r.values()) for r in results]))
    return scores
