"""Captions: what one is, whatever the data source (`captions_of`), and the ones an evaluation samples: COCO
val2014's as the reference protocol draws them, a captions file, or an embedded world's (shapes, emoji)."""

import json
from pathlib import Path

import numpy as np


COCO_VAL_ANNOTATIONS = Path("annotations") / "captions_val2014.json"
# A source name → the shapes-world combinations it draws from. A `:varied` source phrases each caption at random
# (`world.describe`), the others canonically ("a {size} {colour} {shape} at the {position}").
SHAPES_SOURCES = {
    "shapes": "all_specs",
    "shapes:train": "train_specs",
    "shapes:heldout": "held_out_specs",
    "shapes:varied": "all_specs",
    "shapes:train:varied": "train_specs",
    "shapes:heldout:varied": "held_out_specs",
}
# The emoji world's sources → the split drawn from (all pictures when None): plain names ("surfer: dark skin tone"),
# or with `:varied` a random phrasing of each picture.
EMOJI_SOURCES = {
    "emoji": None,
    "emoji:train": "train",
    "emoji:heldout": "heldout",
    "emoji:varied": None,
    "emoji:train:varied": "train",
    "emoji:heldout:varied": "heldout",
}
WORLD_SOURCES = (*SHAPES_SOURCES, *EMOJI_SOURCES)
DEFAULT_NUM_IMAGES = {"coco": 30_000, "shapes": 1_000, "emoji": 1_000}


def captions_of(value) -> list[str]:
    """The captions of one sample: a non-empty string, or a non-empty list of them.

    Args:
        value: The sample's caption column.

    Raises:
        `ValueError`: For anything else (None, a number, "", a list with a blank entry).
    """
    captions = [value] if isinstance(value, str) else list(value) if isinstance(value, list | tuple) else []
    if not captions or not all(isinstance(c, str) and c.strip() for c in captions):
        raise ValueError(f"a caption must be a non-empty string or a non-empty list of them, got {value!r}")
    return captions


def coco_captions(coco: dict, annotations_file: Path) -> dict[int, list[str]]:
    """The captions of each image id, in the order of the annotations file.

    Args:
        coco (`dict`): The parsed captions file.
        annotations_file (`Path`): Its path, for the messages.

    Raises:
        `ValueError`: For a caption of an image the file does not list, or an empty caption.
    """
    known = {image["id"] for image in coco["images"]}
    captions: dict[int, list[str]] = {}
    for annotation in coco["annotations"]:
        image_id, caption = annotation["image_id"], annotation["caption"]
        if image_id not in known:
            raise ValueError(
                f"{annotations_file}: annotation {annotation['id']} captions image {image_id}, not listed"
            )
        try:
            captions_of(caption)
        except ValueError as error:
            raise ValueError(f"{annotations_file}: annotation {annotation['id']}: {error}") from None
        captions.setdefault(image_id, []).append(caption)
    return captions


def read_captions_file(path: str | Path, option: str = "--captions") -> list[str]:
    """The captions of a text file: one per line, stripped; blank lines and `#` lines are skipped.

    Args:
        path (`str` or `Path`): The UTF-8 text file.
        option (`str`, *optional*, defaults to `"--captions"`): The option that named it, for the messages.

    Raises:
        `ValueError`: For a file that is missing, a folder, unreadable, not UTF-8, or without any caption.
    """
    option = f"{option} {path}"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"{option}: no such file") from None
    except IsADirectoryError:
        raise ValueError(f"{option} is a folder, not a text file of prompts") from None
    except UnicodeDecodeError as error:
        raise ValueError(f"{option} is not UTF-8 text (byte {error.start}): save it as UTF-8") from None
    except OSError as error:
        raise ValueError(f"{option}: cannot read it ({error.strerror})") from None
    lines = [line.strip() for line in text.splitlines()]
    lines = [line for line in lines if line and not line.startswith("#")]
    if not lines:
        raise ValueError(
            f"{option} has no prompts: write one prompt per line (blank lines and lines starting with # are skipped)"
        )
    return lines


def coco_fid_captions(annotations_file: str | Path, num_images: int, seed: int) -> list[str]:
    """COCO captions drawn as U-ViT's FID protocol draws them: the images in seeded shuffled passes (a new
    permutation each pass, as a shuffled data loader over the 40,504 val2014 images), one random caption per draw.

    Args:
        annotations_file (`str` or `Path`): `captions_val2014.json` (from `annotations_trainval2014.zip`).
        num_images (`int`): How many captions.
        seed (`int`): Seed of the draw.
    """
    annotations_file = Path(annotations_file)
    try:
        coco = json.loads(annotations_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"--captions {annotations_file}: not a readable COCO captions JSON file ({error})") from None
    if not isinstance(coco, dict) or not {"images", "annotations"} <= coco.keys():
        raise ValueError(f"{annotations_file} is not a COCO captions file: it needs 'images' and 'annotations' lists")
    by_image = coco_captions(coco, annotations_file)
    image_ids = sorted(by_image)
    rng = np.random.default_rng(seed)
    captions = []
    while len(captions) < num_images:
        for position in rng.permutation(len(image_ids))[: num_images - len(captions)]:
            options = by_image[image_ids[position]]
            captions.append(options[rng.integers(len(options))])
    return captions


def world_captions(source: str, num_images: int, seed: int) -> list[str]:
    """An embedded world's captions, each item of the source drawn evenly (±1) in a seeded order.

    Args:
        source (`str`): `"shapes"` (all 324 combinations), `"shapes:train"` or `"shapes:heldout"`, canonical; or
            `"emoji"` (all 3,786 pictures), `"emoji:train"` or `"emoji:heldout"`, by plain name. With `":varied"`
            appended, each caption in a random phrasing (after the same order, so caption i describes the same item
            either way).
        num_images (`int`): How many captions.
        seed (`int`): Seed of the order and the phrasing.
    """
    if source in SHAPES_SOURCES:
        from ..shapes import world

        specs = getattr(world, SHAPES_SOURCES[source])()
        canonical, varied = (lambda i: specs[i].caption), (lambda i: world.describe(specs[i], rng))
    else:
        from ..emoji.world import load_emoji, split_indices

        emoji, split = load_emoji(), EMOJI_SOURCES[source]
        specs = split_indices(split) if split else range(len(emoji))
        canonical = lambda i: emoji[specs[i]].name  # noqa: E731
        varied = lambda i: emoji[specs[i]].captions[rng.integers(len(emoji[specs[i]].captions))]  # noqa: E731
    rng = np.random.default_rng(seed)
    rounds = -(-num_images // len(specs))
    order = np.concatenate([rng.permutation(len(specs)) for _ in range(rounds)])[:num_images]
    return [(varied if source.endswith(":varied") else canonical)(i) for i in order]


def draw_captions(source: str, num_images: int | None = None, seed: int = 0) -> list[str]:
    """The captions to sample for a source.

    Args:
        source (`str`): An embedded world's, `"shapes"`, `"shapes:train"`, `"shapes:heldout"`, `"emoji"`,
            `"emoji:train"` or `"emoji:heldout"` (with `":varied"` appended, in varied phrasings); a COCO folder
            (holding `annotations/captions_val2014.json`) or a COCO captions `.json`; or a text file, one caption per
            line.
        num_images (`int`, *optional*): How many; defaults to 30,000 for COCO (the papers' FID-30k), 1,000 for a
            world and every line once for a text file. A text file shorter than `num_images` is repeated.
        seed (`int`, *optional*, defaults to 0): Seed of the COCO and world draws.

    Raises:
        `ValueError`: For a source that is none of these, or a non-positive `num_images`.
    """
    if num_images is not None and num_images < 1:
        raise ValueError(f"The number of images must be positive; got {num_images}")
    if source in WORLD_SOURCES:
        return world_captions(source, num_images or DEFAULT_NUM_IMAGES[source.split(":")[0]], seed)
    path = Path(source)
    if path.is_dir():
        if not (path / COCO_VAL_ANNOTATIONS).is_file():
            raise ValueError(
                f"--captions {source} is a folder without {COCO_VAL_ANNOTATIONS}: pass the COCO-2014 folder (unpacked "
                "annotations_trainval2014.zip), a captions .json, a text file or one of "
                f"{sorted(WORLD_SOURCES)}"
            )
        path = path / COCO_VAL_ANNOTATIONS
    if path.suffix == ".json":
        return coco_fid_captions(path, num_images or DEFAULT_NUM_IMAGES["coco"], seed)
    if not path.exists():
        raise ValueError(
            f"--captions {source}: no such file or folder; pass a COCO-2014 folder, a captions .json, a text file "
            f"(one caption per line) or one of {sorted(WORLD_SOURCES)}"
        )
    lines = read_captions_file(path)
    num_images = num_images or len(lines)
    return [lines[i % len(lines)] for i in range(num_images)]
