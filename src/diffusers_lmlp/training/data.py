"""The training images and captions: COCO-2014, an imagefolder, a `datasets` dataset (Hub, folder or `save_to_disk`),
all read as rows of `{image column: PIL image, caption column: a caption or a list of captions}`.

Every loader checks the layout before anything is encoded, and names the file or folder that is wrong.
"""

import json
import logging
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from ..evaluation.captions import coco_captions
from ..image_tensors import center_crop_resize
from .imagefolder import check_imagefolder_metadata, load_imagefolder, metadata_file_names


logger = logging.getLogger(__name__)

# `--data_layout` values ("auto": COCO-2014 when the folder has its layout, else an imagefolder).
DATA_LAYOUTS = ("auto", "imagefolder", "coco2014")
# As the official archives unpack: `<root>/<split>/*.jpg`, `<root>/annotations/captions_<split>.json`.
COCO_SPLITS = ("train2014", "val2014")


def load_training_data(
    *,
    dataset_name: str | None,
    dataset_config_name: str | None,
    train_data_dir: str | None,
    data_layout: str = "auto",
    image_column: str,
    caption_column: str,
    max_train_samples: int | None,
    streaming: bool,
    seed: int,
    cache_dir: str,
    world: str | None = "shapes",
    shapes_split: str = "train",
    shapes_num_images: int | None = None,
):
    """The training split: a map-style `datasets.Dataset` (an `IterableDataset` with `streaming`).

    Args:
        dataset_name (`str`, *optional*): A Hub id, a local dataset folder, or a folder written by `save_to_disk`.
        dataset_config_name (`str`, *optional*): Its configuration.
        train_data_dir (`str`, *optional*): A local folder laid out as `data_layout` says.
        data_layout (`str`, *optional*, defaults to `"auto"`): `"imagefolder"`, `"coco2014"` or `"auto"`.
        image_column (`str`): The column of the images.
        caption_column (`str`): The column of the captions (a caption or a list per image).
        max_train_samples (`int`, *optional*): Keep only the first this many samples.
        streaming (`bool`): Stream `dataset_name` instead of downloading it whole.
        seed (`int`): Seed of the procedural shapes world, used when no data is given.
        cache_dir (`str`): Where `datasets` caches what it prepares.
        world (`str`, *optional*, defaults to `"shapes"`): The embedded world trained on when no data is given.
        shapes_split (`str`, *optional*, defaults to `"train"`): The shapes world's split: `"train"` or `"heldout"`.
        shapes_num_images (`int`, *optional*): How many shapes images to render (`make_dataset`'s default if unset).

    Raises:
        `ValueError`: For a bad layout, an unusable metadata row, or a missing column, naming it.
    """
    import datasets

    if data_layout not in DATA_LAYOUTS:
        raise ValueError(f"unknown data layout {data_layout!r}; choose one of {DATA_LAYOUTS}")
    hint = ""
    if dataset_name and is_saved_dataset(Path(dataset_name)):
        dataset = load_saved_dataset(Path(dataset_name), dataset_config_name, streaming)
    elif dataset_name:
        if Path(dataset_name).is_dir():  # a local imagefolder, when it has metadata
            metadata = sorted(p for name in metadata_file_names() for p in Path(dataset_name).rglob(name))
            check_imagefolder_metadata(metadata, caption_column)
            if metadata:
                hint = " (a local imagefolder: --train_data_dir reads its captions whatever its file names are)"
        dataset = datasets.load_dataset(dataset_name, dataset_config_name, cache_dir=cache_dir, streaming=streaming)
        dataset = train_split(dataset, f"--dataset_name {dataset_name}")
    elif train_data_dir:
        dataset = load_data_dir(Path(train_data_dir), data_layout, image_column, caption_column, cache_dir)
    elif world == "shapes":
        from diffusers_lmlp.shapes.world import make_dataset

        dataset = make_dataset(shapes_split, num_images=shapes_num_images, seed=seed)
    else:
        from diffusers_lmlp.emoji.world import make_dataset

        dataset = make_dataset("train")
    columns = dataset.column_names or list(dataset.features or [])
    for flag, column in (("--image_column", image_column), ("--caption_column", caption_column)):
        if column not in columns:
            raise ValueError(f"{flag} {column!r} is not a column of the dataset; its columns are {columns}{hint}")
    if max_train_samples is not None:
        dataset = (
            dataset.take(max_train_samples)
            if streaming
            else dataset.select(range(min(max_train_samples, len(dataset))))
        )
    return dataset


def is_saved_dataset(folder: Path) -> bool:
    """Whether `folder` was written by `save_to_disk` (a `Dataset` or `DatasetDict`), which `load_dataset` refuses."""
    return (folder / "dataset_dict.json").is_file() or all(
        (folder / name).is_file() for name in ("state.json", "dataset_info.json")
    )


def load_saved_dataset(folder: Path, dataset_config_name: str | None, streaming: bool):
    """The training split of a folder written by `save_to_disk` (memory-mapped; an `IterableDataset` with
    `streaming`); a saved dataset has no configurations, so `dataset_config_name` must be unset."""
    import datasets

    if dataset_config_name is not None:
        raise ValueError(
            f"--dataset_name {folder} was written by save_to_disk, which saves no configurations: drop "
            f"--dataset_config_name {dataset_config_name}"
        )
    dataset = train_split(datasets.load_from_disk(str(folder)), f"--dataset_name {folder}")
    return dataset.to_iterable_dataset() if streaming else dataset


def train_split(dataset, source: str):
    """The `train` split of a `DatasetDict` (or `IterableDatasetDict`); a single dataset as it is. `source` names
    where it came from, for the error."""
    import datasets

    if not isinstance(dataset, datasets.DatasetDict | datasets.IterableDatasetDict):
        return dataset
    if "train" not in dataset:
        raise ValueError(
            f"{source} has the splits {sorted(dataset)} and no 'train' split, which is what the trainer reads: "
            "save or name the training data as 'train'"
        )
    return dataset["train"]


def load_data_dir(folder: Path, data_layout: str, image_column: str, caption_column: str, cache_dir: str | None):
    """The training split of `--train_data_dir`: COCO-2014's `train2014` or an imagefolder's training split."""
    if not folder.is_dir():
        raise ValueError(f"--train_data_dir {folder} is not a folder")
    if data_layout == "auto":
        data_layout = detect_layout(folder)
    if data_layout == "coco2014":
        return load_coco2014(folder, "train2014", image_column, caption_column)
    return load_imagefolder(folder, caption_column, cache_dir)


def detect_layout(folder: Path) -> str:
    """`"coco2014"` for a folder laid out as the COCO-2014 archives unpack, `"imagefolder"` otherwise.

    A partly unpacked COCO folder without imagefolder metadata counts as COCO: `load_coco2014` names what is missing.
    """
    annotations = (folder / "annotations" / "captions_train2014.json").is_file()
    images = (folder / "train2014").is_dir()
    metadata = any((folder / name).is_file() for name in metadata_file_names())
    if (annotations and images) or ((annotations or images) and not metadata):
        logger.info(f"{folder} is laid out as COCO-2014 (annotations/captions_train2014.json, train2014/)")
        return "coco2014"
    return "imagefolder"


def load_coco2014(root: Path, split: str = "train2014", image_column: str = "image", caption_column: str = "text"):
    """One split of COCO-2014 as the official archives unpack it, one row per image with all of its captions.

    Rows are in image-id order and captions in the annotations file's order, as pycocotools (and U-ViT) reads them.

    Args:
        root (`Path`): The COCO folder, holding `annotations/captions_<split>.json` and `<split>/`.
        split (`str`, *optional*, defaults to `"train2014"`): `"train2014"` or `"val2014"`.
        image_column (`str`, *optional*, defaults to `"image"`): The name of the image column.
        caption_column (`str`, *optional*, defaults to `"text"`): The name of the caption-list column.

    Returns:
        `datasets.Dataset`: Columns `image_column` (decoded lazily), `caption_column` (a list) and `image_id`.

    Raises:
        `ValueError`: When a file, an image or a caption is missing or malformed, naming the path.
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
