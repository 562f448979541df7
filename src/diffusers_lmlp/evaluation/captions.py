"""Captions: what one is in any data source (`captions_of`), and those an evaluation samples (COCO val2014's as the
reference protocol draws them, a captions file's, or an embedded world's)."""

import json
from pathlib import Path

import numpy as np

from ..worlds import WORLDS, load


COCO_VAL_ANNOTATIONS = Path("annotations") / "captions_val2014.json"
# A world source is `<world>[:train|:heldout][:varied]`: a split (default: all), phrased at random with `:varied`.
SPLITS = {"": None, ":train": "train", ":heldout": "heldout"}
WORLD_SOURCES = tuple(f"{w}{s}{v}" for w in ("shapes", "emoji") for v in ("", ":varied") for s in SPLITS)
DEFAULT_NUM_IMAGES = {"coco": 30_000, "shapes": 1_000, "emoji": 1_000}


def captions_of(value) -> list[str]:
    """The captions of one sample's caption column: a non-empty string or list of them, else `ValueError`."""
    captions = [value] if isinstance(value, str) else list(value) if isinstance(value, list | tuple) else []
    if not captions or not all(isinstance(c, str) and c.strip() for c in captions):
        raise ValueError(f"a caption must be a non-empty string or a non-empty list of them, got {value!r}")
    return captions


COCO_FIELDS = {"images": {"id": int, "file_name": str}, "annotations": {"id": int, "image_id": int, "caption": str}}


def coco_captions(coco: dict, annotations_file: Path) -> dict[int, list[str]]:
    """The captions of each image id of a parsed COCO captions file, in file order."""
    for kind, fields in COCO_FIELDS.items():
        entries = coco[kind] if isinstance(coco[kind], list) else [coco[kind]]
        for n, entry in enumerate(entries):
            if not isinstance(entry, dict) or not all(isinstance(entry.get(k), t) for k, t in fields.items()):
                need = ", ".join(f"{k!r} ({t.__name__})" for k, t in fields.items())
                raise ValueError(f"{annotations_file}: {kind}[{n}] is {entry!r:.120}: each entry needs {need}")
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
    """The stripped lines of a UTF-8 text file, blank and `#` lines skipped; `ValueError` (naming `option`) if none."""
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
        raise ValueError(f"{option} has no prompts: write one prompt per line (blank and # lines are skipped)")
    return lines


def coco_fid_captions(annotations_file: str | Path, num_images: int, seed: int) -> list[str]:
    """COCO captions drawn as U-ViT's FID protocol does: seeded shuffled passes, a random caption of each."""
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
    """An embedded world's captions, each item drawn evenly (±1) in a seeded order; `:varied` phrases them at random
    after the same order, so caption i describes the same item either way."""
    name, *parts = source.split(":")
    split = SPLITS[":" + parts[0] if parts and parts[0] != "varied" else ""]
    count, canonical, varied = load(WORLDS[name].caption_items)(split)
    rng = np.random.default_rng(seed)
    order = np.concatenate([rng.permutation(count) for _ in range(-(-num_images // count))])[:num_images]
    return [varied(i, rng) if source.endswith(":varied") else canonical(i) for i in order]


def draw_captions(source: str, num_images: int | None = None, seed: int = 0) -> list[str]:
    """`num_images` captions (default: 30,000 for COCO, 1,000 for a world, each line once for a text file) from a world
    source (`WORLD_SOURCES`), a COCO-2014 folder or captions `.json`, or a text file (repeated when shorter)."""
    if num_images is not None and num_images < 1:
        raise ValueError(f"The number of images must be positive; got {num_images}")
    if source in WORLD_SOURCES:
        return world_captions(source, num_images or DEFAULT_NUM_IMAGES[source.split(":")[0]], seed)
    path = Path(source)
    kinds = f"pass a COCO-2014 folder, a captions .json, a text file or one of {sorted(WORLD_SOURCES)}"
    if path.is_dir():
        if not (path / COCO_VAL_ANNOTATIONS).is_file():
            raise ValueError(f"--captions {source} is a folder without {COCO_VAL_ANNOTATIONS}: {kinds}")
        path = path / COCO_VAL_ANNOTATIONS
    if path.suffix == ".json":
        return coco_fid_captions(path, num_images or DEFAULT_NUM_IMAGES["coco"], seed)
    if not path.exists():
        raise ValueError(f"--captions {source}: no such file or folder; {kinds}")
    lines = read_captions_file(path)
    num_images = num_images or len(lines)
    return [lines[i % len(lines)] for i in range(num_images)]
