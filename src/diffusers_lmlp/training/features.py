"""The feature store: the VAE moments of every training image and the CLIP text states of every caption, extracted
once (U-ViT's extraction), kept on disk and read lazily; its format, key and reading (`training.feature_extraction`
writes one). `<cache_dir>/features/<key>/` holds `shard-NNNNN.safetensors` files (`moments` (n, 2C, h, w) float32
mean ‖ logvar, `caption_offsets` (n + 1,) int64, `text_states` (m, T, D)), each with a `.sha256.json` of its size
and checksums, and `manifest.json`, written last: the store is complete when it is there.

Shards, not U-ViT's per-sample `.npy` files, keep the number of files small. Rows are read with `os.preadv` into the
batch's tensor, not through a memory map, whose touched pages would grow a long run's resident memory; safetensors,
never pickle. Every shard's structure is checked whenever a store opens, the checksums once per run.
"""

import functools
import hashlib
import json
import math
import os
import struct
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch


# `--cache_text_dtype`: how the text states are stored (the moments are always float32).
TEXT_DTYPES = {"float32": torch.float32, "float16": torch.float16}
# Images per shard: large enough that COCO-2014 train is 81 files, small enough that a killed extraction loses little.
SHARD_SIZE = 1024
MANIFEST = "manifest.json"
# Part of every key, so a store of another layout is never read as this one (v2 added the shards' checksums).
FORMAT = "diffusers-lmlp feature store v2"
# Bytes read at a time when a shard is hashed.
HASH_CHUNK = 8 << 20
# safetensors dtype names, and the little-endian numpy dtypes their bytes are.
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.int64: "I64"}
NUMPY_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "I64": np.dtype("<i8")}
# At most this many shard files are open at once in one process.
MAX_OPEN_SHARDS = 64


def shard_name(index: int) -> str:
    """The file name of shard `index`, which holds images `index · shard_size` onwards."""
    return f"shard-{index:05d}.safetensors"


def checksums_path(shard: Path) -> Path:
    """The file of a shard's size and checksums, written by the process that wrote the shard."""
    return shard.with_suffix(".sha256.json")


def shard_files(shard: Path) -> tuple[Path, Path]:
    """A shard's files: the shard and its checksums; a shard is complete when both are there."""
    return shard, checksums_path(shard)


def available_cpus() -> int:
    """The number of CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def feature_store_key(
    dataset, *, image_column: str, caption_column: str, resolution: int, tokenizer, text_encoder, vae, text_dtype: str
) -> str:
    """The name of the store of these data, columns, resolution, components and storage dtype.

    Equal inputs give equal keys, so every run and process finds the same store; any change gives another store.

    Args:
        dataset (`datasets.Dataset`): The training data; its `_fingerprint` (else its length) is used.
        image_column (`str`): The image column.
        caption_column (`str`): The caption column.
        resolution (`int`): The side of the encoded images.
        tokenizer (`CLIPTokenizer`): Its vocabulary and length are part of the key.
        text_encoder (`CLIPTextModel`): Its config and weights are part of the key.
        vae (`AutoencoderKL`): Its config and weights are part of the key.
        text_dtype (`str`): A `TEXT_DTYPES` name.

    Returns:
        `str`: 20 hex digits.
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
    """SHA-256 of a JSON-able value, keys sorted; what JSON cannot encode is encoded as its `str`."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def read_header(fd: int, path: Path) -> tuple[dict, int]:
    """The header of a safetensors file open as `fd`, and the offset its data start at; `ValueError` when it is not
    one (`path` is for the message)."""
    raw = os.pread(fd, 8, 0)
    size = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
    if not 0 < size < 2**27:
        raise ValueError(f"{path} is not a safetensors file (its 8-byte header length is wrong)")
    try:
        header = json.loads(os.pread(fd, size, 8))
    except ValueError:
        raise ValueError(f"{path} is not a safetensors file (its header is not JSON)") from None
    return header, 8 + size


def read_manifest(path: Path) -> dict:
    """The manifest of a complete store of this `FORMAT`: `FileNotFoundError` when it is missing (an incomplete
    store), `ValueError` when it is not JSON, of another format or lacks a field."""
    if not path.is_file():
        raise FileNotFoundError(
            f"{path.parent} is not a complete feature store: {MANIFEST} is missing. It is written last, once every "
            "shard is; on several machines, put --cache_dir on a file system that every process sees"
        )
    again = "delete it, and the next run writes it again from the shards' checksums files"
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except ValueError:
        raise ValueError(f"{path} is not valid JSON: {again}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"{path} is not a {FORMAT!r} manifest: delete {path.parent} to extract it again")
    fields = ("num_images", "num_captions", "shard_size", "text_dtype", "moments_shape", "text_states_shape")
    shard_fields = ("file", "num_images", "num_captions", "bytes", "sha256")
    if not all(field in manifest for field in (*fields, "shards")) or not all(
        isinstance(shard, dict) and all(field in shard for field in shard_fields) for shard in manifest["shards"]
    ):
        raise ValueError(f"{path} lacks fields of a {FORMAT!r} manifest: {again}")
    return manifest


def shard_digests(path: Path) -> dict[str, str]:
    """The SHA-256 of each part of a shard file (its header, then each tensor's bytes), as `ShardWriter.commit`
    records them; the file is read once, in order, `HASH_CHUNK` bytes at a time."""
    with open(path, "rb", buffering=0) as f:
        header, data_start = read_header(f.fileno(), path)
        parts = [("header", 0, data_start)] + sorted(
            ((name, data_start + entry["data_offsets"][0], data_start + entry["data_offsets"][1])
             for name, entry in header.items() if name != "__metadata__"),
            key=lambda part: part[1],
        )  # fmt: skip
        buffer, digests = memoryview(bytearray(HASH_CHUNK)), {}
        for name, begin, end in parts:
            digest, position = hashlib.sha256(), begin
            f.seek(begin)
            while position < end:
                count = f.readinto(buffer[: min(HASH_CHUNK, end - position)])
                if not count:
                    raise ValueError(f"{path} is shorter than its header says")
                digest.update(buffer[:count])
                position += count
            digests[name] = digest.hexdigest()
    return digests


class ShardReader:
    """Positional reads of whole rows of the tensors of one safetensors file, into caller-owned arrays."""

    def __init__(self, path: Path):
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        try:
            header, data_start = read_header(self.fd, path)
        except ValueError:
            os.close(self.fd)
            raise
        self.header, self.data_start = header, data_start
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
        """Read rows `row`, `row + 1`, … of tensor `name` into the C-contiguous `out`, as many as it holds, in the
        file's dtype."""
        offset, row_bytes, num_rows = self.tensors[name]
        if not 0 <= row <= num_rows - out.nbytes // row_bytes:
            raise IndexError(f"{self.path}: rows {row}+ of {name!r}, which has {num_rows}")
        if os.preadv(self.fd, [out], offset + row * row_bytes) != out.nbytes:
            raise OSError(f"{self.path} is truncated: delete its feature store folder to extract it again")
        return out

    @functools.cached_property
    def caption_offsets(self) -> np.ndarray:
        """(n + 1,) int64: image i's captions are text rows `caption_offsets[i] : caption_offsets[i + 1]`. Read once
        and kept while the shard is open, so that a sample's read is two reads, not three."""
        rows = self.tensors["caption_offsets"][2]
        return self.read_into("caption_offsets", 0, np.empty(rows, NUMPY_DTYPES["I64"]))

    def close(self) -> None:
        os.close(self.fd)


class FeatureStore:
    """A complete store, read lazily: `read` fetches the rows of one batch, and nothing else is held.

    Opening it checks every shard's structure against the manifest (size, header, caption offsets) and, with `verify`,
    its checksums. Picklable for `DataLoader` workers: each process opens its own files and checks nothing again.

    Args:
        path (`Path`): The store folder.
        verify (`bool`, *optional*, defaults to `True`): Check every shard's checksums too (`verify`).

    Raises:
        `FileNotFoundError`: When the manifest or a shard is missing (an incomplete store, or another file system's).
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
                f"{self.manifest_path} lists {counts[0]} shards of {counts[1]} captions, not the shards of "
                f"{self.num_images} images by {self.shard_size} and their {self.num_captions} captions: delete it, "
                "and the next run writes it again from the shards"
            )
        for index in range(len(self.shards)):
            self.check_structure(index)
        if verify:
            self.verify()

    def fix(self, file: Path) -> str:
        """What to do about the damaged shard `file`: the next run extracts it again, and only it."""
        return (
            f"Delete {file} and {self.manifest_path}: the next run extracts that shard again, and only that one (the "
            "extraction resumes, keeping the other shards)"
        )

    def check_structure(self, index: int) -> None:
        """Check shard `index`'s size, header and caption offsets against the manifest, reading only those
        (`FileNotFoundError` or `ValueError`, naming the fix)."""
        file, record = self.path / self.shards[index], self.records[index]
        if not file.is_file():
            raise FileNotFoundError(
                f"{file} is missing from the feature store: delete {self.manifest_path}, and the next run extracts "
                "the missing shard again, and only that one"
            )
        size = file.stat().st_size
        if size != record["bytes"]:
            raise ValueError(
                f"{file} is {size:,} bytes where its extraction wrote {record['bytes']:,}: it was cut short or "
                f"changed. {self.fix(file)}"
            )
        try:
            reader = ShardReader(file)
        except ValueError as error:
            raise ValueError(f"{error}. {self.fix(file)}") from None
        try:
            problem = self.structure_problem(index, reader)
        finally:
            reader.close()
        if problem:
            raise ValueError(f"{file} {problem}. {self.fix(file)}")

    def structure_problem(self, index: int, reader: "ShardReader") -> str | None:
        """What is wrong with a shard's header or caption offsets (`reader`: its open shard), or None."""
        images = min(self.shard_size, self.num_images - index * self.shard_size)
        captions = self.records[index]["num_captions"]
        expected = {
            "moments": ("F32", [images, *self.moments_shape]),
            "caption_offsets": ("I64", [images + 1]),
            "text_states": (SAFETENSORS_DTYPES[self.text_dtype], [captions, *self.text_states_shape]),
        }
        tensors = {name: entry for name, entry in reader.header.items() if name != "__metadata__"}
        found = {name: (entry.get("dtype"), entry.get("shape")) for name, entry in tensors.items()}
        if found != expected:
            return f"holds {found}, where the manifest expects {expected}"
        end = 0
        for name, (dtype, shape) in expected.items():  # in this order, back to back, as `ShardWriter` writes them
            if tensors[name].get("data_offsets") != [end, end + math.prod(shape) * NUMPY_DTYPES[dtype].itemsize]:
                return f"has a header whose byte offsets of {name!r} are wrong"
            end = tensors[name]["data_offsets"][1]
        if reader.data_start + end != self.records[index]["bytes"]:
            return "has a header that does not add up to its size"
        offsets = reader.read_into("caption_offsets", 0, np.empty(images + 1, NUMPY_DTYPES["I64"]))  # (n + 1,)
        if offsets[0] != 0 or offsets[-1] != captions or not (np.diff(offsets) > 0).all():
            shown = [str(offset) for offset in offsets.tolist()]
            shown = shown if len(shown) <= 8 else [*shown[:4], "…", *shown[-2:]]
            return (
                f"has caption offsets [{', '.join(shown)}], which do not rise from 0 to its {captions} text rows (image "
                "i's captions are rows offsets[i] to offsets[i + 1])"
            )
        return None

    def verify(self, shards: Iterable[int] | None = None, num_threads: int | None = None) -> None:
        """Check shards against the checksums their extraction recorded: each is read whole and hashed (SHA-256).

        Args:
            shards (`Iterable[int]`, *optional*): The shards; all of them by default.
            num_threads (`int`, *optional*): Shards hashed at once (hashing releases the GIL); default: one per CPU.

        Raises:
            `ValueError`: For a shard that does not match its checksums, naming it and the fix.
        """
        shards = list(range(len(self.shards)) if shards is None else shards)
        if not shards:
            return
        with ThreadPoolExecutor(min(len(shards), num_threads or available_cpus())) as pool:
            futures = [pool.submit(self.verify_shard, index) for index in shards]
            try:
                for future in futures:
                    future.result()
            except BaseException:
                for future in futures:
                    future.cancel()
                raise

    def verify_shard(self, index: int) -> None:
        """Check shard `index` against its checksums (`ValueError` naming the part that differs, and the fix)."""
        file = self.path / self.shards[index]
        digests = shard_digests(file)
        for part, expected in self.records[index]["sha256"].items():
            if digests.get(part) != expected:
                raise ValueError(
                    f"{file}: the SHA-256 of its {part!r} bytes is not the one its extraction recorded in "
                    f"{self.manifest_path}: the file was damaged or changed after it was written. {self.fix(file)}"
                )

    def shard_bytes(self, index: int) -> int:
        """The size of shard `index`'s file, in bytes.

        Args:
            index (`int`): The shard.
        """
        return self.records[index]["bytes"]

    def __len__(self) -> int:
        return self.num_images

    def __getstate__(self) -> dict:
        # A process that receives the store opens its own files.
        return {**self.__dict__, "_open": OrderedDict()}

    def nbytes(self) -> int:
        """The size of the store's files on disk, in bytes."""
        files = [file for name in self.shards for file in shard_files(self.path / name)]
        return sum(file.stat().st_size for file in [self.manifest_path, *files])

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
                f"{path} is missing from the feature store: delete {self.manifest_path}, and the next run extracts "
                "the missing shard again, and only that one"
            )
        self._open[index] = ShardReader(path)
        if len(self._open) > MAX_OPEN_SHARDS:
            self._open.popitem(last=False)[1].close()
        return self._open[index]

    def read(self, indices: list[int], picks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The moments of images `indices` and the text states of one caption of each, its ⌊pick · (its captions)⌋-th.

        Args:
            indices (`list[int]`): Images.
            picks (`torch.Tensor`): (b,) in [0, 1), one per image.

        Returns:
            `tuple[torch.Tensor, torch.Tensor]`: Moments (b, 2C, h, w) float32 (mean ‖ logvar) and text states
            (b, T, D) in the store's text dtype.
        """
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
