"""The training data, checked at start-up, and a run's batches, read ahead by `DataLoader` workers; every random
choice is a function of (seed, step, sample position): a resumed run continues exactly."""

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
    """The training split of `--dataset_name`, else `--train_data_dir`, else the `world`; bad data are refused."""
    import datasets

    if data_layout not in DATA_LAYOUTS:
        raise ValueError(f"unknown data layout {data_layout!r}; choose one of {DATA_LAYOUTS}")
    hint, folder = "", Path(dataset_name or train_data_dir or ".")
    written = ("dataset_dict.json",), ("state.json", "dataset_info.json")  # what save_to_disk writes
    saved = any(all((folder / name).is_file() for name in names) for names in written)
    if dataset_name and saved:
        if dataset_config_name is not None:  # a folder written by save_to_disk, which load_dataset refuses
            drop = f"drop --dataset_config_name {dataset_config_name}"
            raise ValueError(f"--dataset_name {folder} was written by save_to_disk, without configurations: {drop}")
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
    """Refuse what a run would die on mid-way: no text, an empty caption, an unreadable image (a stream: by types)."""
    import datasets

    features = dataset.features or {}
    image_feature, caption_feature = features.get(image_column), features.get(caption_column)
    if image_feature is not None and not isinstance(image_feature, datasets.Image):
        raise ValueError(f"--image_column {image_column!r} holds {image_feature}, not images: name the image column")
    inner = caption_feature[0] if isinstance(caption_feature, list) else getattr(caption_feature, "feature", None)
    text = inner if inner is not None else caption_feature
    if caption_feature is not None and getattr(text, "dtype", None) not in ("string", "large_string"):
        option = f"--caption_column {caption_column!r}"
        raise ValueError(f"{option} holds {caption_feature}, not text: name the caption column")
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
                Image.open(io.BytesIO(value["bytes"]) if value["bytes"] else value["path"]).close()
            except (OSError, ValueError) as error:  # UnidentifiedImageError is an OSError
                image = f"image {value['path']}" if value.get("path") else "image"
                message = f"row {row} of the training data: its {image} cannot be read ({error}); replace or remove it"
                raise ValueError(message) from None


def train_split(dataset, source: str):
    """The `train` split of a `DatasetDict`; a single dataset as it is."""
    import datasets

    if not isinstance(dataset, datasets.DatasetDict | datasets.IterableDatasetDict):
        return dataset
    if "train" not in dataset:
        why = "which is what the trainer reads: save or name the training data as 'train'"
        raise ValueError(f"{source} has the splits {sorted(dataset)} and no 'train' split, {why}")
    return dataset["train"]


def load_coco2014(root: Path, split: str = "train2014", image_column: str = "image", caption_column: str = "text"):
    """One split of COCO-2014 as its archives unpack (`annotations/captions_<split>.json`, `<split>/`): `image_column`,
    `caption_column` (all of an image's captions) and `image_id`, in image-id order, as pycocotools reads them."""
    import datasets

    if split not in COCO_SPLITS:
        raise ValueError(f"unknown COCO-2014 split {split!r}; choose one of {COCO_SPLITS}")
    annotations_file, image_dir = root / "annotations" / f"captions_{split}.json", root / split
    for needed in (annotations_file, image_dir):
        if not needed.exists():
            fix = f"unpack annotations_trainval2014.zip and {split}.zip into it"
            raise ValueError(f"{root} is not a COCO-2014 folder: {needed} is missing; {fix}")
    coco = json.loads(annotations_file.read_text(encoding="utf-8"))
    if not isinstance(coco, dict) or not {"images", "annotations"} <= coco.keys():
        raise ValueError(f"{annotations_file} is not a COCO captions file: it needs 'images' and 'annotations' lists")
    captions = coco_captions(coco, annotations_file)
    images = sorted(coco["images"], key=lambda image: image["id"])
    paths = [image_dir / image["file_name"] for image in images]
    if missing := [str(path) for path in paths if not path.is_file()]:
        raise ValueError(f"{annotations_file} lists {len(missing)} image(s) that {image_dir} lacks, e.g. {missing[0]}")
    if uncaptioned := [image["id"] for image in images if image["id"] not in captions]:
        more = len(uncaptioned) - 1
        raise ValueError(f"{annotations_file}: image id {uncaptioned[0]} (and {more} more) has no caption")
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
    """An imagefolder's training split, its metadata checked first; only folders split it, not file names."""
    import datasets

    patterns, metadata = imagefolder_split(folder, caption_column)
    check_imagefolder_metadata(metadata, caption_column)
    files = {"train": patterns}
    return datasets.load_dataset("imagefolder", data_dir=str(folder), data_files=files, cache_dir=cache_dir)["train"]


def imagefolder_split(folder: Path, caption_column: str) -> tuple[list[str], list[Path]]:
    """The `data_files` patterns and metadata of an imagefolder's training split: its split folders', or all."""
    from datasets.data_files import NON_WORDS_CHARS, SPLIT_KEYWORDS

    pattern = f"(^|[{NON_WORDS_CHARS}])({{}})([{NON_WORDS_CHARS}]|$)"
    names, split_folders, metadata, unread = metadata_file_names(), {}, {}, set()
    for root, subfolders, files in os.walk(folder):
        subfolders[:] = sorted(name for name in subfolders if not name.startswith((".", "__")))  # as datasets skips
        here = Path(root).relative_to(folder)
        splits = {split for split, where in split_folders.items() for path in where if here.is_relative_to(path)}
        for name in subfolders:  # the split a folder of this name holds for `datasets`, if any
            found = (s for s, words in SPLIT_KEYWORDS.items() if re.search(pattern.format("|".join(words)), name))
            if split := next(found, None):
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
    """Refuse imagefolder metadata that `datasets` would misread: mixed formats, no rows or captions, bad rows."""
    formats = sorted({path.suffix for path in metadata})
    if len(formats) > 1:
        first, other = (next(path for path in metadata if path.suffix == suffix) for suffix in formats[:2])
        raise ValueError(f"the metadata files mix formats ({', '.join(formats)}), e.g. {first} and {other}: use one")
    first_caption = {}  # "where", "kind": of the first caption of all files
    for path in metadata:
        first_values, first_problem, problems, listings = {}, None, 0, {}
        for where, row in metadata_rows(path):
            first_values = {**row, **first_values}  # each column's first value
            problem = row_problem(row, caption_column, path, listings)
            if problem is None:
                kind = "a list of captions" if isinstance(row[caption_column], list | tuple) else "a string"
                first_caption.setdefault("where", f"{path} {where}")
                if kind != first_caption.setdefault("kind", kind):
                    problem = f"its caption is {kind}, where {first_caption['where']}'s is {first_caption['kind']}: "
                    problem += "write every caption as a list or every one as a string"
            if problem:
                problems += 1
                first_problem = first_problem or f"{where} (file_name {row.get('file_name')!r}): {problem}"
        if not first_values:
            raise ValueError(f"{path} has no rows: list each image with its caption, or remove the file")
        if caption_column not in first_values:
            problem = f"--caption_column {caption_column!r} is not a column of the dataset: {path} has no such field"
            if candidates := [c for c, value in first_values.items() if not is_file_name(c) and is_caption(value)]:
                flag = candidates[0] if len(candidates) == 1 else "with the one that holds the captions"
                names = ", ".join(map(repr, candidates))
                raise ValueError(f"{problem}; its rows have {names}: pass --caption_column {flag}")
            raise ValueError(f"{problem}, and none of its columns {sorted(first_values)} holds text")
        if first_problem:
            more = f" ({problems - 1} more rows are wrong too)" if problems > 1 else ""
            fix = "Every row needs a caption and its image: fix or remove it."
            raise ValueError(f"{path} {first_problem}{more}. {fix}")


def is_file_name(column: str) -> bool:
    return column == "file_name" or column.endswith("_file_name")


def is_caption(value) -> bool:
    try:
        captions_of(value)
    except ValueError:
        return False
    return True


def row_problem(row: dict, caption_column: str, metadata: Path, listings: dict[str, set[str]]) -> str | None:
    """What is wrong with a metadata row (caption, `file_name`, image), or None; `listings` caches folder listings."""
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
    """`(where, row)` for each row of a metadata file: `"line <n>"`, or `"row <i>"` in a `.parquet`."""
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


def build_feature_store(
    dataset, tokenizer, text_encoder, vae, accelerator, cache_dir: Path, *, image_column: str, caption_column: str,
    resolution: int, text_dtype: str | None, num_workers: int = 0,
) -> FeatureStore:  # fmt: skip
    """The feature store `<cache_dir>/features/<key>` of this data and these components, extracted first if need be."""
    extraction = dict(
        image_column=image_column, caption_column=caption_column, resolution=resolution, tokenizer=tokenizer,
        text_encoder=text_encoder, vae=vae, text_dtype=text_dtype or "float32",
    )  # fmt: skip
    try:
        return open_feature_store(
            cache_dir / "features" / feature_store_key(dataset, **extraction), dataset,
            process_index=accelerator.process_index, num_processes=accelerator.num_processes,
            wait_for_everyone=accelerator.wait_for_everyone, num_workers=num_workers, **extraction,
        )  # fmt: skip
    except (OSError, ValueError) as error:  # a caption that is not one, a store other processes cannot see
        raise SystemExit(f"error: {error}") from None


class BatchReader(torch.utils.data.IterableDataset):
    """A batch's CPU half, in `DataLoader` workers: the draws, then feature store samples or decoded images; a dataset
    in seeded per-epoch permutations, a stream in order from `step`. `per_step`: samples per process and step.
    Iterated: the `load` of the steps in `span` with each generator's state after it, worker w of W every W-th."""

    def __init__(
        self, dataset, store: FeatureStore | None, *, seed: int, per_step: int, caption_dropout: float = 0.0,
        image_column: str = "image", caption_column: str = "text", resolution: int = 256, random_flip: bool = False,
        streaming: bool = False, process_index: int = 0, num_processes: int = 1, step: int = 0,
    ):  # fmt: skip
        self.dataset, self.store, self.seed, self.per_step, self.step = dataset, store, seed, per_step, step
        self.caption_dropout, self.random_flip, self.streaming = caption_dropout, random_flip, streaming
        self.image_column, self.caption_column, self.resolution = image_column, caption_column, resolution
        self.process_index, self.num_processes = process_index, num_processes
        self._permutation, self._stream, self.span = (-1, None), None, range(0)

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        for step in self.span[info.id :: info.num_workers] if info else self.span:
            first = (step * self.num_processes + self.process_index) * self.per_step
            generator = step_generator(self.seed, "step", step, self.process_index)
            yield self.load(list(range(first, first + self.per_step)), generator), generator.get_state()

    def sample_index(self, position: int) -> int:
        epoch, offset = divmod(position, len(self.dataset))
        if self._permutation[0] != epoch:  # as numpy: cheap to index
            order = torch.randperm(len(self.dataset), generator=step_generator(self.seed, "epoch", epoch)).numpy()
            self._permutation = (epoch, order)
        return int(self._permutation[1][offset])

    def _next_records(self, count: int) -> list[dict]:
        if self._stream is None:
            self._stream = self._epochs()
            self._next_records(self.step * self.per_step)  # what the steps before a resume consumed
        return [next(self._stream) for _ in range(count)]

    def _epochs(self) -> Iterator[dict]:
        """This process's shard of the stream, shuffled, epoch after epoch, one record at a time."""
        from datasets.distributed import split_dataset_by_node

        shard = split_dataset_by_node(self.dataset, self.process_index, self.num_processes)
        shard = shard.shuffle(seed=self.seed, buffer_size=1000)
        for epoch in itertools.count():
            shard.set_epoch(epoch)
            records = 0
            for records, batch in enumerate(shard.iter(batch_size=1), 1):
                yield {column: values[0] for column, values in batch.items()}
            if not records:
                raise ValueError(f"the stream of process {self.process_index} is empty: it has no records to train on")

    @torch.no_grad()
    def load(self, positions: list[int], generator: torch.Generator) -> dict:
        """`drop` and `latents`/`states` or `pixels`/`texts` of the samples at `positions`."""
        choice = torch.rand(len(positions), generator=generator)  # caption pick
        drop = torch.rand(len(positions), generator=generator) < self.caption_dropout
        flip = (torch.rand(len(positions), generator=generator) < 0.5) & self.random_flip
        if self.store is not None:
            moments, states = self.store.read([self.sample_index(p) for p in positions], choice)
            mean, logvar = moments.chunk(2, dim=1)  # (b, C, h, w) each
            noise = torch.randn(mean.shape, generator=generator)
            latents = mean + torch.exp(0.5 * logvar.clamp(-30.0, 20.0)) * noise  # (b, C, h, w)
            return {"drop": drop, "latents": latents, "states": states}
        if self.streaming:
            records = self._next_records(len(positions))
        else:
            records = [self.dataset[self.sample_index(p)] for p in positions]
        captions = [captions_of(r[self.caption_column]) for r in records]
        images = (preprocess_image(r[self.image_column], self.resolution, bool(f)) for r, f in zip(records, flip))
        pixels = torch.stack(list(images))
        texts = [caps[int(c * len(caps))] for caps, c in zip(captions, choice)]
        return {"drop": drop, "pixels": pixels, "texts": texts}


class BatchSource:
    """A step's clean latents and text states: `reader`'s CPU half in `num_workers` workers, then the encoders."""

    def __init__(self, reader: BatchReader, tokenizer, text_encoder, vae, num_workers: int = 0):
        self.reader, self.tokenizer, self.text_encoder, self.vae = reader, tokenizer, text_encoder, vae
        self.num_workers = num_workers
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
        workers = self.num_workers
        if self.reader.streaming and workers > 1:
            logger.info(f"--dataloader_num_workers {workers}: a stream is read in order, by one worker process")
            workers = 1
        self.reader.span = range(first, last)
        loader = torch.utils.data.DataLoader(  # items are batches already; a generator, not the global RNG
            self.reader, batch_size=None, num_workers=workers, pin_memory=self.vae.device.type == "cuda",
            generator=torch.Generator().manual_seed(0),
        )  # fmt: skip
        for loaded, state in loader:
            generator = torch.Generator().set_state(state)
            yield *self.finish(loaded, generator), generator
