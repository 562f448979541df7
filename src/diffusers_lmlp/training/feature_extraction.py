"""Extracting a feature store (its format is `training.features`): the VAE moments of every training image and the
CLIP text states of every caption, encoded once and written shard by shard; `open_feature_store` opens one for a run.

Extraction is parallel and resumable: process p of P writes shards p, p + P, …, each to `<shard>.tmp`, then its
checksums, then fsynced and renamed, so a shard under its final name is complete. No NaN or inf is ever stored. The
store folder must be on a file system that every process sees.
"""

import hashlib
import json
import logging
import math
import os
import struct
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from ..durable import fsync_tree
from ..evaluation.captions import captions_of
from ..progress import progress_bar
from .data import preprocess_image
from .features import (
    FORMAT,
    MANIFEST,
    NUMPY_DTYPES,
    SAFETENSORS_DTYPES,
    SHARD_SIZE,
    TEXT_DTYPES,
    FeatureStore,
    available_cpus,
    checksums_path,
    read_header,
    shard_files,
    shard_name,
)


logger = logging.getLogger(__name__)


def write_json(path: Path, value) -> None:
    """Write `value` as JSON to `path` durably: to a temporary name, fsynced, renamed, the folder fsynced."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_tree(path.parent, recursive=False)


@torch.no_grad()
def encode_text(tokenizer, text_encoder, texts: list[str]) -> torch.Tensor:
    """CLIP's last hidden state of each text, padded and truncated to the tokenizer's length, as U-ViT encodes.

    Args:
        tokenizer (`CLIPTokenizer`): The tokenizer.
        text_encoder (`CLIPTextModel`): The text encoder (no attention mask is passed, as in the reference).
        texts (`list[str]`): The texts.

    Returns:
        `torch.Tensor`: (B, T, D), on the text encoder's device, in its dtype.
    """
    ids = tokenizer(
        texts, padding="max_length", max_length=tokenizer.model_max_length, truncation=True, return_tensors="pt"
    ).input_ids  # (B, T)
    return text_encoder(ids.to(text_encoder.device))[0]  # (B, T, D)


class ShardWriter:
    """Writes one safetensors file in place at its header's offsets, batch by batch, hashing each part as written,
    so the extraction holds one batch in memory, not one shard. `tensors`: name → (dtype, shape), in file order.
    `commit` writes the checksums file, fsyncs the shard and renames it from `<path>.tmp` to `path`."""

    def __init__(self, path: Path, tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]]):
        self.path, self.tmp = path, path.with_name(path.name + ".tmp")
        header, self.offsets, end = {}, {}, 0
        for name, (dtype, shape) in tensors.items():
            size = math.prod(shape) * dtype.itemsize
            header[name] = {
                "dtype": SAFETENSORS_DTYPES[dtype],
                "shape": list(shape),
                "data_offsets": [end, end + size],
            }
            self.offsets[name] = (end, size // max(shape[0], 1), NUMPY_DTYPES[SAFETENSORS_DTYPES[dtype]])
            end += size
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data start 8-byte aligned, as safetensors writes them
        self.data_start, self.size = 8 + len(encoded), 8 + len(encoded) + end
        self.rows = {name: shape[0] for name, (_, shape) in tensors.items()}
        self.written = dict.fromkeys(tensors, 0)  # rows written so far, from row 0
        self.hashes = {"header": hashlib.sha256(struct.pack("<Q", len(encoded)) + encoded)}
        self.hashes.update({name: hashlib.sha256() for name in tensors})
        self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.pwrite(self.fd, struct.pack("<Q", len(encoded)) + encoded, 0)
        os.ftruncate(self.fd, self.size)

    def write(self, name: str, row: int, values: torch.Tensor) -> None:
        """Write `values` (k, *shape[1:]) as rows `row`, `row + 1`, … of tensor `name`; rows come in order, from 0, so
        that they can be hashed as they are written."""
        begin, row_bytes, dtype = self.offsets[name]
        data = np.ascontiguousarray(values.detach().cpu().numpy(), dtype=dtype)
        if data.nbytes != len(values) * row_bytes:
            raise ValueError(
                f"{name}: rows of {data.nbytes // max(len(values), 1)} bytes, the header says {row_bytes}"
            )
        if row != self.written[name]:
            raise ValueError(f"{name}: rows are written in order, from 0: row {self.written[name]} is next, not {row}")
        os.pwrite(self.fd, data, self.data_start + begin + row * row_bytes)
        self.hashes[name].update(data)
        self.written[name] += len(data)

    def commit(self) -> None:
        """Make the file durable under its final name once every row is written, after its checksums file (`bytes`, and
        the `sha256` of each part in file order): fsync, rename, fsync the folder."""
        for name, rows in self.rows.items():
            if self.written[name] != rows:
                raise ValueError(f"{self.tmp}: {name} has {self.written[name]} of its {rows} rows written")
        record = {"bytes": self.size, "sha256": {name: digest.hexdigest() for name, digest in self.hashes.items()}}
        write_json(checksums_path(self.path), record)
        os.fsync(self.fd)
        os.close(self.fd)
        os.replace(self.tmp, self.path)
        fsync_tree(self.path.parent, recursive=False)


class ShardBatches(torch.utils.data.Dataset):
    """The image batches to encode: item k is `(shard, first row in the shard, pixels, captions)` of `spans[k]`,
    `(shard, start, stop)`. Map-style, so `DataLoader` workers decode and crop the images while the encoders run."""

    def __init__(self, dataset, spans, shard_size: int, image_column: str, caption_column: str, resolution: int):
        self.dataset, self.spans, self.shard_size = dataset, spans, shard_size
        self.image_column, self.caption_column, self.resolution = image_column, caption_column, resolution

    def __len__(self) -> int:
        return len(self.spans)

    def __getitem__(self, k: int) -> tuple[int, int, torch.Tensor, list[list[str]]]:
        shard, start, stop = self.spans[k]
        rows = self.dataset[start:stop]
        pixels = torch.stack([preprocess_image(image, self.resolution, False) for image in rows[self.image_column]])
        return shard, start - shard * self.shard_size, pixels, [captions_of(v) for v in rows[self.caption_column]]


@torch.no_grad()
def extract_features(
    path: Path,
    dataset,
    *,
    image_column: str,
    caption_column: str,
    resolution: int,
    tokenizer,
    text_encoder,
    vae,
    text_dtype: str = "float32",
    shard_size: int = SHARD_SIZE,
    batch_size: int = 32,
    num_workers: int = 0,
    process_index: int = 0,
    num_processes: int = 1,
    wait_for_everyone: Callable[[], None] = lambda: None,
) -> None:
    """Write the store at `path`: this process's missing shards, then (on process 0) the manifest.

    Every process of the run calls this together: process p writes those of shards p, p + P, … that are not complete (a
    killed extraction resumes), and all wait before and after process 0 writes the manifest.

    Args:
        path (`Path`): The store folder (created if missing).
        dataset (`datasets.Dataset`): Map-style training data.
        image_column (`str`): The image column (PIL images).
        caption_column (`str`): The caption column (a caption or a list of them per row).
        resolution (`int`): The side the images are centre-cropped and resized to.
        tokenizer (`CLIPTokenizer`): The tokenizer.
        text_encoder (`CLIPTextModel`): The text encoder.
        vae (`AutoencoderKL`): The VAE; its encoder's moments are stored.
        text_dtype (`str`, *optional*, defaults to `"float32"`): `"float32"` or `"float16"` for the text states.
        shard_size (`int`, *optional*, defaults to `SHARD_SIZE`): Images per shard.
        batch_size (`int`, *optional*, defaults to 32): Images encoded at once.
        num_workers (`int`, *optional*, defaults to 0): `DataLoader` worker processes that decode the images.
        process_index (`int`, *optional*, defaults to 0): This process's rank.
        num_processes (`int`, *optional*, defaults to 1): The number of processes calling this together.
        wait_for_everyone (`Callable`, *optional*, defaults to a no-op): A barrier across those processes.

    Raises:
        `ValueError`: For an empty dataset, an unknown `text_dtype`, a row without a usable caption, or a NaN or inf.
    """
    if text_dtype not in TEXT_DTYPES:
        raise ValueError(f"unknown text dtype {text_dtype!r}; choose one of {sorted(TEXT_DTYPES)}")
    if len(dataset) == 0:
        raise ValueError("the dataset is empty: there is nothing to extract features from")
    path.mkdir(parents=True, exist_ok=True)
    num_shards = -(-len(dataset) // shard_size)
    mine = range(process_index, num_shards, num_processes)
    todo = [s for s in mine if not all(file.is_file() for file in shard_files(path / shard_name(s)))]
    if process_index == 0 and len(todo) < len(mine):
        logger.info(f"resuming the extraction into {path}: {len(mine) - len(todo)} of its shards are complete")
    write_shards(
        path,
        dataset,
        todo,
        f"extracting features ({len(todo)} of {num_shards} shards on this process)",
        image_column=image_column,
        caption_column=caption_column,
        resolution=resolution,
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        text_dtype=text_dtype,
        shard_size=shard_size,
        batch_size=batch_size,
        num_workers=num_workers,
        show_progress=process_index == 0,
    )
    wait_for_everyone()
    if process_index == 0:
        write_manifest(path, num_images=len(dataset), shard_size=shard_size, text_dtype=text_dtype)
    wait_for_everyone()


@torch.no_grad()
def write_shards(
    path: Path,
    dataset,
    shards: list[int],
    description: str,
    *,
    image_column: str,
    caption_column: str,
    resolution: int,
    tokenizer,
    text_encoder,
    vae,
    text_dtype: str,
    shard_size: int,
    batch_size: int,
    num_workers: int,
    show_progress: bool,
) -> None:
    """Encode the images and captions of `shards` and write each shard with its checksums (`ShardWriter`), while
    `DataLoader` workers decode and crop the next images; the other arguments are `extract_features`'."""
    spans = [
        (s, start, min(start + batch_size, (s + 1) * shard_size, len(dataset)))
        for s in shards
        for start in range(s * shard_size, min((s + 1) * shard_size, len(dataset)), batch_size)
    ]
    batches = torch.utils.data.DataLoader(
        ShardBatches(dataset, spans, shard_size, image_column, caption_column, resolution),
        batch_size=None,  # items are batches already
        num_workers=num_workers,
        generator=torch.Generator().manual_seed(0),  # the global RNG is left untouched
    )
    progress = progress_bar(
        sum(stop - start for _, start, stop in spans),
        description,
        unit="img",
        disable=not show_progress,
    )
    writer = None
    for shard, row, pixels, captions in batches:
        moments = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist.parameters.float()  # (b, 2C, h, w)
        states = encode_text(tokenizer, text_encoder, [c for image in captions for c in image])  # (m, T, D)
        states = states.to(TEXT_DTYPES[text_dtype])
        refuse_non_finite(dataset, image_column, shard * shard_size + row, moments, states, captions)
        if writer is None:  # the shard's first batch gives the shapes of its header
            counts = caption_counts(dataset, caption_column, shard, shard_size)
            writer, caption_offsets = open_shard(path / shard_name(shard), counts, moments, states, text_dtype)
        writer.write("moments", row, moments)
        writer.write("text_states", int(caption_offsets[row]), states)
        progress.update(len(pixels))
        if row + len(pixels) == len(counts):  # the shard's last batch
            writer.commit()
            writer = None
    progress.close()


def refuse_non_finite(
    dataset, image_column: str, first: int, moments: torch.Tensor, states: torch.Tensor, captions: list[list[str]]
) -> None:
    """Refuse a batch with a moment or text state that is not finite, naming the first such image (dataset index
    `first` + its place in the batch): a NaN or inf must never be stored."""
    bad_moments = ~torch.isfinite(moments).flatten(1).all(1)  # (b,)
    if bad_moments.any():
        index = first + int(bad_moments.nonzero()[0])
        raise ValueError(
            f"image {index}{image_file(dataset, image_column, index)}: its VAE moments are not finite (NaN or inf), "
            "as when a VAE in float16 overflows; nothing is stored. Encode in float32, or leave the image out"
        )
    bad_states = ~torch.isfinite(states).flatten(1).all(1)  # (m,)
    if bad_states.any():
        owners = [(k, caption) for k, image in enumerate(captions) for caption in image]  # one per row of states
        image, caption = owners[int(bad_states.nonzero()[0])]
        index = first + image
        limit = " (or beyond float16's range: store them in float32)" if states.dtype == torch.float16 else ""
        raise ValueError(
            f"image {index}{image_file(dataset, image_column, index)}: the text states of its caption {caption!r} are "
            f"not finite (NaN or inf){limit}; nothing is stored"
        )


def image_file(dataset, image_column: str, index: int) -> str:
    """` (<path>)` of the image file of row `index`, or "" when the row's image is not read from a file."""
    import datasets

    if not isinstance((dataset.features or {}).get(image_column), datasets.Image):
        return ""
    column = dataset.select_columns([image_column]).cast_column(image_column, datasets.Image(decode=False))
    path = column[index][image_column].get("path")
    return f" ({path})" if path else ""


def caption_counts(dataset, caption_column: str, shard: int, shard_size: int) -> list[int]:
    """The number of captions of each image of `shard`, read from the caption column alone."""
    rows = dataset.select_columns([caption_column])[shard * shard_size : (shard + 1) * shard_size]
    return [len(captions_of(value)) for value in rows[caption_column]]


def open_shard(
    path: Path, counts: list[int], moments: torch.Tensor, states: torch.Tensor, text_dtype: str
) -> tuple[ShardWriter, torch.Tensor]:
    """Start writing a shard: its header, from the shapes of a first batch, and its caption offsets; return the writer
    and the caption offsets (n + 1,)."""
    caption_offsets = torch.tensor([0, *counts]).cumsum(0)  # (n + 1,)
    writer = ShardWriter(
        path,
        {
            "moments": (torch.float32, (len(counts), *moments.shape[1:])),
            "caption_offsets": (torch.int64, (len(counts) + 1,)),
            "text_states": (TEXT_DTYPES[text_dtype], (int(caption_offsets[-1]), *states.shape[1:])),
        },
    )
    writer.write("caption_offsets", 0, caption_offsets)
    return writer, caption_offsets


def write_manifest(path: Path, *, num_images: int, shard_size: int, text_dtype: str) -> None:
    """Write `manifest.json` durably, after checking that every shard and its checksums are there (they are missing
    when the processes of a run on several machines do not share the store's file system)."""
    shards, headers = [], []
    for s in range(-(-num_images // shard_size)):
        file = path / shard_name(s)
        for needed in shard_files(file):
            if not needed.is_file():
                raise FileNotFoundError(
                    f"{needed} is missing after the extraction: every process of the run must see {path}; on several "
                    "machines, put --cache_dir on a file system they share"
                )
        with open(file, "rb") as f:
            header, _ = read_header(f.fileno(), file)
        headers.append(header)
        shards.append(
            {
                "file": file.name,
                "num_images": header["moments"]["shape"][0],
                "num_captions": header["text_states"]["shape"][0],
                **json.loads(checksums_path(file).read_text(encoding="utf-8")),
            }
        )
    manifest = {
        "format": FORMAT,
        "num_images": num_images,
        "num_captions": sum(shard["num_captions"] for shard in shards),
        "shard_size": shard_size,
        "text_dtype": text_dtype,
        "moments_shape": headers[0]["moments"]["shape"][1:],
        "text_states_shape": headers[0]["text_states"]["shape"][1:],
        "shards": shards,
    }
    write_json(path / MANIFEST, manifest)


def open_feature_store(
    path: Path,
    dataset,
    *,
    process_index: int = 0,
    num_processes: int = 1,
    wait_for_everyone: Callable[[], None] = lambda: None,
    **extraction,
) -> "FeatureStore":
    """The store at `path`, extracted first (each process its shards) unless it is complete, then checked.

    Every process of the run calls this together: each checks the structure of every shard and the checksums of its
    share (shards p, p + P, …), then all wait, so that no process reads a shard before it was checked.

    Args:
        path (`Path`): The store folder, `<cache_dir>/features/<feature_store_key(...)>`.
        dataset (`datasets.Dataset`): The training data.
        process_index (`int`, *optional*, defaults to 0): This process's rank.
        num_processes (`int`, *optional*, defaults to 1): The number of processes.
        wait_for_everyone (`Callable`, *optional*, defaults to a no-op): A barrier across them.
        **extraction: The keyword arguments of `extract_features` (columns, resolution, components, dtype, …).

    Returns:
        `FeatureStore`: The checked store.

    Raises:
        `ValueError` or `FileNotFoundError`: For a damaged, changed or missing shard, naming it and the fix.
    """
    complete = (path / MANIFEST).is_file()
    wait_for_everyone()  # every process has looked before one of them can write the manifest
    if not complete:
        if process_index == 0:
            logger.info(f"building the feature cache {path}")
            log_stores_of_other_formats(path.parent)
        extract_features(
            path,
            dataset,
            process_index=process_index,
            num_processes=num_processes,
            wait_for_everyone=wait_for_everyone,
            **extraction,
        )
    store = FeatureStore(path, verify=False)
    start, mine = time.perf_counter(), range(process_index, len(store.shards), num_processes)
    store.verify(mine, num_threads=max(1, available_cpus() // num_processes))
    if process_index == 0:
        size = sum(store.shard_bytes(s) for s in mine)
        logger.info(
            f"checked the checksums of {len(mine)} of the {len(store.shards)} shards ({size / 1e9:.2f} GB) in "
            f"{time.perf_counter() - start:.1f} s"
        )
    wait_for_everyone()  # every shard was checked, by one process or another
    return store


def log_stores_of_other_formats(features: Path) -> None:
    """Warn about the stores in `features` (`<cache_dir>/features`) of another format, which this version does not
    read, with the space deleting them frees."""
    for manifest in sorted(features.glob(f"*/{MANIFEST}")):
        try:
            found = json.loads(manifest.read_text(encoding="utf-8")).get("format")
        except (OSError, ValueError, AttributeError):
            continue
        if found != FORMAT:
            size = sum(file.stat().st_size for file in manifest.parent.iterdir())
            logger.warning(
                f"{manifest.parent} is a feature store of another format ({found!r}, not {FORMAT!r}), which this "
                f"version does not read: delete it to free {size / 1e9:.2f} GB"
            )
