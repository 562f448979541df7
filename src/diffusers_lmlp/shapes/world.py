"""The shapes world: seeded, captioned images of one coloured shape (a `ShapeSpec`: size × colour × shape ×
position on a 3×3 grid) on a grey background, captioned in any of `TEMPLATES` with optional article and size and
with synonyms. A tenth of the colour × shape × position triples, at both sizes (`held_out_specs()`), never appears
in training, to test composition."""

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
# Directions from the grey background at least 50° apart: a colour is told by its hue even when faded.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 80, 220), "yellow": (230, 210, 40),
    "magenta": (200, 50, 200), "cyan": (40, 200, 210),
}  # fmt: skip
SHAPES = ("circle", "square", "triangle")
# Row-major over the 3×3 grid: index = 3 · row + column.
POSITIONS = ("top left", "top", "top right", "left", "center", "right", "bottom left", "bottom", "bottom right")
SIZES = ("small", "large")
# Half the side of a shape's bounding box, as a fraction of a grid cell's side.
SIZE_RADII = {"small": 0.28, "large": 0.42}
JITTER_SHIFT = 0.08  # largest shift of the centre per axis, as a fraction of a cell's side
JITTER_SCALE = 0.1  # largest relative change of the radius
SUPERSAMPLING = 4  # sub-pixel samples per axis for anti-aliasing
# A caption's phrasings, the canonical one first; {object} is "[a] [{size}] {colour} {shape}".
TEMPLATES = (
    "{object} at the {position}",
    "{object} in the {position}",
    "{object}, {position}",
    "{position}: {object}",
)
# The words a caption may use for each size and position, the canonical one first.
SIZE_WORDS = {"small": ("small",), "large": ("large", "big")}
POSITION_WORDS = {
    "top left": ("top left", "upper left"), "top": ("top",), "top right": ("top right", "upper right"),
    "left": ("left",), "center": ("center", "middle", "centre"), "right": ("right",),
    "bottom left": ("bottom left", "lower left"), "bottom": ("bottom",),
    "bottom right": ("bottom right", "lower right"),
}  # fmt: skip
CANONICAL_SHARE = 1 / 3  # share of `describe`'s captions that are canonical
ARTICLE_SHARE = 1 / 2  # share of the others with the article "a"
SIZELESS_SHARE = 3 / 8  # share of the others that leave the size unstated: a quarter of all captions
HELD_OUT_STRIDE = 10  # every 10th colour × shape × position combination is held out, at both sizes
DEFAULT_NUM_IMAGES = {"train": 8000, "heldout": 800}


@dataclass(frozen=True)
class ShapeSpec:
    """What one image shows and its caption says: one of `SIZES` (`None` for a caption that leaves it unstated,
    which `render` refuses), `COLOURS`, `SHAPES` and `POSITIONS`."""

    size: str | None
    colour: str
    shape: str
    position: str

    def __post_init__(self):
        for field, allowed in (
            ("size", SIZES),
            ("colour", tuple(COLOURS)),
            ("shape", SHAPES),
            ("position", POSITIONS),
        ):
            if (value := getattr(self, field)) not in allowed and not (field == "size" and value is None):
                raise ValueError(f"Unknown {field} {value!r}; choose one of {list(allowed)}.")

    @property
    def caption(self) -> str:
        """The canonical caption, e.g. "a small red circle at the top left" (without the size word when sizeless)."""
        return phrase(TEMPLATES[0], True, self.size, self.colour, self.shape, self.position)


def phrase(template: str, article: bool, size: str | None, colour: str, shape: str, position: str) -> str:
    """Fill one of `TEMPLATES` with a caption's words: `size` a word of `SIZE_WORDS` or None (unstated), `position`
    words of `POSITION_WORDS` ("upper left")."""
    words = [word for word in ("a" if article else None, size, colour, shape) if word is not None]
    return template.format(object=" ".join(words), position=position)


def phrasings(spec: ShapeSpec) -> list[str]:
    """Every caption that states what `spec` states, the canonical one first: each template, with and without the
    article, with each word of its size (none for a sizeless spec) and of its position."""
    sizes = (None,) if spec.size is None else SIZE_WORDS[spec.size]
    return [
        phrase(template, article, size, spec.colour, spec.shape, position)
        for template in TEMPLATES
        for article in (True, False)
        for size in sizes
        for position in POSITION_WORDS[spec.position]
    ]


def describe(spec: ShapeSpec, rng: np.random.Generator) -> str:
    """A random caption of `spec` (sizeless for a sizeless spec): canonical with probability `CANONICAL_SHARE`, else
    a uniform template and words, with the article at `ARTICLE_SHARE` and without the size at `SIZELESS_SHARE`."""
    if rng.random() < CANONICAL_SHARE:
        return spec.caption
    template = TEMPLATES[rng.integers(len(TEMPLATES))]
    article = rng.random() < ARTICLE_SHARE
    sizes = (None,) if spec.size is None or rng.random() < SIZELESS_SHARE else SIZE_WORDS[spec.size]
    positions = POSITION_WORDS[spec.position]
    size, position = sizes[rng.integers(len(sizes))], positions[rng.integers(len(positions))]
    return phrase(template, article, size, spec.colour, spec.shape, position)


def all_specs() -> list[ShapeSpec]:
    """Every combination of size, colour, shape and position (2 · 6 · 3 · 9 = 324), in a fixed order."""
    return [ShapeSpec(*values) for values in product(SIZES, COLOURS, SHAPES, POSITIONS)]


def held_out_specs() -> list[ShapeSpec]:
    """The combinations never trained on, in the order of `all_specs()`: both sizes (a sizeless caption names only
    the triple) of every `HELD_OUT_STRIDE`-th colour × shape × position triple (32 of 324 specs)."""
    triples = list(product(COLOURS, SHAPES, POSITIONS))[HELD_OUT_STRIDE // 2 :: HELD_OUT_STRIDE]
    return [spec for spec in all_specs() if (spec.colour, spec.shape, spec.position) in triples]


def train_specs() -> list[ShapeSpec]:
    """The training combinations: `all_specs()` minus `held_out_specs()` (292 of 324)."""
    held_out = set(held_out_specs())
    return [spec for spec in all_specs() if spec not in held_out]


def caption_items(split: str | None) -> tuple:
    """A split's (`"train"`, `"heldout"`, None: all) specs as `draw_captions` reads a world: how many, the caption of
    spec i, and a phrasing of it drawn with `rng`."""
    specs = {None: all_specs, "train": train_specs, "heldout": held_out_specs}[split]()
    return len(specs), lambda i: specs[i].caption, lambda i, rng: describe(specs[i], rng)


def validation_prompts() -> list[str]:
    """The validation grid's captions: 6 training combinations spread over `train_specs()`, then 2 held-out ones."""
    train = train_specs()
    return [spec.caption for spec in train[:: len(train) // 6][:6]] + [spec.caption for spec in held_out_specs()[:2]]


def shape_coverage(shape: str, centre: tuple[float, float], radius: float, image_size: int = IMAGE_SIZE) -> np.ndarray:
    """The (S, S) float32 fraction of each pixel a shape covers (its alpha); `centre` (x, y) and `radius` in pixels."""
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
    """Draw one RGB image of `spec`, its centre and size jittered by `rng` (else exactly in the middle of its cell)."""
    if spec.size is None:
        raise ValueError(f"{spec} states no size, so it cannot be drawn: give it one of {list(SIZES)}.")
    cell = image_size / 3
    row, column = divmod(POSITIONS.index(spec.position), 3)
    centre_x, centre_y = (column + 0.5) * cell, (row + 0.5) * cell
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
    """A `datasets.Dataset` (`image`, `text`) of the `"train"` or `"heldout"` split, identical for equal arguments:
    each combination equally often (±1) in a seeded order, jittered, captioned by `describe` on a second stream."""
    splits = {"train": train_specs, "heldout": held_out_specs}
    if split not in splits:
        raise ValueError(f"Unknown split {split!r}; choose one of {list(splits)}.")
    num_images = DEFAULT_NUM_IMAGES[split] if num_images is None else num_images
    if num_images < 0:
        raise ValueError(f"`num_images` must be non-negative, got {num_images}.")
    specs = splits[split]()
    rng = np.random.default_rng([seed, list(splits).index(split)])
    phrasing_rng = np.random.default_rng([seed, list(splits).index(split), 1])
    num_rounds = -(-num_images // len(specs))
    order = np.concatenate([rng.permutation(len(specs)) for _ in range(num_rounds)])[:num_images]
    images = [render(specs[i], image_size, rng) for i in order]
    captions = [describe(specs[i], phrasing_rng) for i in order]
    features = Features({"image": ImageFeature(), "text": Value("string")})
    return Dataset.from_dict({"image": images, "text": captions}, features=features)


def write_imagefolder(dataset: Dataset, directory: str | os.PathLike) -> str | os.PathLike:
    """Write a dataset with `image` and `text` columns as an imagefolder (PNGs, `metadata.jsonl`) in `directory`."""
    if missing := {"image", "text"} - set(dataset.column_names):
        raise ValueError(f"The dataset needs `image` and `text` columns; missing {sorted(missing)}.")
    os.makedirs(directory, exist_ok=True)
    digits = len(str(max(len(dataset) - 1, 0)))
    with open(os.path.join(directory, "metadata.jsonl"), "w", encoding="utf-8") as metadata:
        for index, row in enumerate(dataset):
            file_name = f"{index:0{digits}d}.png"
            row["image"].convert("RGB").save(os.path.join(directory, file_name))
            metadata.write(json.dumps({"file_name": file_name, "text": row["text"]}) + "\n")
    return directory
