"""The training data (COCO-2014, an imagefolder, a `datasets` dataset or an embedded world), checked at start-up,
and the batches of a run, read ahead by `DataLoader` workers from the feature store or the images. Every random
choice is a function of (seed, step, sample position) (`step_generator`): a resumed run continues exactly.
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

DATA_LAYOUTS = ("auto", "imagefolder", "coco2014")  # "auto": COCO-2014 when the folder has its layout
COCO_SPLITS = ("train2014", "val2014")


def load_training_data(
    *, dataset_name: str | None, dataset_config_name: str | None, train_data_dir: str | None, data_layout: str = "auto",
    image_column: str, caption_column: str, max_train_samples: int | None, streaming: bool, seed: int, cache_dir: str,
    world: str | None = "shapes", shapes_split: str = "train", shapes_num_images: int | None = None,
):  # fmt: skip
    """The training split (an `IterableDataset` with `streaming`) of `--dataset_name` (a Hub id, a local or a
    `save_to_disk` folder), else `--train_data_dir` (laid out as `data_layout` says), else the embedded `world`. Bad
    data are refused (`ValueError`, naming the problem) before anything is encoded, the same way for every source."""
    import datasets

    if data_layout not in DATA_LAYOUTS:
        raise ValueError(f"unknown data layout {data_layout!r}; choose one of {DATA_LAYOUTS}")
    hint, folder = "", Path(dataset_name or train_data_dir or ".")
    saved = (folder / "dataset_dict.json").is_file() or all(
        (folder / f).is_file() for f in ("state.json", "dataset_info.json")
    )
    if dataset_name and saved:
        if dataset_config_name is not None:  # a folder written by save_to_disk, which load_dataset refuses
            raise ValueError(
                f"--dataset_name {folder} was written by save_to_disk, which saves no configurations: drop "
                f"--dataset_config_name {dataset_config_name}"
            )
        dataset = train_split(datasets.load_from_disk(str(folder)), f"--dataset_name {folder}")
        dataset = dataset.to_iterable_dataset() if streaming else dataset
    elif dataset_name:
        if folder.is_dir():  # a local imagefolder, when it has metadata
            metadata = sorted(p for name in metadata_file_names() for p in folder.rglob(name))
            check_imagefolder_metadata(metadata, caption_column)
            if metadata:
                hint = " (a local imagefolder: --train_data_dir reads its captions whatever its file names are)"
        dataset = datasets.load_dataset(dataset_name, dataset_config_name, cache_dir=cache_dir, streaming=streaming)
        dataset = train_split(dataset, f"--dataset_name {dataset_name}")
    elif train_data_dir:
        if not folder.is_dir():
            raise ValueError(f"--train_data_dir {folder} is not a folder")
        if data_layout == "auto":  # a partly unpacked COCO folder too, when it has no imagefolder metadata
            annotations = (folder / "annotations" / "captions_train2014.json").is_file()
            images = (folder / "train2014").is_dir()
            metadata = any((folder / name).is_file() for name in metadata_file_names())
            coco = (annotations and images) or ((annotations or images) and not metadata)
            data_layout = "coco2014" if coco else "imagefolder"
            logger.info(f"{folder} is laid out as {'COCO-2014' if coco else 'an imagefolder'}")
        if data_layout == "coco2014":
            dataset = load_coco2014(folder, "train2014", image_column, caption_column)
        else:
            dataset = load_imagefolder(folder, caption_column, cache_dir)
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
    if max_train_samples is not None and streaming:
        dataset = dataset.take(max_train_samples)
    elif max_train_samples is not None:
        dataset = dataset.select(range(min(max_train_samples, len(dataset))))
    check_rows(dataset, image_column, caption_column)
    return dataset


def check_rows(dataset, image_column: str, caption_column: str) -> None:
    """Refuse at start-up what a run would die on mid-way: a caption column of no text, a missing or empty caption, an
    image that cannot be opened (opened, not decoded). A stream is checked by its columns' types alone."""
    import datasets

    features = dataset.features or {}
    image_feature, caption_feature = features.get(image_column), features.get(caption_column)
    if image_feature is not None and not isinstance(image_feature, datasets.Image):
        raise ValueError(f"--image_column {image_column!r} holds {image_feature}, not images: name the image column")
    inner = caption_feature[0] if isinstance(caption_feature, list) else getattr(caption_feature, "feature", None)
    text = inner if inner is not None else caption_feature
    if caption_feature is not None and getattr(text, "dtype", None) not in ("string", "large_string"):
        raise ValueError(
            f"--caption_column {caption_column!r} holds {caption_feature}, not text: name the caption column"
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


def train_split(dataset, source: str):
    """The `train` split of a `DatasetDict`; a single dataset as it is (`source` is for the error)."""
    import datasets

    if not isinstance(dataset, datasets.DatasetDict | datasets.IterableDatasetDict):
        return dataset
    if "train" not in dataset:
        raise ValueError(
            f"{source} has the splits {sorted(dataset)} and no 'train' split, which is what the trainer reads: "
            "save or name the training data as 'train'"
        )
    return dataset["train"]


def load_coco2014(root: Path, split: str = "train2014", image_column: str = "image", caption_column: str = "text"):
    """One split of COCO-2014 as the official archives unpack it (`root/annotations/captions_<split>.json`,
    `root/<split>/`): columns `image_column`, `caption_column` (all of the image's captions) and `image_id`, in
    image-id order, captions in file order, as pycocotools reads them; `ValueError` naming a missing or bad file."""
    import datasets

    if split not in COCO_SPLITS:
        raise ValueError(f"unknown COCO-2014 split {split!r}; choose one of {COCO_SPLITS}")
    annotations_file, image_dir = root / "annotations" / f"captions_{split}.json", root / split
    for needed in (annotations_file, image_dir):
        if not needed.exists():
            raise ValueError(
                f"{root} is not a COCO-2014 folder: {needed} is missing; unpack annotations_trainval2014.zip and "
                f"{split}.zip into it"
            )
    with open(annotations_file, encoding="utf-8") as f:
        coco = json.load(f)
    if not isinstance(coco, dict) or not {"images", "annotations"} <= coco.keys():
        raise ValueError(f"{annotations_file} is not a COCO captions file: it needs 'images' and 'annotations' lists")
    captions = coco_captions(coco, annotations_file)
    images = sorted(coco["images"], key=lambda image: image["id"])
    paths = [image_dir / image["file_name"] for image in images]
    if missing := [str(path) for path in paths if not path.is_file()]:
        raise ValueError(f"{annotations_file} lists {len(missing)} image(s) that {image_dir} lacks, e.g. {missing[0]}")
    if uncaptioned := [image["id"] for image in images if image["id"] not in captions]:
        raise ValueError(
            f"{annotations_file}: image id {uncaptioned[0]} (and {len(uncaptioned) - 1} more) has no caption"
        )
    rows = {
        image_column: [str(path) for path in paths], caption_column: [captions[image["id"]] for image in images],
        "image_id": [image["id"] for image in images]
    }  # fmt: skip
    return datasets.Dataset.from_dict(rows).cast_column(image_column, datasets.Image())


def preprocess_image(image: Image.Image, resolution: int, flip: bool) -> torch.Tensor:
    """(3, resolution, resolution) in [-1, 1]: centre-cropped, resized (Lanczos, as the reference), maybe mirrored."""
    image = center_crop_resize(image, resolution)
    if flip:
        image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    pixels = torch.from_numpy(np.asarray(image, dtype=np.float32) / 127.5 - 1.0)  # (H, W, 3)
    return pixels.permute(2, 0, 1).contiguous()  # (3, H, W)


# What pandas (which reads a metadata.csv for `datasets`) takes for a missing value: such a caption becomes None.
CSV_MISSING_VALUES = frozenset(
    ["#N/A", "#N/A N/A", "#NA", "-1.#IND", "-1.#QNAN", "-NaN", "-nan", "1.#IND", "1.#QNAN", "<NA>", "N/A", "NA", "NULL",
     "NaN", "None", "n/a", "nan", "null"]
)  # fmt: skip


def load_imagefolder(folder: Path, caption_column: str = "text", cache_dir: str | None = None):
    """The training split of an imagefolder, its metadata checked first. Only folders split it (`datasets` alone
    would split by file name too, `COCO_train2014_….jpg` into a "train" split without captions)."""
    import datasets

    patterns, metadata = imagefolder_split(folder, caption_column)
    check_imagefolder_metadata(metadata, caption_column)
    return datasets.load_dataset(
        "imagefolder", data_dir=str(folder), data_files={"train": patterns}, cache_dir=cache_dir
    )["train"]


def imagefolder_split(folder: Path, caption_column: str) -> tuple[list[str], list[Path]]:
    """The `data_files` patterns of an imagefolder's training split and its metadata files: the training split
    folders (`train/`, `train2014/`, … as `datasets` names them) when they hold metadata, else the whole folder."""
    from datasets.data_files import NON_WORDS_CHARS, SPLIT_KEYWORDS

    pattern = f"(^|[{NON_WORDS_CHARS}])({{}})([{NON_WORDS_CHARS}]|$)"
    names, split_folders, metadata, unread = metadata_file_names(), {}, {}, set()
    for root, subfolders, files in os.walk(folder):
        subfolders[:] = sorted(name for name in subfolders if not name.startswith((".", "__")))  # as datasets skips
        here = Path(root).relative_to(folder)
        splits = {split for split, where in split_folders.items() for path in where if here.is_relative_to(path)}
        for name in subfolders:  # the split a folder of this name holds for `datasets`, if any
            words = (
                split for split, keys in SPLIT_KEYWORDS.items() if re.search(pattern.format("|".join(keys)), name)
            )
            if split := next(words, None):
                split_folders.setdefault(str(split), []).append(here / name)
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
        raise ValueError(
            f"{folder} is split into folders, and its training split has no metadata file (e.g. {in_splits[0]} is "
            f"another split's): put the training images and their metadata in {folder / 'train'}"
        )
    if not metadata:
        found = f" ({', '.join(sorted(unread))} is not one datasets reads)" if unread else ""
        example = json.dumps({"file_name": "0001.jpg", caption_column: "a red bus"})
        raise ValueError(
            f"{folder} has no metadata file ({', '.join(names)}){found}, so its images have no captions: add a "
            f"metadata.jsonl, one line per image ({example}), or pass a COCO-2014 folder"
        )
    return ["**"], list(metadata)


def metadata_file_names() -> list[str]:
    from datasets.packaged_modules.imagefolder.imagefolder import ImageFolder

    return list(ImageFolder.METADATA_FILENAMES)


def check_imagefolder_metadata(metadata: list[Path], caption_column: str) -> None:
    """Refuse imagefolder metadata of mixed formats, or a file with no rows, without the caption column, with a row
    that lacks a usable caption or its image (only checked to exist), or with captions of both kinds: `datasets` would
    fill a missing caption with None (a crash much later), train an empty one as "", or fail deep in Arrow."""
    formats = sorted({path.suffix for path in metadata})
    if len(formats) > 1:
        first, other = (next(path for path in metadata if path.suffix == suffix) for suffix in formats[:2])
        raise ValueError(f"the metadata files mix formats ({', '.join(formats)}), e.g. {first} and {other}: use one")
    first_caption = {}  # "where", "kind": of the first caption of all files
    for path in metadata:
        first_values, first_problem, problems, listings = {}, None, 0, {}
        for where, row in metadata_rows(path):
            for column in row.keys() - first_values.keys():
                first_values[column] = row[column]
            problem = row_problem(row, caption_column, path, listings)
            if problem is None:
                kind = "a list of captions" if isinstance(row[caption_column], list | tuple) else "a string"
                first_caption.setdefault("where", f"{path} {where}")
                if kind != first_caption.setdefault("kind", kind):
                    problem = (
                        f"its caption is {kind}, where {first_caption['where']}'s is {first_caption['kind']}: write "
                        "every caption as a list or every one as a string"
                    )
            if problem:
                problems += 1
                first_problem = first_problem or f"{where} (file_name {row.get('file_name')!r}): {problem}"
        if not first_values:
            raise ValueError(f"{path} has no rows: list each image with its caption, or remove the file")
        if caption_column not in first_values:
            problem = f"--caption_column {caption_column!r} is not a column of the dataset: {path} has no such field"
            if candidates := [c for c, value in first_values.items() if not is_file_name(c) and is_caption(value)]:
                flag = candidates[0] if len(candidates) == 1 else "with the one that holds the captions"
                raise ValueError(
                    f"{problem}; its rows have {', '.join(map(repr, candidates))}: pass --caption_column {flag}"
                )
            raise ValueError(f"{problem}, and none of its columns {sorted(first_values)} holds text")
        if first_problem:
            more = f" ({problems - 1} more rows are wrong too)" if problems > 1 else ""
            raise ValueError(
                f"{path} {first_problem}{more}. Every row needs a caption and its image: fix or remove it."
            )


def is_file_name(column: str) -> bool:
    return column == "file_name" or column.endswith("_file_name")


def is_caption(value) -> bool:
    try:
        captions_of(value)
    except ValueError:
        return False
    return True


def row_problem(row: dict, caption_column: str, metadata: Path, listings: dict[str, set[str]]) -> str | None:
    """What is wrong with a metadata row (its caption, its `file_name` relative to the metadata file, its image), or
    None; `listings` caches the folders' files (one listing each, not a `stat` per image)."""
    if caption_column not in row:
        return f"it has no {caption_column!r} field"
    value = row[caption_column]
    if metadata.suffix == ".csv" and value in CSV_MISSING_VALUES:
        return f"its caption {value!r} reads as a missing value (datasets reads metadata.csv with pandas)"
    try:
        captions_of(value)
    except ValueError as error:
        return str(error)
    folder, names = str(metadata.parent), [row[key] for key in row if is_file_name(key)]
    if not names or not all(isinstance(name, str) and name for name in names):
        return "it has no file_name (the image's path relative to the metadata file)"
    for name in names:
        if name.startswith(os.sep) or ".." in name:  # only then can it point outside the folder
            relative = os.path.normpath(name)
            if os.path.isabs(relative) or relative == ".." or relative.startswith(".." + os.sep):
                return f"its file_name must be a path inside {folder}"
        path = os.path.join(folder, name)
        parent, base = os.path.split(path)
        if parent not in listings:
            listings[parent] = set(os.listdir(parent)) if os.path.isdir(parent) else set()
        if base not in listings[parent] and not os.path.isfile(path):  # isfile: a case-insensitive system's match
            return f"its image {path} is missing"
    return None


def metadata_rows(metadata: Path) -> Iterator[tuple[str, dict]]:
    """`(where, row)` for each row of a metadata file: `"line <n>"` in a `.jsonl` or `.csv`, `"row <i>"` in a
    `.parquet`."""
    if metadata.suffix == ".parquet":
        import pyarrow.parquet

        try:
            rows = [row for batch in pyarrow.parquet.ParquetFile(metadata).iter_batches() for row in batch.to_pylist()]
        except pyarrow.ArrowException as error:
            raise ValueError(f"{metadata} is not a readable parquet file: {error}") from None
        yield from ((f"row {index}", row) for index, row in enumerate(rows))
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
    """The feature store `<cache_dir>/features/<key>` of this data and these components, extracted first if need be."""
    extraction = dict(
        image_column=args.image_column, caption_column=args.caption_column, resolution=args.resolution,
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, text_dtype=args.cache_text_dtype or "float32",
    )  # fmt: skip
    try:
        return open_feature_store(
            cache_dir / "features" / feature_store_key(dataset, **extraction), dataset,
            process_index=accelerator.process_index, num_processes=accelerator.num_processes,
            wait_for_everyone=accelerator.wait_for_everyone, num_workers=args.dataloader_num_workers, **extraction,
        )  # fmt: skip
    except (OSError, ValueError) as error:  # a caption that is not one, a store other processes cannot see
        raise SystemExit(f"error: {error}") from None


class BatchReader:
    """The CPU half of a batch, run in `DataLoader` workers: the random draws, then the samples from the feature
    store (latents re-sampled from the stored moments, as the reference does) or decoded images. A dataset is read in
    seeded per-epoch permutations (resuming needs no data state); a stream in order, skipping what steps before
    `step` used."""

    def __init__(self, args, dataset, store: FeatureStore | None, process_index: int, num_processes: int, step: int):
        self.args, self.dataset, self.store = args, dataset, store
        self.process_index, self.num_processes, self.step = process_index, num_processes, step
        self._permutation = (-1, None)
        self._stream = None

    def sample_index(self, position: int) -> int:
        epoch, offset = divmod(position, len(self.dataset))
        if self._permutation[0] != epoch:
            generator = step_generator(self.args.seed, "epoch", epoch)
            permutation = torch.randperm(len(self.dataset), generator=generator).numpy()  # cheap to index
            self._permutation = (epoch, permutation)
        return int(self._permutation[1][offset])

    def _next_records(self, count: int) -> list[dict]:
        if self._stream is None:
            self._stream = self._epochs()
            per_step = self.args.train_batch_size * self.args.gradient_accumulation_steps
            self._next_records(self.step * per_step)  # what the steps before a resume consumed
        return [next(self._stream) for _ in range(count)]

    def _epochs(self) -> Iterator[dict]:
        """This process's shard of the stream, shuffled, epoch after epoch, one record at a time (`iter`, so that
        `datasets` does not split it between workers)."""
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
        """`drop` (b,) and either `latents`/`states` from the store or `pixels`/`texts` to encode, of the samples at
        `positions`; `BatchSource.finish` continues with `generator`."""
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
        flips = (bool(f and args.random_flip) for f in flip)
        pixels = torch.stack(
            [preprocess_image(r[args.image_column], args.resolution, f) for r, f in zip(records, flips)]
        )
        texts = [caps[int(c * len(caps))] for caps, c in zip(captions, choice)]
        return {"drop": drop, "pixels": pixels, "texts": texts}


class StepBatches(torch.utils.data.IterableDataset):
    """This process's `BatchReader.load` of steps `first` … `last - 1`, each with its generator's state after it:
    worker w of W makes steps first + w, first + w + W, … (a `DataLoader` returns its workers' items in turn)."""

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
    """The clean latents and conditioning of the samples at given positions of the sample stream: a `BatchReader`
    makes the CPU half in worker processes; this process runs the encoders when there is no feature store, applies
    caption dropout and scales the latents. Every draw comes from the step's generator."""

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
        states, empty = states.float(), self.empty_states.float().to(states.device)
        states = torch.where(loaded["drop"].to(states.device)[:, None, None], empty, states)  # (b, T, D)
        return (latents.float() - (self.vae.config.shift_factor or 0.0)) * self.vae.config.scaling_factor, states

    def steps(self, first: int, last: int) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Generator]]:
        """The latents, text states and generator of steps `first` … `last - 1`, read by `--dataloader_num_workers`."""
        workers = self.args.dataloader_num_workers
        if self.args.streaming and workers > 1:
            logger.info(f"--dataloader_num_workers {workers}: a stream is read in order, by one worker process")
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
