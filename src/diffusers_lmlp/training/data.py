"""The training images and captions: the official COCO-2014 layout, an imagefolder with metadata, or a `datasets`
dataset, all read as rows of `{image column: PIL image, caption column: a caption or a list of captions}`.

Every loader here checks the layout before anything is encoded, and names the file or folder that is wrong.
"""

import csv
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from PIL import Image


# `--data_layout` values: how `--train_data_dir` is laid out.
DATA_LAYOUTS = ("imagefolder", "coco2014")
# The COCO-2014 splits, as the official archives unpack: `<root>/<split>/*.jpg`,
# `<root>/annotations/captions_<split>.json`.
COCO_SPLITS = ("train2014", "val2014")


def load_training_data(
    *,
    dataset_name: str | None,
    dataset_config_name: str | None,
    train_data_dir: str | None,
    data_layout: str,
    image_column: str,
    caption_column: str,
    max_train_samples: int | None,
    streaming: bool,
    seed: int,
    cache_dir: str,
    shapes_split: str = "train",
):
    """The training split: a map-style `datasets.Dataset` (an `IterableDataset` with `streaming`).

    Args:
        dataset_name (`str`, *optional*): A `datasets` Hub id or a local dataset folder.
        dataset_config_name (`str`, *optional*): Its configuration.
        train_data_dir (`str`, *optional*): A local folder laid out as `data_layout` says.
        data_layout (`str`): `"imagefolder"` (images with `metadata.jsonl`/`metadata.csv`) or `"coco2014"` (the
            official COCO-2014 layout, whose `train2014` split is read).
        image_column (`str`): The column of the images (`"image"` for a COCO folder).
        caption_column (`str`): The column of the captions (`"text"` for a COCO folder, a list per image).
        max_train_samples (`int`, *optional*): Keep only the first this many samples.
        streaming (`bool`): Stream `dataset_name` instead of downloading it whole.
        seed (`int`): Seed of the procedural shapes world, used when no data is given.
        cache_dir (`str`): Where `datasets` caches what it prepares.
        shapes_split (`str`, *optional*, defaults to `"train"`): The shapes world's split used when no data is given:
            `"train"` or `"heldout"` (the combinations held out of the shipped model's training).

    Raises:
        `ValueError`: For a bad layout, a row without a usable caption or a column the dataset lacks, naming it.
    """
    import datasets

    if dataset_name:
        if Path(dataset_name).is_dir():  # a local imagefolder, when it has metadata
            check_imagefolder_captions(Path(dataset_name), caption_column)
        dataset = datasets.load_dataset(dataset_name, dataset_config_name, cache_dir=cache_dir, streaming=streaming)
        dataset = dataset["train"]
    elif train_data_dir and data_layout == "coco2014":
        dataset = load_coco2014(Path(train_data_dir), "train2014", image_column, caption_column)
    elif train_data_dir:
        check_imagefolder_captions(Path(train_data_dir), caption_column)
        dataset = datasets.load_dataset("imagefolder", data_dir=train_data_dir, cache_dir=cache_dir)["train"]
    else:
        from diffusers_lmlp.shapes.world import make_dataset

        dataset = make_dataset(shapes_split, seed=seed)
    columns = dataset.column_names or list(dataset.features or [])
    for flag, column in (("--image_column", image_column), ("--caption_column", caption_column)):
        if column not in columns:
            raise ValueError(f"{flag} {column!r} is not a column of the dataset; its columns are {columns}")
    if max_train_samples is not None:
        dataset = (
            dataset.take(max_train_samples)
            if streaming
            else dataset.select(range(min(max_train_samples, len(dataset))))
        )
    return dataset


def load_coco2014(root: Path, split: str = "train2014", image_column: str = "image", caption_column: str = "text"):
    """One split of COCO-2014 as the official archives unpack it, one row per image with all of its captions.

    `root/annotations/captions_<split>.json` (from `annotations_trainval2014.zip`) lists the images and their
    captions (5 to 7 each); `root/<split>/` (from `<split>.zip`) holds the JPEGs. Rows are in image-id order and
    each image's captions in the order of the annotations file, as pycocotools (and so U-ViT's extraction) reads
    them. Training picks one of them at random at every use of the image.

    Args:
        root (`Path`): The COCO folder, holding `annotations/` and `<split>/`.
        split (`str`, *optional*, defaults to `"train2014"`): `"train2014"` or `"val2014"`.
        image_column (`str`, *optional*, defaults to `"image"`): The name of the image column.
        caption_column (`str`, *optional*, defaults to `"text"`): The name of the caption-list column.

    Returns:
        `datasets.Dataset`: Columns `image_column` (decoded lazily from the JPEG paths), `caption_column` (a list of
        strings) and `image_id`.

    Raises:
        `ValueError`: When the annotations file or the image folder is missing, the JSON lacks COCO's `images` /
            `annotations`, an image has no caption (or an empty one), a caption names an unknown image, or a listed
            image file is missing; the message names the path.
    """
    import datasets

    if split not in COCO_SPLITS:
        raise ValueError(f"unknown COCO-2014 split {split!r}; choose one of {COCO_SPLITS}")
    annotations_file, image_dir = root / "annotations" / f"captions_{split}.json", root / split
    layout = (
        f"lay it out as the official archives unpack: {root}/annotations/captions_{split}.json (from "
        f"annotations_trainval2014.zip) and {root}/{split}/COCO_{split}_<id>.jpg (from {split}.zip)"
    )
    if not annotations_file.is_file():
        raise ValueError(f"{root} is not a COCO-2014 folder: {annotations_file} is missing; {layout}")
    if not image_dir.is_dir():
        raise ValueError(f"{root} is not a COCO-2014 folder: the image folder {image_dir} is missing; {layout}")
    with open(annotations_file, encoding="utf-8") as f:
        coco = json.load(f)
    if not isinstance(coco, dict) or not {"images", "annotations"} <= coco.keys():
        raise ValueError(f"{annotations_file} is not a COCO captions file: it needs 'images' and 'annotations' lists")
    captions = coco_captions(coco, annotations_file)
    images = sorted(coco["images"], key=lambda image: image["id"])
    paths = [image_dir / image["file_name"] for image in images]
    missing = [str(path) for path in paths if not path.is_file()]
    if missing:
        raise ValueError(
            f"{annotations_file} lists {len(missing)} image(s) that {image_dir} lacks, e.g. {missing[0]}: unpack "
            f"{split}.zip whole into {root}"
        )
    uncaptioned = [image["id"] for image in images if image["id"] not in captions]
    if uncaptioned:
        raise ValueError(
            f"{annotations_file}: image id {uncaptioned[0]} (and {len(uncaptioned) - 1} more) has no caption"
        )
    rows = {
        image_column: [str(path) for path in paths],
        caption_column: [captions[image["id"]] for image in images],
        "image_id": [image["id"] for image in images],
    }
    return datasets.Dataset.from_dict(rows).cast_column(image_column, datasets.Image())


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


def center_crop_resize(image: Image.Image, resolution: int) -> Image.Image:
    """Centre-crop to a square on the short side and resize to `resolution` with Lanczos, as U-ViT prepares COCO.

    Args:
        image (`Image.Image`): Any PIL image (converted to RGB).
        resolution (`int`): The side of the output.
    """
    image = image.convert("RGB")
    side = min(image.size)
    left, top = (image.width - side) // 2, (image.height - side) // 2
    return image.crop((left, top, left + side, top + side)).resize((resolution, resolution), Image.Resampling.LANCZOS)


def preprocess_image(image: Image.Image, resolution: int, flip: bool) -> torch.Tensor:
    """Centre-crop to a square, resize to `resolution` (Lanczos, as the reference), map to [-1, 1].

    Args:
        image (`Image.Image`): Any PIL image (converted to RGB).
        resolution (`int`): The side of the output.
        flip (`bool`): Mirror it left to right.

    Returns:
        `torch.Tensor`: (3, resolution, resolution).
    """
    image = center_crop_resize(image, resolution)
    if flip:
        image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    pixels = torch.from_numpy(np.asarray(image, dtype=np.float32) / 127.5 - 1.0)  # (H, W, 3)
    return pixels.permute(2, 0, 1).contiguous()  # (3, H, W)


def check_imagefolder_captions(folder: Path, caption_column: str) -> None:
    """Refuse an imagefolder whose metadata (`metadata.jsonl` or `metadata.csv`) has a row without a usable caption.

    Checked before any feature extraction: `datasets` fills a missing caption with None (a crash much later), and an
    empty caption would silently train as the unconditional "".

    Args:
        folder (`Path`): The imagefolder (metadata files may also sit in its subfolders).
        caption_column (`str`): The `--caption_column`.

    Raises:
        `ValueError`: Naming the metadata file, the line, the row's `file_name` and what is wrong (or, when no row
            has the column, the columns there are).
    """
    for metadata in sorted([*folder.rglob("metadata.jsonl"), *folder.rglob("metadata.csv")]):
        columns, problem = set(), None
        for line, row in metadata_rows(metadata):
            columns |= row.keys()
            if problem is None and caption_column not in row:
                problem = f"line {line} (file_name {row.get('file_name')!r}): it has no {caption_column!r} field"
            elif problem is None:
                try:
                    captions_of(row[caption_column])
                except ValueError as error:
                    problem = f"line {line} (file_name {row.get('file_name')!r}): {error}"
        if columns and caption_column not in columns:
            raise ValueError(
                f"--caption_column {caption_column!r} is not a column of the dataset; the columns of "
                f"{metadata} are {sorted(columns)}"
            )
        if problem:
            raise ValueError(f"{metadata} {problem}. Every image needs a caption: fix or remove that row.")


def metadata_rows(metadata: Path) -> Iterator[tuple[int, dict]]:
    """Yield `(line number, row)` for each row of an imagefolder's `metadata.jsonl` or `metadata.csv`.

    Args:
        metadata (`Path`): The metadata file.

    Raises:
        `ValueError`: For a JSON Lines row that is not a JSON object.
    """
    with open(metadata, encoding="utf-8", newline="") as f:
        if metadata.suffix == ".csv":
            reader = csv.DictReader(f)
            for row in reader:
                yield reader.line_num, {k: v for k, v in row.items() if v is not None}
            return
        for line, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as error:
                raise ValueError(f"{metadata} line {line} is not valid JSON: {error}") from None
            if not isinstance(row, dict):
                raise ValueError(f"{metadata} line {line} is not a JSON object")
            yield line, row


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
