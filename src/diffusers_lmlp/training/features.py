"""The feature store: the VAE moments of every training image and the CLIP text states of every caption, extracted
once (U-ViT's extraction) into safetensors shards and read lazily. A shard under its final name is complete, with its
checksums file next to it; the store is complete when its `manifest.json`, written last, is there. Extraction is
parallel and resumable and never stores a NaN or inf; opening checks every shard against the manifest.
"""

import hashlib
import json
import logging
import math
import os
import re
import struct
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from functools import cached_property
from pathlib import Path

import numpy as np
import torch

from ..durable import fsync_tree, hold_lock
from ..evaluation.captions import captions_of
from ..progress import progress_bar


logger = logging.getLogger(__name__)

# `--cache_text_dtype`: how the text states are stored (the moments are always float32).
TEXT_DTYPES = {"float32": torch.float32, "float16": torch.float16}
SHARD_SIZE = 1024  # images per shard
MANIFEST = "manifest.json"
# Part of every key, so a store of another layout is never read as this one.
FORMAT = "diffusers-lmlp feature store v2"
CHECKSUM_PARTS = ("header", "moments", "caption_offsets", "text_states")  # each hashed on its own
HASH_CHUNK = 8 << 20
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.int64: "I64"}
NUMPY_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "I64": np.dtype("<i8")}
MAX_OPEN_SHARDS = 64  # per process


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def checksums_path(shard: Path) -> Path:
    """The file of a shard's size and checksums, written before the shard is renamed into place."""
    return shard.with_suffix(".sha256.json")


def available_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def feature_store_key(
    dataset, *, image_column: str, caption_column: str, resolution: int, tokenizer, text_encoder, vae, text_dtype: str
) -> str:
    """The store's name (20 hex digits): equal for equal data (its `_fingerprint`, else its length), columns,
    resolution, components (configs, vocabulary, weights) and `text_dtype`; any change gives another store."""

    def digest(value) -> str:
        return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()

    parts = [
        FORMAT,
        getattr(dataset, "_fingerprint", None) or str(len(dataset)),
        image_column,
        caption_column,
        str(resolution),
        text_dtype,
        digest(dict(vae.config)),
        digest(text_encoder.config.to_dict()),
        digest([tokenizer.model_max_length, sorted(tokenizer.get_vocab().items())]),
        *(str(sum(float(p.detach().double().sum()) for p in m.parameters())) for m in (vae, text_encoder)),
    ]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:20]


def read_header(fd: int, path: Path) -> tuple[dict, int]:
    """The header of the safetensors file open as `fd` and the offset its data start at (`ValueError` if it is not
    one)."""
    raw = os.pread(fd, 8, 0)
    size = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
    if not 0 < size < 2**27:
        raise ValueError(f"{path} is not a safetensors file (its 8-byte header length is wrong)")
    try:
        return json.loads(os.pread(fd, size, 8)), 8 + size
    except ValueError:
        raise ValueError(f"{path} is not a safetensors file (its header is not JSON)") from None


def header_of(tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> dict:
    """The safetensors header of these tensors (name → (dtype, shape)), stored back to back in this order."""
    header, end = {}, 0
    for name, (dtype, shape) in tensors.items():
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [end, end + size]}
        end += size
    return header


def is_count(value) -> bool:
    return type(value) is int and value >= 1


def checksums_problem(record) -> str | None:
    """What is wrong with a shard's `{"bytes", "sha256"}` record, or None: the checksums must cover every part."""
    if not isinstance(record, dict) or not is_count(record.get("bytes")):
        return "its 'bytes' is not a positive integer"
    sha256 = record.get("sha256")
    if not isinstance(sha256, dict) or sorted(sha256) != sorted(CHECKSUM_PARTS):
        return f"its 'sha256' is {sha256!r:.80}, not the checksums of the parts {list(CHECKSUM_PARTS)}"
    if not all(isinstance(digest, str) and re.fullmatch("[0-9a-f]{64}", digest) for digest in sha256.values()):
        return "its 'sha256' holds a value that is not a SHA-256 hex digest"
    return None


def read_manifest(path: Path) -> dict:
    """The manifest of a complete store of this `FORMAT` (`FileNotFoundError` when missing, `ValueError` when it is
    not JSON, of another format, or a field is wrong)."""
    if not path.is_file():
        raise FileNotFoundError(
            f"{path.parent} is not a complete feature store: {MANIFEST} is missing (it is written last). On several "
            "machines, put --cache_dir on a file system that every process sees"
        )
    again = "delete it, and the next run writes it again from the shards' checksums files"
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except ValueError:
        raise ValueError(f"{path} is not valid JSON: {again}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"{path} is not a {FORMAT!r} manifest: delete {path.parent} to extract it again")
    if problem := manifest_problem(manifest):
        raise ValueError(f"{path} is not a valid {FORMAT!r} manifest ({problem}): {again}")
    return manifest


def manifest_problem(manifest: dict) -> str | None:
    """What is wrong with the fields of a manifest, or None."""
    shape_ok = lambda value: isinstance(value, list) and all(is_count(n) for n in value)  # noqa: E731
    checks = {
        **{field: is_count(manifest.get(field)) for field in ("num_images", "num_captions", "shard_size")},
        "text_dtype": manifest.get("text_dtype") in TEXT_DTYPES,
        "moments_shape": shape_ok(manifest.get("moments_shape")),
        "text_states_shape": shape_ok(manifest.get("text_states_shape")),
        "shards": isinstance(manifest.get("shards"), list),
    }
    if wrong := [field for field, ok in checks.items() if not ok]:
        return f"{', '.join(map(repr, wrong))} missing or of the wrong type"
    for index, shard in enumerate(manifest["shards"]):
        if not isinstance(shard, dict) or shard.get("file") != shard_name(index):
            return f"shard {index} is not named {shard_name(index)!r}"
        if not (is_count(shard.get("num_images")) and is_count(shard.get("num_captions"))):
            return f"shard {index}'s 'num_images' or 'num_captions' is not a positive integer"
        if problem := checksums_problem(shard):
            return f"shard {index}: {problem}"
    return None


def shard_digests(path: Path) -> dict[str, str]:
    """The SHA-256 of each part of a shard (its header, then each tensor's bytes), reading the file once, in order."""
    with open(path, "rb", buffering=0) as f:
        header, data_start = read_header(f.fileno(), path)
        parts = [("header", 0, data_start)] + sorted(
            ((name, data_start + entry["data_offsets"][0], data_start + entry["data_offsets"][1])
             for name, entry in header.items() if name != "__metadata__"),
            key=lambda part: part[1],
        )  # fmt: skip
        digests = {}
        for name, begin, end in parts:
            digest = hashlib.sha256()
            f.seek(begin)
            while begin < end:
                chunk = f.read(min(HASH_CHUNK, end - begin))
                if not chunk:
                    raise ValueError(f"{path} is shorter than its header says")
                digest.update(chunk)
                begin += len(chunk)
            digests[name] = digest.hexdigest()
    return digests


class ShardReader:
    """Positional reads of whole rows of the tensors of one safetensors file, into caller-owned arrays."""

    def __init__(self, path: Path):
        self.path, self.fd = path, os.open(path, os.O_RDONLY)
        try:
            self.header, self.data_start = read_header(self.fd, path)
        except ValueError:
            os.close(self.fd)
            raise
        self.tensors = {  # name → (offset of row 0, bytes per row, rows)
            name: (self.data_start + begin, (end - begin) // max(entry["shape"][0], 1), entry["shape"][0])
            for name, entry in self.header.items()
            if name != "__metadata__"
            for begin, end in [entry["data_offsets"]]
        }

    def read_into(self, name: str, row: int, out: np.ndarray) -> np.ndarray:
        """Read rows `row`, `row + 1`, … of tensor `name` into the C-contiguous `out`, as many as it holds."""
        offset, row_bytes, num_rows = self.tensors[name]
        if not 0 <= row <= num_rows - out.nbytes // row_bytes:
            raise IndexError(f"{self.path}: rows {row}+ of {name!r}, which has {num_rows}")
        if os.preadv(self.fd, [out], offset + row * row_bytes) != out.nbytes:
            raise OSError(f"{self.path} is truncated: delete its feature store folder to extract it again")
        return out

    @cached_property
    def caption_offsets(self) -> np.ndarray:
        """(n + 1,) int64: image i's captions are text rows `[i] : [i + 1]`; read once while the shard is open."""
        return self.read_into("caption_offsets", 0, np.empty(self.tensors["caption_offsets"][2], NUMPY_DTYPES["I64"]))

    def close(self) -> None:
        os.close(self.fd)


class FeatureStore:
    """A complete store, read lazily: `read` fetches the rows of one batch, and nothing else is held.

    Opening checks every shard's size, header and caption offsets against the manifest and, with `verify`, its
    checksums. Picklable for `DataLoader` workers, which open their own files and check nothing again.

    Raises:
        `FileNotFoundError`: When the manifest or a shard is missing.
        `ValueError`: For another kind of store, or a damaged or changed shard; the message says what to delete.
    """

    def __init__(self, path: Path, *, verify: bool = True):
        self.path, self.manifest_path = Path(path), Path(path) / MANIFEST
        manifest = read_manifest(self.manifest_path)
        self.num_images, self.num_captions = manifest["num_images"], manifest["num_captions"]
        self.shard_size, self.records = manifest["shard_size"], manifest["shards"]
        self.shards = [record["file"] for record in self.records]
        self.text_dtype = TEXT_DTYPES[manifest["text_dtype"]]
        self.moments_shape = tuple(manifest["moments_shape"])  # (2C, h, w)
        self.text_states_shape = tuple(manifest["text_states_shape"])  # (T, D)
        self._open: OrderedDict[int, ShardReader] = OrderedDict()
        counts = (len(self.shards), sum(record["num_captions"] for record in self.records))
        if counts != (-(-self.num_images // self.shard_size), self.num_captions):
            raise ValueError(
                f"{self.manifest_path} lists {counts[0]} shards of {counts[1]} captions, not those of "
                f"{self.num_images} images by {self.shard_size} with {self.num_captions} captions: delete it, and the "
                "next run writes it again from the shards"
            )
        for index in range(len(self.shards)):
            self.check_structure(index)
        if verify:
            self.verify()

    def fix(self, file: Path) -> str:
        return (
            f"Delete {file} and {self.manifest_path}: the next run extracts that shard again, and only that one (the "
            "extraction resumes, keeping the other shards)"
        )

    def missing(self, file: Path) -> FileNotFoundError:
        return FileNotFoundError(
            f"{file} is missing from the feature store: delete {self.manifest_path}, and the next run extracts the "
            "missing shard again, and only that one"
        )

    def check_structure(self, index: int) -> None:
        """Check shard `index`'s size, header and caption offsets against the manifest, reading only those."""
        file, record = self.path / self.shards[index], self.records[index]
        if not file.is_file():
            raise self.missing(file)
        if (size := file.stat().st_size) != record["bytes"]:
            raise ValueError(
                f"{file} is {size:,} bytes where its extraction wrote {record['bytes']:,}: it was cut short or "
                f"changed. {self.fix(file)}"
            )
        images, captions = min(self.shard_size, self.num_images - index * self.shard_size), record["num_captions"]
        expected = header_of(
            {
                "moments": (torch.float32, (images, *self.moments_shape)),
                "caption_offsets": (torch.int64, (images + 1,)),
                "text_states": (self.text_dtype, (captions, *self.text_states_shape)),
            }
        )
        try:
            reader = ShardReader(file)
        except ValueError as error:
            raise ValueError(f"{error}. {self.fix(file)}") from None
        try:
            found = {name: entry for name, entry in reader.header.items() if name != "__metadata__"}
            if found != expected:
                problem = f"has the header {found}, where the manifest expects {expected}"
            elif reader.data_start + expected["text_states"]["data_offsets"][1] != record["bytes"]:
                problem = "has a header that does not add up to its size"
            else:
                offsets = reader.read_into("caption_offsets", 0, np.empty(images + 1, NUMPY_DTYPES["I64"]))
                problem = None
                if offsets[0] != 0 or offsets[-1] != captions or not (np.diff(offsets) > 0).all():
                    shown = [str(offset) for offset in offsets.tolist()]
                    shown = shown if len(shown) <= 8 else [*shown[:4], "…", *shown[-2:]]
                    problem = (
                        f"has caption offsets [{', '.join(shown)}], which do not rise from 0 to its {captions} text "
                        "rows (image i's captions are rows offsets[i] to offsets[i + 1])"
                    )
        finally:
            reader.close()
        if problem:
            raise ValueError(f"{file} {problem}. {self.fix(file)}")

    def verify(self, shards: Iterable[int] | None = None, num_threads: int | None = None) -> None:
        """Check `shards` (default: all) against the checksums their extraction recorded, `num_threads` (default:
        one per CPU) at once; `ValueError` naming the shard, the part that differs and the fix."""
        shards = list(range(len(self.shards)) if shards is None else shards)
        if not shards:
            return
        pool = ThreadPoolExecutor(min(len(shards), num_threads or available_cpus()))  # hashing releases the GIL
        try:
            list(pool.map(self.verify_shard, shards))
        finally:
            pool.shutdown(cancel_futures=True)

    def verify_shard(self, index: int) -> None:
        file = self.path / self.shards[index]
        digests = shard_digests(file)
        for part, expected in self.records[index]["sha256"].items():
            if digests.get(part) != expected:
                raise ValueError(
                    f"{file}: the SHA-256 of its {part!r} bytes is not the one its extraction recorded in "
                    f"{self.manifest_path}: the file was damaged or changed after it was written. {self.fix(file)}"
                )

    def __len__(self) -> int:
        return self.num_images

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_open": OrderedDict()}  # a process that receives the store opens its own files

    def nbytes(self) -> int:
        """The size of the store's files on disk, in bytes."""
        files = [file for name in self.shards for file in (self.path / name, checksums_path(self.path / name))]
        return sum(file.stat().st_size for file in [self.manifest_path, *files])

    def shard(self, index: int) -> ShardReader:
        """The reader of shard `index`, opened on first use (at most `MAX_OPEN_SHARDS` stay open)."""
        if index in self._open:
            self._open.move_to_end(index)
            return self._open[index]
        path = self.path / self.shards[index]
        if not path.is_file():
            raise self.missing(path)
        self._open[index] = ShardReader(path)
        if len(self._open) > MAX_OPEN_SHARDS:
            self._open.popitem(last=False)[1].close()
        return self._open[index]

    def read(self, indices: list[int], picks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The moments (b, 2C, h, w) float32 (mean ‖ logvar) of images `indices` and the text states (b, T, D), in the
        store's text dtype, of one caption of each: its ⌊pick · (its captions)⌋-th, `picks` (b,) in [0, 1)."""
        for index in indices:
            if not 0 <= index < self.num_images:
                raise IndexError(f"image {index} of a feature store of {self.num_images}")
        moments = np.empty((len(indices), *self.moments_shape), NUMPY_DTYPES["F32"])  # (b, 2C, h, w)
        states = np.empty((len(indices), *self.text_states_shape), NUMPY_DTYPES[SAFETENSORS_DTYPES[self.text_dtype]])
        for k, (index, pick) in enumerate(zip(indices, picks.tolist())):
            shard, row = divmod(index, self.shard_size)
            reader = self.shard(shard)
            begin, end = reader.caption_offsets[row : row + 2].tolist()
            reader.read_into("moments", row, moments[k])
            reader.read_into("text_states", begin + int(pick * (end - begin)), states[k])
        return torch.from_numpy(moments), torch.from_numpy(states)


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
    """CLIP's last hidden state (B, T, D) of each text, padded and truncated to the tokenizer's length and encoded
    without an attention mask, as U-ViT does; on the text encoder's device, in its dtype."""
    ids = tokenizer(
        texts, padding="max_length", max_length=tokenizer.model_max_length, truncation=True, return_tensors="pt"
    ).input_ids  # (B, T)
    return text_encoder(ids.to(text_encoder.device))[0]  # (B, T, D)


class ShardWriter:
    """Writes one safetensors file at its header's offsets, batch by batch, hashing each part as it is written, so the
    extraction holds one batch in memory, not one shard. `tensors`: name → (dtype, shape), in file order. `commit`
    writes the checksums file, then fsyncs the shard and renames it from `<path>.tmp` to `path`."""

    def __init__(self, path: Path, tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]]):
        self.path, self.tmp = path, path.with_name(path.name + ".tmp")
        self.header = header = header_of(tensors)
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data start 8-byte aligned, as safetensors writes them
        encoded = struct.pack("<Q", len(encoded)) + encoded
        self.data_start, self.size = len(encoded), len(encoded) + list(header.values())[-1]["data_offsets"][1]
        self.written = dict.fromkeys(tensors, 0)  # rows written so far, from row 0
        self.hashes = {"header": hashlib.sha256(encoded), **{name: hashlib.sha256() for name in tensors}}
        self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.pwrite(self.fd, encoded, 0)
        os.ftruncate(self.fd, self.size)

    def write(self, name: str, row: int, values: torch.Tensor) -> None:
        """Write `values` (k, *shape[1:]) as rows `row`, `row + 1`, … of tensor `name`; rows come in order, from 0, so
        that they are hashed as they are written."""
        entry = self.header[name]
        (begin, end), rows = entry["data_offsets"], entry["shape"][0]
        row_bytes = (end - begin) // max(rows, 1)
        data = np.ascontiguousarray(values.detach().cpu().numpy(), dtype=NUMPY_DTYPES[entry["dtype"]])
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
        """Once every row is written: write the checksums file, fsync the shard, rename it, fsync the folder."""
        for name, entry in self.header.items():
            if self.written[name] != entry["shape"][0]:
                raise ValueError(
                    f"{self.tmp}: {name} has {self.written[name]} of its {entry['shape'][0]} rows written"
                )
        write_json(
            checksums_path(self.path),
            {"bytes": self.size, "sha256": {name: digest.hexdigest() for name, digest in self.hashes.items()}},
        )
        os.fsync(self.fd)
        os.close(self.fd)
        os.replace(self.tmp, self.path)
        fsync_tree(self.path.parent, recursive=False)


class ShardBatches(torch.utils.data.Dataset):
    """Item k: `(shard, first row in the shard, pixels, captions)` of `spans[k]` = `(shard, start, stop)`. Map-style,
    so `DataLoader` workers decode and crop the images while the encoders run."""

    def __init__(self, dataset, spans, shard_size: int, image_column: str, caption_column: str, resolution: int):
        self.dataset, self.spans, self.shard_size = dataset, spans, shard_size
        self.image_column, self.caption_column, self.resolution = image_column, caption_column, resolution

    def __len__(self) -> int:
        return len(self.spans)

    def __getitem__(self, k: int) -> tuple[int, int, torch.Tensor, list[list[str]]]:
        from .data import preprocess_image  # data.py imports this module

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

    Every process calls this together: process p of P writes those of shards p, p + P, … that are not complete (a
    killed extraction resumes), `num_workers` `DataLoader` workers decoding the images; all wait (`wait_for_everyone`)
    before and after process 0 writes the manifest. The images are centre-cropped to `resolution`, `batch_size` at a
    time; the moments are stored in float32, the text states in `text_dtype`.

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
    done = lambda s: (path / shard_name(s)).is_file() and checksums_path(path / shard_name(s)).is_file()  # noqa: E731
    todo = [s for s in mine if not done(s)]
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
        states = encode_text(tokenizer, text_encoder, [c for image in captions for c in image])  # (m, T, D)
        states = states.to(TEXT_DTYPES[text_dtype])
        refuse_non_finite(dataset, image_column, shard * shard_size + row, moments, states, captions)
        if writer is None:  # the shard's first batch gives the shapes of its header
            rows = dataset.select_columns([caption_column])[shard * shard_size : (shard + 1) * shard_size]
            counts = [len(captions_of(value)) for value in rows[caption_column]]
            caption_offsets = torch.tensor([0, *counts]).cumsum(0)  # (n + 1,)
            tensors = {
                "moments": (torch.float32, (len(counts), *moments.shape[1:])),
                "caption_offsets": (torch.int64, (len(counts) + 1,)),
                "text_states": (TEXT_DTYPES[text_dtype], (int(caption_offsets[-1]), *states.shape[1:])),
            }
            writer = ShardWriter(path / shard_name(shard), tensors)
            writer.write("caption_offsets", 0, caption_offsets)
        writer.write("moments", row, moments)
        writer.write("text_states", int(caption_offsets[row]), states)
        progress.update(len(pixels))
        if row + len(pixels) == len(counts):  # the shard's last batch
            writer.commit()
            writer = None
    progress.close()
    wait_for_everyone()
    if process_index == 0:
        write_manifest(path, num_images=len(dataset), shard_size=shard_size, text_dtype=text_dtype)
    wait_for_everyone()


def refuse_non_finite(
    dataset, image_column: str, first: int, moments: torch.Tensor, states: torch.Tensor, captions: list[list[str]]
) -> None:
    """Refuse a batch (its first image is dataset row `first`) with a moment or text state that is not finite, naming
    the first such image: a NaN or inf must never be stored."""
    import datasets

    def image(index: int) -> str:
        """`image <index>`, with its file when the row's image is read from one."""
        if not isinstance((dataset.features or {}).get(image_column), datasets.Image):
            return f"image {index}"
        column = dataset.select_columns([image_column]).cast_column(image_column, datasets.Image(decode=False))
        path = column[index][image_column].get("path")
        return f"image {index} ({path})" if path else f"image {index}"

    bad_moments = ~torch.isfinite(moments).flatten(1).all(1)  # (b,)
    if bad_moments.any():
        raise ValueError(
            f"{image(first + int(bad_moments.nonzero()[0]))}: its VAE moments are not finite (NaN or inf), as when a "
            "VAE in float16 overflows; nothing is stored. Encode in float32, or leave the image out"
        )
    bad_states = ~torch.isfinite(states).flatten(1).all(1)  # (m,)
    if bad_states.any():
        owners = [(k, caption) for k, image_captions in enumerate(captions) for caption in image_captions]
        owner, caption = owners[int(bad_states.nonzero()[0])]  # one per row of states
        limit = " (or beyond float16's range: store them in float32)" if states.dtype == torch.float16 else ""
        raise ValueError(
            f"{image(first + owner)}: the text states of its caption {caption!r} are not finite (NaN or inf){limit}; "
            "nothing is stored"
        )


def write_manifest(path: Path, *, num_images: int, shard_size: int, text_dtype: str) -> None:
    """Write `manifest.json` durably from the shards' headers and checksums files, which must all be there (they are
    not when the processes of a run on several machines do not share the store's file system)."""
    shards, headers = [], []
    for s in range(-(-num_images // shard_size)):
        file = path / shard_name(s)
        for needed in (file, checksums_path(file)):
            if not needed.is_file():
                raise FileNotFoundError(
                    f"{needed} is missing after the extraction: every process of the run must see {path}; on several "
                    "machines, put --cache_dir on a file system they share"
                )
        with open(file, "rb") as f:
            headers.append(header := read_header(f.fileno(), file)[0])
        try:
            record = json.loads(checksums_path(file).read_text(encoding="utf-8"))
        except ValueError:
            record = None
        if problem := checksums_problem(record):
            raise ValueError(
                f"{checksums_path(file)} is not a shard's checksums file ({problem}): delete it and {file}, and the "
                "next run extracts that shard again"
            )
        counts = {"num_images": header["moments"]["shape"][0], "num_captions": header["text_states"]["shape"][0]}
        shards.append({"file": file.name, **counts, **record})
    write_json(
        path / MANIFEST,
        {
            "format": FORMAT,
            "num_images": num_images,
            "num_captions": sum(shard["num_captions"] for shard in shards),
            "shard_size": shard_size,
            "text_dtype": text_dtype,
            "moments_shape": headers[0]["moments"]["shape"][1:],
            "text_states_shape": headers[0]["text_states"]["shape"][1:],
            "shards": shards,
        },
    )


def open_feature_store(
    path: Path,
    dataset,
    *,
    process_index: int = 0,
    num_processes: int = 1,
    wait_for_everyone: Callable[[], None] = lambda: None,
    **extraction,
) -> FeatureStore:
    """The store at `path` (`<cache_dir>/features/<feature_store_key(...)>`), extracted first unless it is complete
    (`extraction`: `extract_features`' keyword arguments), then checked.

    Every process of the run calls this together: each checks the structure of every shard and the checksums of its
    share (shards p, p + P, …), then all wait, so that no process reads a shard before it was checked. Process 0
    holds a lock, so that a second run on the same `--cache_dir` waits for the first to build the store.
    """
    lock = None
    if process_index == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock_path = path.parent / f".{path.name}.lock"
        if (lock := hold_lock(lock_path)) is None:
            logger.info(f"waiting for another run that builds the feature cache {path}")
            lock = hold_lock(lock_path, wait=True)
    try:
        wait_for_everyone()
        complete = (path / MANIFEST).is_file()
        wait_for_everyone()  # every process has looked before one of them can write the manifest
        if not complete:
            if process_index == 0:
                logger.info(f"building the feature cache {path}")
                log_stores_of_other_formats(path.parent)
            extract_features(path, dataset, process_index=process_index, num_processes=num_processes,
                             wait_for_everyone=wait_for_everyone, **extraction)  # fmt: skip
        store = FeatureStore(path, verify=False)
        store.verify(range(process_index, len(store.shards), num_processes), max(1, available_cpus() // num_processes))
        wait_for_everyone()  # every shard was checked, by one process or another
        return store
    finally:
        if lock is not None:
            lock.close()


def log_stores_of_other_formats(features: Path) -> None:
    """Warn about the stores in `<cache_dir>/features` of another format, which this version does not read, with the
    space deleting them frees."""
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
