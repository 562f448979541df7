"""The emoji world: the 3,786 Noto Color Emoji pictures (emoji and their skin-tone variants) at 32×32 on white, each
with its Unicode name and the phrasings people write ("a red apple emoji"), built by `scripts/build_emoji_world.py`.
A tenth of the single-tone variants (`HELD_OUT`) never appear in training, while every tone and every emoji keep
pictures there: the held-out captions test composing an emoji with a tone."""

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image


WORLD_PATH = Path(__file__).resolve().parent / "assets" / "world"
IMAGE_SIZE = 32
SPLITS = ("train", "heldout")
# The validation grid's captions: 6 training pictures, then 2 held-out tone variants.
VALIDATION_PROMPTS = (
    "red apple", "grinning face", "rocket", "japan flag", "sunflower", "thumbs up sign: dark skin tone",
    "waving hand sign: light skin tone", "victory hand: medium skin tone",
)  # fmt: skip


@dataclass(frozen=True)
class Emoji:
    """One picture of the world, as `world.json` records it."""

    unified: str  # its code points as `emoji.json` writes them ("1F3C4-1F3FF")
    base: str  # the `unified` of the emoji it is a tone variant of (its own for a default picture)
    name: str  # the plain name, the caption the scores ask for ("surfer: dark skin tone")
    captions: tuple[str, ...]  # its phrasings, the plain name first
    category: str  # its Unicode group
    subcategory: str
    tones: tuple[str, ...]  # its distinct skin-tone modifiers ("1F3FF"), none for a default picture
    held_out: bool  # one of `HELD_OUT`


@functools.cache
def load_emoji(world_path: Path = WORLD_PATH) -> tuple[Emoji, ...]:
    """Every picture's record from the folder holding `world.json`, in the sheet's order."""
    world = json.loads((Path(world_path) / "world.json").read_text(encoding="utf-8"))
    return tuple(Emoji(**{**r, "captions": tuple(r["captions"]), "tones": tuple(r["tones"])}) for r in world["emoji"])


@functools.cache
def load_images(world_path: Path = WORLD_PATH) -> np.ndarray:
    """Every picture, in the order of `load_emoji`: (N, S, S, 3) uint8, cut from the world's PNG sheet."""
    world = json.loads((Path(world_path) / "world.json").read_text(encoding="utf-8"))
    size, columns, count = world["size"], world["columns"], len(world["emoji"])
    with Image.open(Path(world_path) / world["sheet"]) as sheet:
        pixels = np.asarray(sheet.convert("RGB"))  # (rows · S, columns · S, 3)
    tiles = pixels.reshape(pixels.shape[0] // size, size, columns, size, 3).transpose(0, 2, 1, 3, 4)
    return np.ascontiguousarray(tiles.reshape(-1, size, size, 3)[:count])


def __getattr__(name: str):
    """`HELD_OUT`, the held-out pictures' code points, read on first use rather than when the module is imported."""
    if name == "HELD_OUT":
        return tuple(e.unified for e in load_emoji() if e.held_out)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def caption_items(split: str | None) -> tuple:
    """A split's (`"train"`, `"heldout"`, None: all) pictures as `draw_captions` reads a world: how many, the plain
    name of picture i, and one of its captions drawn with `rng`."""
    emoji = load_emoji()
    pictures = [emoji[i] for i in split_indices(split)] if split else emoji
    return (
        len(pictures),
        lambda i: pictures[i].name,
        lambda i, rng: pictures[i].captions[rng.integers(len(pictures[i].captions))],
    )


def split_indices(split: str) -> list[int]:
    """The positions in `load_emoji()` of a split's pictures: `"train"` (all but `HELD_OUT`) or `"heldout"`."""
    if split not in SPLITS:
        raise ValueError(f"Unknown split {split!r} of the emoji world; choose one of {list(SPLITS)}.")
    return [i for i, e in enumerate(load_emoji()) if e.held_out == (split == "heldout")]


@functools.cache
def tone_group(index: int) -> tuple[int, ...]:
    """The positions in `load_emoji()` of the single-tone variants of picture `index`'s emoji, by tone."""
    emoji = load_emoji()
    return tuple(i for i, e in enumerate(emoji) if e.base == emoji[index].base and len(e.tones) == 1)


def validation_prompts() -> list[str]:
    return list(VALIDATION_PROMPTS)


def make_dataset(split: str = "train"):
    """The split as a `datasets.Dataset`, one row per picture: `image` and `text` (all its phrasings)."""
    from datasets import Dataset, Features, Sequence, Value
    from datasets import Image as ImageFeature

    emoji, images = load_emoji(), load_images()
    rows = split_indices(split)
    features = Features({"image": ImageFeature(), "text": Sequence(Value("string"))})
    data = {"image": [Image.fromarray(images[i]) for i in rows], "text": [list(emoji[i].captions) for i in rows]}
    return Dataset.from_dict(data, features=features)
