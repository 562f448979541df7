"""The shapes world: seeded, captioned images of one coloured shape on a grey background.

Every image shows one shape, described by a `ShapeSpec` (size × colour × shape × position on a 3×3 grid) and
captioned "a {size} {colour} {shape} at the {position}", e.g. "a small red circle at the top left". Of the 324
caption combinations, a fixed tenth (`held_out_specs()`) never appears in training, to test composition.

The geometry, in pixels of an `image_size`-sided image whose pixel (i, j) covers [j, j+1) × [i, i+1):

- the shape's bounding box is centred in its grid cell (a third of the image per side), with a side of
  `2 · SIZE_RADII[size] · image_size / 3` (about 6 px small and 9 px large at 32 px);
- circle: the disc inscribed in the box; square: the box; triangle: apex at the top middle, base along the bottom;
- colours are flat `COLOURS`, anti-aliased into the flat `BACKGROUND` by 4×4 supersampling;
- with a random generator, the centre moves by up to `JITTER_SHIFT` of a cell and the size by up to `JITTER_SCALE`.
"""

import json
import os
from dataclasses import dataclass
from itertools import product

import numpy as np
from datasets import Dataset, Features, Value
from datasets import Image as ImageFeature
from PIL import Image


IMAGE_SIZE = 32
BACKGROUND = (128, 128, 128)
# Saturated colours whose directions from the grey background are at least 50° apart, so that a colour is
# recognised from its hue even when blended into the background (blur, anti-aliasing, faded samples).
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (40, 80, 220),
    "yellow": (230, 210, 40),
    "magenta": (200, 50, 200),
    "cyan": (40, 200, 210),
}
SHAPES = ("circle", "square", "triangle")
# Row-major over the 3×3 grid: index = 3 · row + column.
POSITIONS = ("top left", "top", "top right", "left", "center", "right", "bottom left", "bottom", "bottom right")
SIZES = ("small", "large")
# Half the side of a shape's bounding box, as a fraction of a grid cell's side.
SIZE_RADII = {"small": 0.28, "large": 0.42}
JITTER_SHIFT = 0.08  # largest shift of the centre per axis, as a fraction of a cell's side
JITTER_SCALE = 0.1  # largest relative change of the radius
SUPERSAMPLING = 4  # sub-pixel samples per axis for anti-aliasing
HELD_OUT_STRIDE = 10  # every 10th combination of `all_specs()` is held out
DEFAULT_NUM_IMAGES = {"train": 8000, "heldout": 800}


@dataclass(frozen=True)
class ShapeSpec:
    """What one image of the world shows, and what its caption says.

    Args:
        size (`str`): One of `SIZES`.
        colour (`str`): One of `COLOURS`.
        shape (`str`): One of `SHAPES`.
        position (`str`): One of `POSITIONS`.
    """

    size: str
    colour: str
    shape: str
    position: str

    def __post_init__(self):
        for field, value, allowed in (
            ("size", self.size, SIZES),
            ("colour", self.colour, tuple(COLOURS)),
            ("shape", self.shape, SHAPES),
            ("position", self.position, POSITIONS),
        ):
            if value not in allowed:
                raise ValueError(f"Unknown {field} {value!r}; choose one of {list(allowed)}.")

    @property
    def caption(self) -> str:
        """The caption, e.g. "a small red circle at the top left"."""
        return f"a {self.size} {self.colour} {self.shape} at the {self.position}"


def all_specs() -> list[ShapeSpec]:
    """Every combination of size, colour, shape and position (2 · 6 · 3 · 9 = 324), in a fixed order."""
    return [ShapeSpec(*values) for values in product(SIZES, COLOURS, SHAPES, POSITIONS)]


def held_out_specs() -> list[ShapeSpec]:
    """The combinations never seen in training: every `HELD_OUT_STRIDE`-th of `all_specs()` (32 of 324).

    The stride is coprime with the 9 positions and spreads the held-out combinations over every size, colour, shape
    and position, while each value still occurs in many training combinations.
    """
    return all_specs()[HELD_OUT_STRIDE // 2 :: HELD_OUT_STRIDE]


def train_specs() -> list[ShapeSpec]:
    """The training combinations: `all_specs()` minus `held_out_specs()` (292 of 324)."""
    held_out = set(held_out_specs())
    return [spec for spec in all_specs() if spec not in held_out]


def cell_centre(position: str, image_size: int = IMAGE_SIZE) -> tuple[float, float]:
    """The centre (x, y), in pixels, of a position's grid cell."""
    row, column = divmod(POSITIONS.index(position), 3)
    cell = image_size / 3
    return (column + 0.5) * cell, (row + 0.5) * cell


def shape_coverage(shape: str, centre: tuple[float, float], radius: float, image_size: int = IMAGE_SIZE) -> np.ndarray:
    """The fraction of each pixel that a shape covers (its anti-aliased alpha mask).

    Args:
        shape (`str`): One of `SHAPES`.
        centre (`tuple[float, float]`): Centre (x, y) of the shape's bounding box, in pixels.
        radius (`float`): Half the side of the bounding box, in pixels.
        image_size (`int`, *optional*, defaults to `IMAGE_SIZE`): Side of the image.

    Returns:
        `np.ndarray`: Coverage in [0, 1], float32 of shape (image_size, image_size), rows first.
    """
    # Sub-pixel sample centres, relative to the shape's centre.
    samples = (np.arange(image_size * SUPERSAMPLING) + 0.5) / SUPERSAMPLING  # (S·k,)
    x = samples[None, :] - centre[0]  # (1, S·k)
    y = samples[:, None] - centre[1]  # (S·k, 1)
    if shape == "circle":
        inside = x**2 + y**2 <= radius**2
    elif shape == "square":
        inside = (np.abs(x) <= radius) & (np.abs(y) <= radius)
    elif shape == "triangle":
        inside = (y <= radius) & (2 * np.abs(x) <= y + radius)
    else:
        raise ValueError(f"Unknown shape {shape!r}; choose one of {list(SHAPES)}.")
    inside = inside.reshape(image_size, SUPERSAMPLING, image_size, SUPERSAMPLING)  # (S, k, S, k)
    return inside.mean(axis=(1, 3), dtype=np.float32)  # (S, S)


def render(spec: ShapeSpec, image_size: int = IMAGE_SIZE, rng: np.random.Generator | None = None) -> Image.Image:
    """Draw one image of the world.

    Args:
        spec (`ShapeSpec`): What to draw.
        image_size (`int`, *optional*, defaults to `IMAGE_SIZE`): Side of the square image, in pixels.
        rng (`np.random.Generator`, *optional*): Jitters the centre (up to `JITTER_SHIFT` of a cell per axis) and
            the size (up to `JITTER_SCALE`); without it the shape sits exactly in the middle of its cell.

    Returns:
        `PIL.Image.Image`: An RGB image.
    """
    cell = image_size / 3
    centre_x, centre_y = cell_centre(spec.position, image_size)
    radius = SIZE_RADII[spec.size] * cell
    if rng is not None:
        shift_x, shift_y, scale = rng.uniform(-1.0, 1.0, size=3)
        centre_x, centre_y = centre_x + JITTER_SHIFT * cell * shift_x, centre_y + JITTER_SHIFT * cell * shift_y
        radius *= 1 + JITTER_SCALE * scale
    alpha = shape_coverage(spec.shape, (centre_x, centre_y), radius, image_size)[..., None]  # (S, S, 1)
    background, colour = np.array(BACKGROUND, np.float32), np.array(COLOURS[spec.colour], np.float32)
    pixels = background + alpha * (colour - background)  # (S, S, 3)
    return Image.fromarray(np.round(pixels).astype(np.uint8), mode="RGB")


def make_dataset(
    split: str = "train", num_images: int | None = None, seed: int = 0, image_size: int = IMAGE_SIZE
) -> Dataset:
    """A captioned image dataset of the world, identical for equal arguments.

    The split's combinations are drawn evenly (each appears `num_images / len(specs)` times, ±1) in a seeded random
    order, and each image gets its own jitter.

    Args:
        split (`str`, *optional*, defaults to `"train"`): `"train"` (`train_specs()`) or `"heldout"`
            (`held_out_specs()`).
        num_images (`int`, *optional*): Number of rows; 8000 for `"train"` and 800 for `"heldout"` when not given.
        seed (`int`, *optional*, defaults to 0): Seed of the order and the jitter.
        image_size (`int`, *optional*, defaults to `IMAGE_SIZE`): Side of the images, in pixels.

    Returns:
        `datasets.Dataset`: Columns `image` (`datasets.Image`, decoded to RGB PIL images) and `text` (the caption).
    """
    splits = {"train": train_specs, "heldout": held_out_specs}
    if split not in splits:
        raise ValueError(f"Unknown split {split!r}; choose one of {list(splits)}.")
    num_images = DEFAULT_NUM_IMAGES[split] if num_images is None else num_images
    if num_images < 0:
        raise ValueError(f"`num_images` must be non-negative, got {num_images}.")
    specs = splits[split]()
    rng = np.random.default_rng([seed, list(splits).index(split)])
    num_rounds = -(-num_images // len(specs))
    order = np.concatenate([rng.permutation(len(specs)) for _ in range(num_rounds)])[:num_images]
    images = [render(specs[i], image_size, rng) for i in order]
    features = Features({"image": ImageFeature(), "text": Value("string")})
    return Dataset.from_dict({"image": images, "text": [specs[i].caption for i in order]}, features=features)


def write_imagefolder(dataset: Dataset, directory: str | os.PathLike) -> str | os.PathLike:
    """Write a dataset with `image` and `text` columns as a 🤗 imagefolder: PNG files and `metadata.jsonl`.

    Load it back with `datasets.load_dataset("imagefolder", data_dir=directory, split="train")`.

    Args:
        dataset (`datasets.Dataset`): E.g. from `make_dataset`.
        directory (`str` or `os.PathLike`): Created if missing; files of the same names are overwritten.

    Returns:
        `str` or `os.PathLike`: `directory`.
    """
    missing = {"image", "text"} - set(dataset.column_names)
    if missing:
        raise ValueError(f"The dataset needs `image` and `text` columns; missing {sorted(missing)}.")
    os.makedirs(directory, exist_ok=True)
    digits = len(str(max(len(dataset) - 1, 0)))
    with open(os.path.join(directory, "metadata.jsonl"), "w", encoding="utf-8") as metadata:
        for index, row in enumerate(dataset):
            file_name = f"{index:0{digits}d}.png"
            row["image"].convert("RGB").save(os.path.join(directory, file_name))
            metadata.write(json.dumps({"file_name": file_name, "text": row["text"]}) + "\n")
    return directory
