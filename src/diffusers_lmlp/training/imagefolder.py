"""An imagefolder: images with `metadata.jsonl`, `metadata.csv` or `metadata.parquet` files that give each its
caption, split into folders as `datasets` splits them, never by file name. Its metadata are checked before anything
is encoded: every row needs a usable caption and an image inside the folder, and the errors name the file, the row
and the fix.
"""

import csv
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

from ..evaluation.captions import captions_of


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
