"""The feature store: the VAE moments of every training image and the CLIP text states of every caption, extracted
once, on disk, and read lazily, a few rows at a time, by every training process.

This is U-ViT's extraction (`scripts/extract_mscoco_feature.py`: moments mean ‖ logvar of the centre-cropped,
Lanczos-resized image; the text encoder's last hidden state of each caption) with a different way of storing it.

Layout of a store (`<cache_dir>/features/<key>/`, the key from `feature_store_key`)::

    shard-00000.safetensors   images 0 … 1023:
                                moments          (n, 2C, h, w)  float32   mean ‖ logvar, re-sampled at every use
                                caption_offsets  (n + 1,)       int64     image i's captions are rows
                                                                          caption_offsets[i] : caption_offsets[i + 1]
                                text_states      (m, T, D)      float32 or float16 (`text_dtype`)
    shard-00001.safetensors   images 1024 … 2047, …
    manifest.json             written last, by the main process: its presence means the store is complete

Why sharded safetensors files read with positional reads:

- **Not U-ViT's per-sample `.npy` files.** COCO-2014 train is 82,783 images and 414,113 captions: half a million
  small files, slow to create, copy and list on network file systems, and one `open` per sample read. A shard of
  1,024 images is one file, and a read is one `os.preadv` into the batch's buffer, with no per-read `open`.
- **Not Arrow through `datasets.map`.** A killed `map` starts over, where a killed extraction here keeps its complete
  shards; `map` with several processes writes one file per process, not per rank of a training run; and `datasets`
  reads Arrow through a memory map (below).
- **Positional reads, not a memory map.** The pages of a memory map that a process touches count in its resident
  memory (RSS), so a memory-mapped store makes a long run's RSS grow towards the size of the store (98 GB of fp32
  text states for COCO-2014), and schedulers and OOM killers read RSS. `os.preadv` copies just the rows a batch needs
  (the safetensors header gives their byte offsets) into the batch's own tensor; the file pages stay in the kernel's
  page cache, which is not the process's memory and is dropped under pressure. A reading process holds a few open
  file descriptors and parsed headers: its memory does not grow with the dataset.
- **safetensors, never pickle.** Each shard is a valid safetensors file (`safetensors.torch.load_file` reads it); it
  is written here batch by batch at the header's offsets, so extraction holds one batch in memory, not one shard
  (1,024 COCO images have 5,000+ fp32 text states: 1.2 GB).

Extraction is parallel and resumable: with P processes, process p writes shards p, p + P, …; each shard is written
to `<shard>.tmp`, fsynced and renamed, so a shard under its final name is complete, and a killed extraction writes only
the shards it had not finished. The store folder must be on a file system that every process sees.

Disk per image: 4·2C·h·w + 8 bytes, plus 4·T·D (float32) or 2·T·D (float16) per caption. The COCO recipe (SD VAE at
256 px: 2·4·32·32 moments; CLIP L/14: 77 × 768 states; 5 captions per image, 414,113 / 82,783 = 5.0 on average):
32,768 + 8 + 5 × 236,544 = 1,215,496 B ≈ 1.16 MiB per image in float32 (100.7 GB for train2014), and
32,768 + 8 + 5 × 118,272 = 624,136 B ≈ 0.60 MiB in float16 (51.7 GB).
"""

import hashlib
import json
import logging
import math
import os
import struct
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from .data import captions_of, preprocess_image
from .durable import fsync_tree
from .progress import progress_bar


logger = logging.getLogger(__name__)

# `--cache_text_dtype`: how the text states are stored (the moments are always float32).
TEXT_DTYPES = {"float32": torch.float32, "float16": torch.float16}
# Images per shard: large enough that COCO-2014 train is 81 files, small enough that a killed extraction loses little.
SHARD_SIZE = 1024
MANIFEST = "manifest.json"
# Part of every key: a store of another layout is never read as this one.
FORMAT = "diffusers-lmlp feature store v1"
# safetensors dtype names, and the little-endian numpy dtypes their bytes are.
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.int64: "I64"}
NUMPY_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "I64": np.dtype("<i8")}
# At most this many shard files are open at once in one process.
MAX_OPEN_SHARDS = 64


def shard_name(index: int) -> str:
    """The file name of shard `index`.

    Args:
        index (`int`): The shard's position; it holds images `index · shard_size` onwards.
    """
    return f"shard-{index:05d}.safetensors"


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


def feature_store_key(
    dataset, *, image_column: str, caption_column: str, resolution: int, tokenizer, text_encoder, vae, text_dtype: str
) -> str:
    """The name of the store of these data, columns, resolution, components and storage dtype.

    Equal inputs give equal keys, so every run and every process of a run finds the same store; any change (another
    dataset or subset, another resolution, other weights) gives another store.

    Args:
        dataset (`datasets.Dataset`): The training data; its `_fingerprint` (or, lacking one, its length) is used.
        image_column (`str`): The image column.
        caption_column (`str`): The caption column.
        resolution (`int`): The side of the encoded images.
        tokenizer (`CLIPTokenizer`): Its vocabulary and length are part of the key.
        text_encoder (`CLIPTextModel`): Its config and weights are part of the key.
        vae (`AutoencoderKL`): Its config and weights are part of the key.
        text_dtype (`str`): A `TEXT_DTYPES` name.
    """
    parts = [
        FORMAT,
        getattr(dataset, "_fingerprint", None) or str(len(dataset)),
        image_column,
        caption_column,
        str(resolution),
        text_dtype,
        json_digest(dict(vae.config)),
        json_digest(text_encoder.config.to_dict()),
        json_digest([tokenizer.model_max_length, sorted(tokenizer.get_vocab().items())]),
        str(sum(float(p.detach().double().sum()) for p in vae.parameters())),
        str(sum(float(p.detach().double().sum()) for p in text_encoder.parameters())),
    ]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:20]


def json_digest(value) -> str:
    """SHA-256 of a JSON-able value, with keys sorted.

    Args:
        value: The value; what JSON cannot encode is encoded as its `str`.
    """
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


# --------------------------------------------------------------------------------------------------------- writing


class ShardWriter:
    """Writes one safetensors file in place, batch by batch, at the offsets its header gives.

    The header is written first, from the shapes alone; `write` then puts rows of a tensor at their place, so the
    file never has to be held in memory. `commit` fsyncs the file and renames it from `<path>.tmp` to `path`.

    Args:
        path (`Path`): The final name of the file.
        tensors (`dict[str, tuple[torch.dtype, tuple[int, ...]]]`): Name → (dtype, shape) of every tensor, in the
            order their bytes follow each other.
    """

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
        self.data_start = 8 + len(encoded)
        self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.pwrite(self.fd, struct.pack("<Q", len(encoded)) + encoded, 0)
        os.ftruncate(self.fd, self.data_start + end)

    def write(self, name: str, row: int, values: torch.Tensor) -> None:
        """Write `values` as rows `row`, `row + 1`, … of tensor `name`.

        Args:
            name (`str`): The tensor.
            row (`int`): The first row written.
            values (`torch.Tensor`): (k, *shape[1:]), converted to the tensor's dtype.
        """
        begin, row_bytes, dtype = self.offsets[name]
        data = np.ascontiguousarray(values.detach().cpu().numpy(), dtype=dtype)
        if data.nbytes != len(values) * row_bytes:
            raise ValueError(
                f"{name}: rows of {data.nbytes // max(len(values), 1)} bytes, the header says {row_bytes}"
            )
        os.pwrite(self.fd, data.tobytes(), self.data_start + begin + row * row_bytes)

    def commit(self) -> None:
        """Make the file durable under its final name: fsync, rename, fsync the folder."""
        os.fsync(self.fd)
        os.close(self.fd)
        os.replace(self.tmp, self.path)
        fsync_tree(self.path.parent, recursive=False)


class ShardBatches(torch.utils.data.Dataset):
    """The image batches of the shards to write: item k is `(shard, first row in the shard, pixels, captions)`.

    A map-style dataset, so a `DataLoader`'s workers decode and crop the images while the encoders run.

    Args:
        dataset (`datasets.Dataset`): The training data.
        spans (`list[tuple[int, int, int]]`): `(shard, start, stop)` per batch: dataset rows `start:stop`.
        shard_size (`int`): Images per shard.
        image_column (`str`): The image column.
        caption_column (`str`): The caption column.
        resolution (`int`): The side of the encoded images.
    """

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
    """Write the store at `path`: this process's missing shards, then (on the main process) the manifest.

    Every process of the run calls this together: process p writes shards p, p + P, …, skipping those already
    complete (a killed extraction resumes), all wait, process 0 writes the manifest, all wait again. Process 0 shows a
    progress bar with an ETA.

    Args:
        path (`Path`): The store folder (created if missing).
        dataset (`datasets.Dataset`): Map-style training data, rows of `{image_column: PIL image, caption_column: a
            caption or a list of them}`.
        image_column (`str`): The image column.
        caption_column (`str`): The caption column.
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
        wait_for_everyone (`Callable`, *optional*): A barrier across those processes.

    Raises:
        `ValueError`: For an empty dataset, an unknown `text_dtype`, or a row without a usable caption.
    """
    if text_dtype not in TEXT_DTYPES:
        raise ValueError(f"unknown text dtype {text_dtype!r}; choose one of {sorted(TEXT_DTYPES)}")
    if len(dataset) == 0:
        raise ValueError("the dataset is empty: there is nothing to extract features from")
    path.mkdir(parents=True, exist_ok=True)
    num_shards = -(-len(dataset) // shard_size)
    mine = range(process_index, num_shards, num_processes)
    todo = [s for s in mine if not (path / shard_name(s)).is_file()]
    if process_index == 0 and len(todo) < len(mine):
        logger.info(f"resuming the extraction into {path}: {len(mine) - len(todo)} of its shards are complete")
    spans = [
        (s, start, min(start + batch_size, (s + 1) * shard_size, len(dataset)))
        for s in todo
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
        f"extracting features ({len(todo)} of {num_shards} shards on this process)",
        unit="img",
        disable=process_index != 0,
    )
    writer = None
    for shard, row, pixels, captions in batches:
        moments = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist.parameters.float()  # (b, 2C, h, w)
        states = encode_text(tokenizer, text_encoder, [c for image in captions for c in image]).float()  # (m, T, D)
        if writer is None:  # the shard's first batch gives the shapes of its header
            counts = caption_counts(dataset, caption_column, shard, shard_size)
            writer, caption_offsets = open_shard(path / shard_name(shard), counts, moments, states, text_dtype)
        writer.write("moments", row, moments)
        writer.write("text_states", int(caption_offsets[row]), states.to(TEXT_DTYPES[text_dtype]))
        progress.update(len(pixels))
        if row + len(pixels) == len(counts):  # the shard's last batch
            writer.commit()
            writer = None
    progress.close()
    wait_for_everyone()
    if process_index == 0:
        write_manifest(path, num_images=len(dataset), shard_size=shard_size, text_dtype=text_dtype)
    wait_for_everyone()


def caption_counts(dataset, caption_column: str, shard: int, shard_size: int) -> list[int]:
    """The number of captions of each image of a shard, read from the caption column alone.

    Args:
        dataset (`datasets.Dataset`): The training data.
        caption_column (`str`): The caption column.
        shard (`int`): The shard.
        shard_size (`int`): Images per shard.
    """
    rows = dataset.select_columns([caption_column])[shard * shard_size : (shard + 1) * shard_size]
    return [len(captions_of(value)) for value in rows[caption_column]]


def open_shard(
    path: Path, counts: list[int], moments: torch.Tensor, states: torch.Tensor, text_dtype: str
) -> tuple[ShardWriter, torch.Tensor]:
    """Start writing a shard: its header and its caption offsets.

    Args:
        path (`Path`): The shard's file.
        counts (`list[int]`): The number of captions of each of its images.
        moments (`torch.Tensor`): A batch of moments (b, 2C, h, w), for the shape.
        states (`torch.Tensor`): A batch of text states (m, T, D), for the shape.
        text_dtype (`str`): A `TEXT_DTYPES` name.

    Returns:
        `tuple[ShardWriter, torch.Tensor]`: The writer and the caption offsets (n + 1,).
    """
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
    """Check that every shard is there and write `manifest.json` (to a temporary name, fsynced, renamed).

    Args:
        path (`Path`): The store folder.
        num_images (`int`): The number of images.
        shard_size (`int`): Images per shard.
        text_dtype (`str`): A `TEXT_DTYPES` name.

    Raises:
        `FileNotFoundError`: When a shard is missing, as when the processes of a run on several machines do not share
            the file system the store is on.
    """
    shards, headers = [], []
    for s in range(-(-num_images // shard_size)):
        file = path / shard_name(s)
        if not file.is_file():
            raise FileNotFoundError(
                f"{file} is missing after the extraction: every process of the run must see {path}; on several "
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
    tmp = path / (MANIFEST + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path / MANIFEST)
    fsync_tree(path, recursive=False)


def open_feature_store(
    path: Path,
    dataset,
    *,
    process_index: int = 0,
    num_processes: int = 1,
    wait_for_everyone: Callable[[], None] = lambda: None,
    **extraction,
) -> "FeatureStore":
    """The store at `path`, extracted first (by all the processes, each its shards) unless it is complete.

    Every process of the run calls this together.

    Args:
        path (`Path`): The store folder, `<cache_dir>/features/<feature_store_key(...)>`.
        dataset (`datasets.Dataset`): The training data.
        process_index (`int`, *optional*, defaults to 0): This process's rank.
        num_processes (`int`, *optional*, defaults to 1): The number of processes.
        wait_for_everyone (`Callable`, *optional*): A barrier across them.
        **extraction: The keyword arguments of `extract_features` (columns, resolution, components, dtype, …).
    """
    complete = (path / MANIFEST).is_file()
    wait_for_everyone()  # every process has looked before one of them can write the manifest
    if not complete:
        if process_index == 0:
            logger.info(f"building the feature cache {path}")
        extract_features(
            path,
            dataset,
            process_index=process_index,
            num_processes=num_processes,
            wait_for_everyone=wait_for_everyone,
            **extraction,
        )
    return FeatureStore(path)


# --------------------------------------------------------------------------------------------------------- reading


def read_header(fd: int, path: Path) -> tuple[dict, int]:
    """The header of a safetensors file and the offset its data start at.

    Args:
        fd (`int`): The open file.
        path (`Path`): Its path, for the messages.

    Raises:
        `ValueError`: When the file is not a safetensors file.
    """
    raw = os.pread(fd, 8, 0)
    size = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
    if not 0 < size < 2**27:
        raise ValueError(f"{path} is not a safetensors file (its 8-byte header length is wrong)")
    try:
        header = json.loads(os.pread(fd, size, 8))
    except ValueError:
        raise ValueError(f"{path} is not a safetensors file (its header is not JSON)") from None
    return header, 8 + size


class ShardReader:
    """Positional reads of whole rows of the tensors of one safetensors file, into caller-owned arrays.

    Args:
        path (`Path`): The file.
    """

    def __init__(self, path: Path):
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        header, data_start = read_header(self.fd, path)
        # name → (offset of row 0, bytes per row, rows)
        self.tensors = {
            name: (
                data_start + entry["data_offsets"][0],
                (entry["data_offsets"][1] - entry["data_offsets"][0]) // max(entry["shape"][0], 1),
                entry["shape"][0],
            )
            for name, entry in header.items()
            if name != "__metadata__"
        }

    def read_into(self, name: str, row: int, out: np.ndarray) -> np.ndarray:
        """Read rows `row`, `row + 1`, … of tensor `name` into `out`, which must be C-contiguous.

        Args:
            name (`str`): The tensor.
            row (`int`): The first row.
            out (`np.ndarray`): As many rows as it holds are read; its dtype must be the file's.

        Raises:
            `OSError`: When the file is shorter than its header says.
        """
        offset, row_bytes, num_rows = self.tensors[name]
        if not 0 <= row <= num_rows - out.nbytes // row_bytes:
            raise IndexError(f"{self.path}: rows {row}+ of {name!r}, which has {num_rows}")
        if os.preadv(self.fd, [out], offset + row * row_bytes) != out.nbytes:
            raise OSError(f"{self.path} is truncated: delete its feature store folder to extract it again")
        return out

    def close(self) -> None:
        os.close(self.fd)


class FeatureStore:
    """A complete store, read lazily: `read` fetches the rows of one batch, and nothing else is held.

    Picklable (a `DataLoader` worker may receive it): open files are not carried over, each process opens its own.

    Args:
        path (`Path`): The store folder.

    Raises:
        `FileNotFoundError`: When the manifest is missing (an incomplete store, or a folder other processes of the run
            wrote on a file system this one does not see).
        `ValueError`: When the folder holds another kind of store.
    """

    def __init__(self, path: Path):
        manifest_path = Path(path) / MANIFEST
        if not manifest_path.is_file():
            raise FileNotFoundError(
                f"{path} is not a complete feature store: {MANIFEST} is missing. It is written last, once every shard "
                "is; on several machines, put --cache_dir on a file system that every process sees"
            )
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        if manifest.get("format") != FORMAT:
            raise ValueError(f"{manifest_path} is not a {FORMAT!r} manifest: delete {path} to extract it again")
        self.path = Path(path)
        self.num_images, self.num_captions = manifest["num_images"], manifest["num_captions"]
        self.shard_size, self.shards = manifest["shard_size"], [shard["file"] for shard in manifest["shards"]]
        self.text_dtype = TEXT_DTYPES[manifest["text_dtype"]]
        self.moments_shape = tuple(manifest["moments_shape"])  # (2C, h, w)
        self.text_states_shape = tuple(manifest["text_states_shape"])  # (T, D)
        self._open: OrderedDict[int, ShardReader] = OrderedDict()

    def __len__(self) -> int:
        return self.num_images

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_open": OrderedDict()}

    def nbytes(self) -> int:
        """The size of the store's files on disk, in bytes."""
        return sum((self.path / name).stat().st_size for name in [MANIFEST, *self.shards])

    def shard(self, index: int) -> ShardReader:
        """The reader of shard `index`, opened on first use (at most `MAX_OPEN_SHARDS` stay open).

        Args:
            index (`int`): The shard.
        """
        if index in self._open:
            self._open.move_to_end(index)
            return self._open[index]
        path = self.path / self.shards[index]
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} is missing from the feature store: delete {self.path} to extract it again"
            )
        self._open[index] = ShardReader(path)
        if len(self._open) > MAX_OPEN_SHARDS:
            self._open.popitem(last=False)[1].close()
        return self._open[index]

    def read(self, indices: list[int], picks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The moments of images `indices` and the text states of one caption of each.

        Image i's caption is its caption number ⌊pick · (number of its captions)⌋.

        Args:
            indices (`list[int]`): Images.
            picks (`torch.Tensor`): (b,) in [0, 1), one per image.

        Returns:
            `tuple[torch.Tensor, torch.Tensor]`: Moments (b, 2C, h, w) float32 (mean ‖ logvar) and text states
            (b, T, D) in the store's text dtype.
        """
        moments = np.empty((len(indices), *self.moments_shape), NUMPY_DTYPES["F32"])  # (b, 2C, h, w)
        states = np.empty((len(indices), *self.text_states_shape), NUMPY_DTYPES[SAFETENSORS_DTYPES[self.text_dtype]])
        offsets = np.empty(2, NUMPY_DTYPES["I64"])
        for k, (index, pick) in enumerate(zip(indices, picks.tolist())):
            if not 0 <= index < self.num_images:
                raise IndexError(f"image {index} of a feature store of {self.num_images}")
            shard, row = divmod(index, self.shard_size)
            reader = self.shard(shard)
            begin, end = reader.read_into("caption_offsets", row, offsets).tolist()
            reader.read_into("moments", row, moments[k])
            reader.read_into("text_states", begin + int(pick * (end - begin)), states[k])
        return torch.from_numpy(moments), torch.from_numpy(states)
