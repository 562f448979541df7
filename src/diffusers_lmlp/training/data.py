"""The training images and captions, and the batches of a run. COCO-2014, an imagefolder (its metadata checked before
anything is encoded) or a `datasets` dataset, read as rows of `{image column: PIL image, caption column: captions}`;
each optimizer step's samples, caption dropout, noise and latents, read ahead by `DataLoader` workers from the feature
store (`build_feature_store`) or the images. Every random choice is a function of (seed, step, sample position)
(`step_generator`), so a resumed run continues exactly as the uninterrupted one, with any number of workers.
"""

import csv
import hashlib
import io
import itertools
import json
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from ..evaluation.captions import captions_of, coco_captions
from ..image_tensors import center_crop_resize
from .features import FeatureStore, encode_text, feature_store_key, open_feature_store


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
    check_rows(dataset, image_column, caption_column)
    return dataset


def check_rows(dataset, image_column: str, caption_column: str) -> None:
    """Refuse at start-up what a run would otherwise die on mid-way: a caption column that holds no text, a row
    whose caption is missing or empty, an image that cannot be opened (0 bytes, not an image). Images are opened,
    not decoded. A stream is checked by its columns' types alone."""
    import datasets

    features = dataset.features or {}
    image_feature, caption_feature = features.get(image_column), features.get(caption_column)
    if image_feature is not None and not isinstance(image_feature, datasets.Image):
        raise ValueError(f"--image_column {image_column!r} holds {image_feature}, not images: name the image column")
    inner = caption_feature[0] if isinstance(caption_feature, list) else getattr(caption_feature, "feature", None)
    text = inner if inner is not None else caption_feature
    if caption_feature is not None and getattr(text, "dtype", None) not in ("string", "large_string"):
        raise ValueError(
            f"--caption_column {caption_column!r} holds {caption_feature}, not text (a metadata.csv column of numbers "
            "is read as numbers): name the caption column, or write the captions to metadata.jsonl as strings"
        )
    if isinstance(dataset, datasets.IterableDataset):
        return
    for row, value in enumerate(dataset.select_columns([caption_column])[caption_column]):
        try:
            captions_of(value)
        except ValueError as error:
            raise ValueError(f"row {row} of the training data: {error}; fix or remove the row") from None
    if image_feature is None:
        return
    images = dataset.select_columns([image_column]).cast_column(image_column, datasets.Image(decode=False))
    for start in range(0, len(images), 256):
        for row, value in enumerate(images[start : start + 256][image_column], start):
            try:
                with Image.open(io.BytesIO(value["bytes"]) if value["bytes"] else value["path"]):
                    pass
            except (OSError, ValueError) as error:  # UnidentifiedImageError is an OSError
                name = f" {value['path']}" if value.get("path") else ""
                raise ValueError(
                    f"row {row} of the training data: its image{name} cannot be read ({error}); replace or remove it"
                ) from None


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


# What pandas, which `datasets` reads a metadata.csv with, takes for a missing value: such a caption becomes None.
CSV_MISSING_VALUES = frozenset(
    ["#N/A", "#N/A N/A", "#NA", "-1.#IND", "-1.#QNAN", "-NaN", "-nan", "1.#IND", "1.#QNAN", "<NA>", "N/A", "NA", "NULL",
     "NaN", "None", "n/a", "nan", "null"]
)  # fmt: skip


def load_imagefolder(folder: Path, caption_column: str = "text", cache_dir: str | None = None):
    """The training split of an imagefolder: the images its metadata files list, after `check_imagefolder_metadata`.
    `datasets` alone would also split by file name (`COCO_train2014_….jpg` into a "train" split, without captions), so
    only folders split here (`imagefolder_split`) and the training files are passed as `data_files`."""
    import datasets

    patterns, metadata = imagefolder_split(folder, caption_column)
    check_imagefolder_metadata(metadata, caption_column)
    return datasets.load_dataset(
        "imagefolder", data_dir=str(folder), data_files={"train": patterns}, cache_dir=cache_dir
    )["train"]


def imagefolder_split(folder: Path, caption_column: str) -> tuple[list[str], list[Path]]:
    """The `data_files` patterns of an imagefolder's training split, and its metadata files: the training split
    folders (`train/`, `train2014/`, … as `datasets` names them) when they hold metadata, else the whole folder. The
    folder is walked once, as `datasets`' search of every split pattern is slow in a large folder."""
    names, split_folders, metadata, unread = metadata_file_names(), {}, {}, set()
    for root, subfolders, files in os.walk(folder):
        subfolders[:] = sorted(name for name in subfolders if not name.startswith((".", "__")))  # as datasets skips
        here = Path(root).relative_to(folder)
        splits = {split for split, where in split_folders.items() for path in where if here.is_relative_to(path)}
        for name in subfolders:
            if split := split_of(name):
                split_folders.setdefault(split, []).append(here / name)
        for name in sorted(files):
            if name in names:
                metadata[Path(root) / name] = splits
            elif name.startswith("metadata."):
                unread.add(name)
    training = [path for path, splits in metadata.items() if "train" in splits]
    if training:
        return [f"{path.as_posix()}/**" for path in split_folders["train"]], training
    in_splits = [path for path, splits in metadata.items() if splits]
    if in_splits:
        listed = ", ".join(sorted(str(path) for paths in split_folders.values() for path in paths))
        raise ValueError(
            f"{folder} is split into folders ({listed}), and its training split has no metadata file (other splits "
            f"have, e.g. {in_splits[0]}): put the training images and their metadata in {folder / 'train'}"
        )
    if not metadata:
        raise ValueError(no_metadata_message(folder, unread, caption_column))
    return ["**"], list(metadata)


def split_of(name: str) -> str | None:
    """The split a folder of this name holds for `datasets` (`"train"` for `train/`, `train2014/`, `coco_train/`, …),
    or None."""
    from datasets.data_files import NON_WORDS_CHARS, SPLIT_KEYWORDS

    for split, keywords in SPLIT_KEYWORDS.items():
        if re.search(f"(^|[{NON_WORDS_CHARS}])({'|'.join(keywords)})([{NON_WORDS_CHARS}]|$)", name):
            return str(split)
    return None


def metadata_file_names() -> list[str]:
    """The names of the metadata files of an imagefolder that the installed `datasets` reads."""
    from datasets.packaged_modules.imagefolder.imagefolder import ImageFolder

    return list(ImageFolder.METADATA_FILENAMES)


def no_metadata_message(folder: Path, unread: set[str], caption_column: str) -> str:
    """Why an imagefolder without metadata cannot be trained on, and how to give its images captions (`unread`: its
    files that look like metadata but that `datasets` does not read)."""
    import datasets

    found = f" ({', '.join(sorted(unread))} is not one that datasets {datasets.__version__} reads)" if unread else ""
    example = json.dumps({"file_name": "0001.jpg", caption_column: "a red bus parked on a street"})
    return (
        f"{folder} has no metadata file ({', '.join(metadata_file_names())}){found}, so its images have no captions "
        "(datasets would label them with their folder names instead). Add a metadata.jsonl next to the images, one "
        f"line per image: {example}. For COCO-2014, pass the folder that holds annotations/captions_train2014.json "
        "and train2014/."
    )


def check_imagefolder_metadata(metadata: list[Path], caption_column: str) -> None:
    """Refuse imagefolder metadata with a row that lacks a usable caption or its image, before anything is encoded:
    `datasets` would fill a missing caption with None (a crash much later) and train an empty one as "". Only the
    metadata are read, and the images' existence checked."""
    formats = sorted({path.suffix for path in metadata})
    if len(formats) > 1:
        first, other = (next(path for path in metadata if path.suffix == suffix) for suffix in formats[:2])
        raise ValueError(
            f"the metadata files mix formats ({', '.join(formats)}), e.g. {first} and {other}: datasets reads one "
            "format per dataset, so write them all in one"
        )
    first_caption = {}
    for path in metadata:
        check_metadata_file(path, caption_column, first_caption)


def check_metadata_file(metadata: Path, caption_column: str, first_caption: dict[str, str] | None = None) -> None:
    """Refuse a metadata file with no rows, without the caption column, with a row `row_problem` finds wrong, or
    with captions of both kinds (lists and strings), on which `datasets` fails deep inside Arrow. `first_caption` holds
    the dataset's first caption (`"where"`, `"kind"`), shared between its metadata files."""
    first_values, first_problem, problems, listings = {}, None, 0, {}
    first_caption = {} if first_caption is None else first_caption
    folder, is_csv = str(metadata.parent), metadata.suffix == ".csv"
    for where, row in metadata_rows(metadata):
        for column in row.keys() - first_values.keys():
            first_values[column] = row[column]
        problem = row_problem(row, caption_column, folder, is_csv, listings) or caption_kind_problem(
            row[caption_column], f"{metadata} {where}", first_caption
        )
        if problem:
            problems += 1
            first_problem = first_problem or f"{where} (file_name {row.get('file_name')!r}): {problem}"
    if not first_values:
        raise ValueError(f"{metadata} has no rows: list each image with its caption, or remove the file")
    if caption_column not in first_values:
        raise ValueError(missing_caption_column_message(metadata, caption_column, first_values))
    if first_problem:
        more = f" ({problems - 1} more rows are wrong too)" if problems > 1 else ""
        raise ValueError(
            f"{metadata} {first_problem}{more}. Every row needs a caption and its image: fix or remove that row."
        )


def row_problem(
    row: dict, caption_column: str, folder: str, is_csv: bool, listings: dict[str, set[str]]
) -> str | None:
    """What is wrong with a metadata row (its caption, its `file_name`, its image), or None; `file_name` is relative
    to `folder`, the metadata file's, and `listings` caches folder listings (`is_file`)."""
    if caption_column not in row:
        return f"it has no {caption_column!r} field"
    value = row[caption_column]
    if is_csv and value in CSV_MISSING_VALUES:
        return f"its caption {value!r} reads as a missing value (datasets reads metadata.csv with pandas)"
    try:
        captions_of(value)
    except ValueError as error:
        return str(error)
    names = [row[key] for key in row if key == "file_name" or key.endswith("_file_name")]
    if not names or not all(isinstance(name, str) and name for name in names):
        return "it has no file_name (the image's path relative to the metadata file)"
    for name in names:
        if name.startswith(os.sep) or ".." in name:  # only then can it point outside the folder
            relative = os.path.normpath(name)
            if os.path.isabs(relative) or relative == ".." or relative.startswith(".." + os.sep):
                return f"its file_name must be a path inside {folder}"
        path = os.path.join(folder, name)
        if not is_file(path, listings):
            return f"its image {path} is missing"
    return None


def caption_kind_problem(value: str | list[str], where: str, first_caption: dict[str, str]) -> str | None:
    """Whether a (valid) caption is a string where the dataset's first is a list, or the other way round; an empty
    `first_caption` is filled with this one's `"where"` and `"kind"`."""
    kind = "a list of captions" if isinstance(value, list | tuple) else "a string"
    if not first_caption:
        first_caption.update(where=where, kind=kind)
        return None
    if kind == first_caption["kind"]:
        return None
    return (
        f"its caption is {kind}, where {first_caption['where']}'s is {first_caption['kind']}: datasets needs one type "
        'per column, so write every caption as a list (a single caption as ["..."]) or every one as a string'
    )


def is_file(path: str, listings: dict[str, set[str]]) -> bool:
    """Whether `path` is a file, from one listing of its folder cached in `listings`: much faster than a `stat` per
    image in a large folder."""
    folder, name = os.path.split(path)
    if folder not in listings:
        try:
            with os.scandir(folder) as entries:
                listings[folder] = {entry.name for entry in entries if entry.is_file()}
        except OSError:  # no such folder
            listings[folder] = set()
    return name in listings[folder] or os.path.isfile(path)  # isfile: a name a case-insensitive system matches


def missing_caption_column_message(metadata: Path, caption_column: str, first_values: dict) -> str:
    """The caption column is in no row of `metadata`: which column to pass instead (`first_values`: each column's
    first value)."""
    candidates = []
    for column, value in first_values.items():
        try:
            captions_of(value)
        except ValueError:
            continue
        if not (column == "file_name" or column.endswith("_file_name")):
            candidates.append(column)
    problem = (
        f"--caption_column {caption_column!r} is not a column of the dataset: {metadata} has no {caption_column!r} "
        "field"
    )
    if len(candidates) == 1:
        return f"{problem}; its rows have {candidates[0]!r}: pass --caption_column {candidates[0]}"
    if candidates:
        listed = ", ".join(map(repr, candidates))
        return f"{problem}; its rows have {listed}: pass --caption_column with the one that holds the captions"
    return f"{problem}, and none of its columns {sorted(first_values)} holds text: add a caption to every row"


def metadata_rows(metadata: Path) -> Iterator[tuple[str, dict]]:
    """Yield `(where, row)` for each row of an imagefolder metadata file: `"line <n>"` in a `.jsonl` or `.csv`,
    `"row <i>"` (from 0) in a `.parquet`; `ValueError` for a row that is not a JSON object or an unreadable parquet."""
    if metadata.suffix == ".parquet":
        import pyarrow
        import pyarrow.parquet

        try:
            batches = pyarrow.parquet.ParquetFile(metadata).iter_batches()
            index = 0
            for batch in batches:
                for row in batch.to_pylist():
                    yield f"row {index}", row
                    index += 1
        except pyarrow.ArrowException as error:
            raise ValueError(f"{metadata} is not a readable parquet file: {error}") from None
        return
    with open(metadata, encoding="utf-8", newline="") as f:
        if metadata.suffix == ".csv":
            reader = csv.DictReader(f)
            for row in reader:
                yield f"line {reader.line_num}", {k: v for k, v in row.items() if v is not None}
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
            yield f"line {line}", row


def step_generator(seed: int, *keys: int) -> torch.Generator:
    """A generator that depends only on the seed and the keys (step, sample position, …): exact resume."""
    digest = hashlib.sha256(repr((seed, *keys)).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


def build_feature_store(args, dataset, tokenizer, text_encoder, vae, accelerator, cache_dir: Path) -> FeatureStore:
    """The feature store `<cache_dir>/features/<key>` of this data and these components, extracted first if needed
    (each process its shards)."""
    columns = dict(image_column=args.image_column, caption_column=args.caption_column, resolution=args.resolution)
    components = dict(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae)
    text_dtype = args.cache_text_dtype or "float32"
    key = feature_store_key(dataset, **columns, **components, text_dtype=text_dtype)
    try:
        return open_feature_store(
            cache_dir / "features" / key,
            dataset,
            process_index=accelerator.process_index,
            num_processes=accelerator.num_processes,
            wait_for_everyone=accelerator.wait_for_everyone,
            **columns,
            **components,
            text_dtype=text_dtype,
            num_workers=args.dataloader_num_workers,
        )
    except (OSError, ValueError) as error:  # a caption that is not one, a store other processes cannot see
        raise SystemExit(f"error: {error}") from None


class BatchReader:
    """The CPU half of making a batch, run in `DataLoader` workers: the random draws, then the samples from the
    feature store (latents re-sampled from the stored moments, as the reference does) or decoded images.

    A map-style dataset is an endless stream of seeded per-epoch permutations, so resuming needs no data state; a
    streaming one is read in order from this process's shard, skipping what the steps before `step` used.
    """

    def __init__(self, args, dataset, store: FeatureStore | None, process_index: int, num_processes: int, step: int):
        self.args, self.dataset, self.store = args, dataset, store
        self.process_index, self.num_processes, self.step = process_index, num_processes, step
        self._permutation = (-1, None)
        self._stream = None

    def sample_index(self, position: int) -> int:
        """Index of the sample at `position` of the endless stream of per-epoch permutations."""
        epoch, offset = divmod(position, len(self.dataset))
        if self._permutation[0] != epoch:
            generator = step_generator(self.args.seed, "epoch", epoch)
            # As a NumPy array: much cheaper to index than a tensor.
            self._permutation = (epoch, torch.randperm(len(self.dataset), generator=generator).numpy())
        return int(self._permutation[1][offset])

    def _next_records(self, count: int) -> list[dict]:
        if self._stream is None:
            self._stream = self._epochs()
            per_step = self.args.train_batch_size * self.args.gradient_accumulation_steps
            self._next_records(self.step * per_step)  # what the steps before a resume consumed
        return [next(self._stream) for _ in range(count)]

    def _epochs(self) -> Iterator[dict]:
        """This process's shard of the stream, shuffled, epoch after epoch, one record at a time.

        Read with `iter(batch_size=1)`: iterating the dataset in a worker lets `datasets` split it between workers.
        """
        from datasets.distributed import split_dataset_by_node

        shard = split_dataset_by_node(self.dataset, self.process_index, self.num_processes)
        shard = shard.shuffle(seed=self.args.seed, buffer_size=1000)
        for epoch in itertools.count():
            shard.set_epoch(epoch)
            empty = True
            for batch in shard.iter(batch_size=1):
                empty = False
                yield {column: values[0] for column, values in batch.items()}
            if empty:
                raise ValueError(f"the stream of process {self.process_index} is empty: it has no records to train on")

    @torch.no_grad()
    def load(self, positions: list[int], generator: torch.Generator) -> dict:
        """The CPU half of the batch at `positions` of the sample stream: `drop` (b,) and either `latents`/`states`
        from the store or `pixels`/`texts` to encode; `BatchSource.finish` continues with `generator`."""
        args = self.args
        choice = torch.rand(len(positions), generator=generator)  # caption pick
        drop = torch.rand(len(positions), generator=generator) < args.caption_dropout
        flip = torch.rand(len(positions), generator=generator) < 0.5
        if self.store is not None:
            moments, states = self.store.read([self.sample_index(p) for p in positions], choice)
            mean, logvar = moments.chunk(2, dim=1)  # (b, C, h, w) each
            noise = torch.randn(mean.shape, generator=generator)
            latents = mean + torch.exp(0.5 * logvar.clamp(-30.0, 20.0)) * noise  # (b, C, h, w)
            return {"drop": drop, "latents": latents, "states": states}
        if args.streaming:
            records = self._next_records(len(positions))
        else:
            records = [self.dataset[self.sample_index(p)] for p in positions]
        captions = [captions_of(r[args.caption_column]) for r in records]
        pixels = torch.stack(
            [
                preprocess_image(r[args.image_column], args.resolution, bool(f and args.random_flip))
                for r, f in zip(records, flip)
            ]
        )  # (b, 3, H, W)
        texts = [caps[int(c * len(caps))] for caps, c in zip(captions, choice)]
        return {"drop": drop, "pixels": pixels, "texts": texts}


class StepBatches(torch.utils.data.IterableDataset):
    """This process's `BatchReader.load` of steps `first` … `last - 1`, each with its step generator's state after it.

    Worker w of W makes steps first + w, first + w + W, …; a `DataLoader` returns its workers' items in turn, in order.
    """

    def __init__(self, reader: BatchReader, first: int, last: int):
        self.reader, self.first, self.last = reader, first, last

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        args, rank = self.reader.args, self.reader.process_index
        per_step = args.train_batch_size * args.gradient_accumulation_steps  # per process
        for step in range(self.first + worker, self.last, workers):
            first = (step * self.reader.num_processes + rank) * per_step
            generator = step_generator(args.seed, "step", step, rank)
            yield self.reader.load(list(range(first, first + per_step)), generator), generator.get_state()


class BatchSource:
    """The clean latents and conditioning of the samples at given positions of the sample stream.

    A `BatchReader` makes the CPU half in worker processes, ahead of the step; this process runs the encoders when
    there is no feature store, applies caption dropout and scales the latents. Every draw comes from the step's
    generator, so the batches are the same with any number of workers and a resumed run continues exactly.
    """

    def __init__(self, args, dataset, store, tokenizer, text_encoder, vae, step, process_index=0, num_processes=1):
        self.args, self.tokenizer, self.text_encoder, self.vae = args, tokenizer, text_encoder, vae
        self.reader = BatchReader(args, dataset, store, process_index, num_processes, step)
        self.empty_states = encode_text(tokenizer, text_encoder, [""])  # (1, T, D)

    def batch(self, positions: list[int], generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents (b, C, h, w) scaled by the latent scale, and text states (b, T, D), caption dropout applied."""
        return self.finish(self.reader.load(positions, generator), generator)

    @torch.no_grad()
    def finish(self, loaded: dict, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """`batch` from what `BatchReader.load` made, with the generator where `load` left it."""
        if "pixels" in loaded:
            states = encode_text(self.tokenizer, self.text_encoder, loaded["texts"])  # (b, T, D)
            dist = self.vae.encode(loaded["pixels"].to(self.vae.device, self.vae.dtype)).latent_dist
            latents = dist.mean + dist.std * torch.randn(dist.mean.shape, generator=generator).to(dist.mean)
        else:
            latents, states = loaded["latents"], loaded["states"]
        states = states.float()
        empty = self.empty_states.float().to(states.device)
        states = torch.where(loaded["drop"].to(states.device)[:, None, None], empty, states)  # (b, T, D)
        config = self.vae.config
        latents = latents.float()
        if config.shift_factor is not None:
            latents = latents - config.shift_factor
        return latents * config.scaling_factor, states

    def steps(self, first: int, last: int) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Generator]]:
        """The latents, text states and generator (where the batch left it) of steps `first` … `last - 1`, read by
        `--dataloader_num_workers` worker processes."""
        workers = self.args.dataloader_num_workers
        if self.args.streaming and workers > 1:
            from accelerate.logging import get_logger

            get_logger(__name__).info(
                f"--dataloader_num_workers {workers}: a stream is read in order, by one worker process"
            )
            workers = 1
        loader = torch.utils.data.DataLoader(
            StepBatches(self.reader, first, last),
            batch_size=None,  # items are batches already
            num_workers=workers,
            pin_memory=self.vae.device.type == "cuda",
            generator=torch.Generator().manual_seed(0),  # DataLoader would otherwise draw from the global RNG
        )
        for loaded, state in loader:
            generator = torch.Generator()
            generator.set_state(state)
            yield *self.finish(loaded, generator), generator
