"""The feature store: VAE moments and CLIP text states extracted once into safetensors shards, read row by row. A
shard is complete with its checksums file, the store with its `manifest.json`; NaN and inf are refused."""

import contextlib
import hashlib
import json
import logging
import os
import re
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from functools import cached_property, partial
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from ..durable import hold_lock, write_json_durably
from ..evaluation.captions import captions_of
from ..progress import progress_bar


logger = logging.getLogger(__name__)

TEXT_DTYPES = {"float32": torch.float32, "float16": torch.float16}  # `--cache_text_dtype`'s (moments: float32)
SHARD_SIZE = 256  # images per shard, held in memory while it is extracted
MANIFEST = "manifest.json"
FORMAT = "diffusers-lmlp feature store v3"  # in every key: a store of another layout is never read as this one
MAX_OPEN_SHARDS = 64  # file descriptors per process


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def checksums_path(shard: Path) -> Path:  # its size and SHA-256, written once the shard is in place
    return shard.with_suffix(".sha256.json")


def available_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def feature_store_key(
    dataset, *, image_column: str, caption_column: str, resolution: int, tokenizer, text_encoder, vae, text_dtype: str
) -> str:
    """The store's name (20 hex digits), equal for equal data, columns, resolution, components and `text_dtype`."""

    def digest(value) -> str:
        return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()

    parts = [FORMAT, getattr(dataset, "_fingerprint", None) or str(len(dataset)), image_column, caption_column,
             str(resolution), text_dtype, digest(dict(vae.config)), digest(text_encoder.config.to_dict()),
             digest([tokenizer.model_max_length, sorted(tokenizer.get_vocab().items())]),
             *(str(sum(float(p.detach().double().sum()) for p in m.parameters())) for m in (vae, text_encoder))]  # fmt: skip
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:20]


def is_count(value) -> bool:
    return type(value) is int and value >= 1


def checksums_ok(record) -> bool:
    sha256 = record.get("sha256") if isinstance(record, dict) else None
    return isinstance(sha256, str) and bool(re.fullmatch("[0-9a-f]{64}", sha256)) and all(
        is_count(record.get(field)) for field in ("bytes", "num_captions"))  # fmt: skip


def read_manifest(path: Path) -> dict:
    """The manifest of a complete store of this `FORMAT`: `FileNotFoundError` when missing, else `ValueError`."""
    if not path.is_file():
        fix = "On several machines, put --cache_dir on a file system that every process sees"
        raise FileNotFoundError(f"{path.parent} is not a complete feature store: {MANIFEST} is missing. {fix}")
    manifest = None
    with contextlib.suppress(ValueError):  # not JSON
        manifest = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"{path} is not a {FORMAT!r} manifest: delete {path.parent} to extract it again")
    shards = manifest.get("shards") if isinstance(manifest.get("shards"), list) else []
    checks = {
        **{field: is_count(manifest.get(field)) for field in ("num_images", "shard_size")},
        "text_dtype": manifest.get("text_dtype") in TEXT_DTYPES,
        **{field: isinstance(manifest.get(field), list) and all(map(is_count, manifest[field]))
           for field in ("moments_shape", "text_states_shape")},
        "shards": isinstance(manifest.get("shards"), list),
        **{f"shards[{i}]": checksums_ok(shard) and shard.get("file") == shard_name(i) for i, shard in enumerate(shards)},
    }  # fmt: skip
    if wrong := [field for field, ok in checks.items() if not ok]:
        fields = ", ".join(map(repr, wrong))
        raise ValueError(f"{path} is not a valid {FORMAT!r} manifest ({fields} missing or wrong): delete it")
    return manifest


def read_header(fd: int, path: Path) -> tuple[dict, int]:
    raw = os.pread(fd, 8, 0)
    size = int.from_bytes(raw, "little") if len(raw) == 8 else -1
    try:
        if 0 < size < 2**27:
            return json.loads(os.pread(fd, size, 8)), 8 + size
    except ValueError:
        pass
    raise ValueError(f"{path} is not a safetensors file (its header is not one)")


class ShardReader:
    """Positional reads of rows of a safetensors file into caller-owned arrays (`safe_open` maps the file)."""

    def __init__(self, path: Path):
        self.path, self.fd = path, os.open(path, os.O_RDONLY)
        try:
            self.header, data_start = read_header(self.fd, path)
        except ValueError:
            os.close(self.fd)
            raise
        self.tensors = {  # name → (offset of row 0, bytes per row, rows)
            name: (data_start + begin, (end - begin) // max(entry["shape"][0], 1), entry["shape"][0])
            for name, entry in self.header.items() if name != "__metadata__" for begin, end in [entry["data_offsets"]]
        }  # fmt: skip

    @cached_property
    def caption_offsets(self) -> np.ndarray:
        return self.read_into("caption_offsets", 0, np.empty(self.tensors["caption_offsets"][2], np.int64))

    def read_into(self, name: str, row: int, out: np.ndarray) -> np.ndarray:
        """Read rows `row`, `row + 1`, … of tensor `name` into `out`, as many as it holds."""
        offset, row_bytes, num_rows = self.tensors[name]
        if not 0 <= row <= num_rows - out.nbytes // row_bytes:
            raise IndexError(f"{self.path}: rows {row}+ of {name!r}, which has {num_rows}")
        if os.preadv(self.fd, [out], offset + row * row_bytes) != out.nbytes:
            raise OSError(f"{self.path} is truncated: delete its feature store folder to extract it again")
        return out

    def close(self) -> None:
        os.close(self.fd)


class FeatureStore:
    """A complete store, read lazily; opening checks every shard's size and header and, with `verify`, its SHA-256
    (`FileNotFoundError` or `ValueError`, saying what to delete). Picklable: workers open their own files."""

    def __init__(self, path: Path, *, verify: bool = True):
        self.path, self.manifest_path = Path(path), Path(path) / MANIFEST
        manifest = read_manifest(self.manifest_path)
        self.num_images, self.shard_size = manifest["num_images"], manifest["shard_size"]
        self.records = manifest["shards"]
        self.num_captions = sum(record["num_captions"] for record in self.records)
        self.shards = [record["file"] for record in self.records]
        self.text_dtype = TEXT_DTYPES[manifest["text_dtype"]]
        self.moments_shape = tuple(manifest["moments_shape"])  # (2C, h, w)
        self.text_states_shape = tuple(manifest["text_states_shape"])  # (T, D)
        self._open: OrderedDict[int, ShardReader] = OrderedDict()
        if len(self.shards) != -(-self.num_images // self.shard_size):
            raise ValueError(f"{self.manifest_path} lists a wrong number of shards ({len(self.shards)}): delete it")
        for index in range(len(self.shards)):
            self.check_structure(index)
        if verify:
            self.verify()

    def fix(self, file: Path) -> str:
        return f"Delete {file} and {self.manifest_path}: the next run extracts that shard again, and only that one"

    def check_structure(self, index: int) -> None:
        file, record = self.path / self.shards[index], self.records[index]
        fix = self.fix(file)
        if not file.is_file():
            raise FileNotFoundError(f"{file} is missing from the feature store. {fix}")
        if (size := file.stat().st_size) != record["bytes"]:
            raise ValueError(f"{file} is {size:,} bytes where its extraction wrote {record['bytes']:,}. {fix}")
        images, captions = min(self.shard_size, self.num_images - index * self.shard_size), record["num_captions"]
        dtype = "F16" if self.text_dtype == torch.float16 else "F32"
        expected = {
            "moments": ("F32", [images, *self.moments_shape]), "caption_offsets": ("I64", [images + 1]),
            "text_states": (dtype, [captions, *self.text_states_shape])
        }  # fmt: skip
        try:
            with open(file, "rb") as f:
                header = read_header(f.fileno(), file)[0]
            found = {name: (e["dtype"], e["shape"]) for name, e in header.items() if name != "__metadata__"}
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ValueError(f"{file} is not a safetensors file (its header is not one). {fix}") from None
        if found != expected:
            raise ValueError(f"{file} has the tensors {found}, where the manifest expects {expected}. {fix}")

    def verify(self, shards: Iterable[int] | None = None, num_threads: int | None = None) -> None:
        """Check `shards` (default: all) against their recorded SHA-256, in `num_threads` (default: one per CPU)."""
        shards = list(range(len(self.shards)) if shards is None else shards)
        with ThreadPoolExecutor(max(1, min(len(shards), num_threads or available_cpus()))) as pool:
            list(pool.map(self.verify_shard, shards))  # in threads: hashing releases the GIL

    def verify_shard(self, index: int) -> None:
        file = self.path / self.shards[index]
        with open(file, "rb") as f:
            if hashlib.file_digest(f, "sha256").hexdigest() != self.records[index]["sha256"]:
                why = f"its SHA-256 is not the one its extraction recorded in {self.manifest_path}: it was damaged"
                raise ValueError(f"{file}: {why} or changed after it was written. {self.fix(file)}")

    def __len__(self) -> int:
        return self.num_images

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_open": OrderedDict()}  # a process that receives the store opens its own files

    def nbytes(self) -> int:
        return sum(file.stat().st_size for file in self.path.iterdir())

    def shard(self, index: int) -> ShardReader:
        """The reader of shard `index`, opened on first use (`MAX_OPEN_SHARDS` stay open)."""
        if index in self._open:
            self._open.move_to_end(index)
            return self._open[index]
        self._open[index] = ShardReader(self.path / self.shards[index])
        if len(self._open) > MAX_OPEN_SHARDS:
            self._open.popitem(last=False)[1].close()
        return self._open[index]

    def read(self, indices: list[int], picks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The moments (b, 2C, h, w) of images `indices`, the text states (b, T, D) of their ⌊pick · n⌋-th captions."""
        for index in indices:
            if not 0 <= index < self.num_images:
                raise IndexError(f"image {index} of a feature store of {self.num_images}")
        moments = torch.empty((len(indices), *self.moments_shape), dtype=torch.float32)  # (b, 2C, h, w)
        states = torch.empty((len(indices), *self.text_states_shape), dtype=self.text_dtype)  # (b, T, D)
        for k, (index, pick) in enumerate(zip(indices, picks.tolist())):
            shard, row = divmod(index, self.shard_size)
            reader = self.shard(shard)
            begin, end = reader.caption_offsets[row : row + 2].tolist()
            reader.read_into("moments", row, moments[k].numpy())
            reader.read_into("text_states", begin + int(pick * (end - begin)), states[k].numpy())
        return moments, states


@torch.no_grad()
def encode_text(tokenizer, text_encoder, texts: list[str]) -> torch.Tensor:
    """CLIP's last hidden state (B, T, D) of each text, padded to the tokenizer's length, without a mask (U-ViT's)."""
    ids = tokenizer(
        texts, padding="max_length", max_length=tokenizer.model_max_length, truncation=True, return_tensors="pt"
    ).input_ids  # (B, T)
    return text_encoder(ids.to(text_encoder.device))[0]  # (B, T, D)


def write_shard(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
        sha256 = hashlib.file_digest(f, "sha256").hexdigest()
    os.replace(tmp, path)
    shapes = {f"{name}_shape": list(tensors[name].shape[1:]) for name in ("moments", "text_states")}
    record = {"bytes": path.stat().st_size, "sha256": sha256, "num_captions": len(tensors["text_states"]), **shapes}
    write_json_durably(checksums_path(path), record)  # fsyncs the folder


def load_span(dataset, shard_size: int, image_column: str, caption_column: str, resolution: int, span):
    """`(shard, first row in it, pixels, captions)` of `span` = `(shard, start, stop)`, in `DataLoader` workers."""
    from .data import preprocess_image  # data.py imports this module

    shard, start, stop = span
    rows = dataset[start:stop]
    pixels = torch.stack([preprocess_image(image, resolution, False) for image in rows[image_column]])
    return shard, start - shard * shard_size, pixels, [captions_of(v) for v in rows[caption_column]]


@torch.no_grad()
def extract_features(
    path: Path, dataset, *, image_column: str, caption_column: str, resolution: int, tokenizer, text_encoder, vae,
    text_dtype: str = "float32", shard_size: int = SHARD_SIZE, batch_size: int = 32, num_workers: int = 0,
    process_index: int = 0, num_processes: int = 1, wait_for_everyone: Callable[[], None] = lambda: None,
) -> None:  # fmt: skip
    """Write the store at `path`, all processes together: process p of P the incomplete ones of shards p, p + P, …,
    then process 0 the manifest. `ValueError` for no data, an unknown `text_dtype`, a bad caption, a NaN or inf."""
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
    ends = {s: min((s + 1) * shard_size, len(dataset)) for s in todo}
    spans = [(s, a, min(a + batch_size, ends[s])) for s in todo for a in range(s * shard_size, ends[s], batch_size)]
    batches = torch.utils.data.DataLoader(  # items are batches already; the global RNG is left untouched
        spans, batch_size=None, num_workers=num_workers, generator=torch.Generator().manual_seed(0),
        collate_fn=partial(load_span, dataset, shard_size, image_column, caption_column, resolution),
    )  # fmt: skip
    progress = progress_bar(
        sum(stop - start for _, start, stop in spans), f"extracting features ({len(todo)} of {num_shards} shards on "
        "this process)", unit="img", disable=process_index != 0,
    )  # fmt: skip
    parts, counts = [], []  # the (moments, states) of the shard being extracted, its images' caption counts
    for shard, row, pixels, captions in batches:
        moments = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist.parameters.float().cpu()  # (b, 2C, h, w)
        states = encode_text(tokenizer, text_encoder, [c for image in captions for c in image])  # (m, T, D)
        states = states.to("cpu", TEXT_DTYPES[text_dtype])
        refuse_non_finite(dataset, image_column, shard * shard_size + row, moments, states, captions)
        parts.append((moments, states))
        counts += map(len, captions)
        progress.update(len(pixels))
        if row + len(pixels) == min(shard_size, len(dataset) - shard * shard_size):  # the shard's last batch
            tensors = dict(zip(("moments", "text_states"), (torch.cat(part) for part in zip(*parts))))
            write_shard(path / shard_name(shard), {**tensors, "caption_offsets": torch.tensor([0, *counts]).cumsum(0)})
            parts, counts = [], []
    progress.close()
    wait_for_everyone()
    if process_index == 0:
        write_manifest(path, num_images=len(dataset), shard_size=shard_size, text_dtype=text_dtype)
    wait_for_everyone()


def refuse_non_finite(
    dataset, image_column: str, first: int, moments: torch.Tensor, states: torch.Tensor, captions: list[list[str]]
) -> None:
    """Refuse a batch (from dataset row `first`) with a NaN or inf, naming the first such image and its file."""
    from datasets import Image

    def image(index: int) -> str:
        file = None
        if isinstance((dataset.features or {}).get(image_column), Image):
            file = dataset.cast_column(image_column, Image(decode=False))[index][image_column].get("path")
        return f"image {index} ({file})" if file else f"image {index}"

    bad_moments = ~torch.isfinite(moments).flatten(1).all(1)  # (b,)
    if bad_moments.any():
        where = image(first + int(bad_moments.nonzero()[0]))
        raise ValueError(f"{where}: its VAE moments are not finite (NaN or inf): encode in float32, or leave it out")
    bad_states = ~torch.isfinite(states).flatten(1).all(1)  # (m,)
    if bad_states.any():
        owners = [(k, caption) for k, image_captions in enumerate(captions) for caption in image_captions]
        owner, caption = owners[int(bad_states.nonzero()[0])]  # one per row of states
        limit = " (or beyond float16's range: store them in float32)" if states.dtype == torch.float16 else ""
        where = f"{image(first + owner)}: the text states of its caption {caption!r}"
        raise ValueError(f"{where} are not finite (NaN or inf){limit}; nothing is stored")


def write_manifest(path: Path, *, num_images: int, shard_size: int, text_dtype: str) -> None:
    shards = []
    for s in range(-(-num_images // shard_size)):
        file = path / shard_name(s)
        for needed in (file, checksums_path(file)):
            if not needed.is_file():
                raise FileNotFoundError(f"{needed} is missing after the extraction: put --cache_dir on a shared disk")
        record = None
        with contextlib.suppress(ValueError):  # not JSON
            record = json.loads(checksums_path(file).read_text(encoding="utf-8"))
        if not checksums_ok(record):
            raise ValueError(f"{checksums_path(file)} is not a shard's checksums file: delete it and {file}")
        shards.append({"file": file.name, **{k: record[k] for k in ("bytes", "sha256", "num_captions")}})
    manifest = {"format": FORMAT, "num_images": num_images, "shard_size": shard_size, "text_dtype": text_dtype}
    shapes = {field: record.get(field) for field in ("moments_shape", "text_states_shape")}
    write_json_durably(path / MANIFEST, {**manifest, **shapes, "shards": shards})


def open_feature_store(
    path: Path, dataset, *, process_index: int = 0, num_processes: int = 1,
    wait_for_everyone: Callable[[], None] = lambda: None, **extraction,
) -> FeatureStore:  # fmt: skip
    """The store at `path`, extracted first unless complete, then checked; all processes call this together."""
    lock = None
    if process_index == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock_path = path.parent / f".{path.name}.lock"
        if (lock := hold_lock(lock_path)) is None:
            logger.info(f"waiting for another run that builds the feature cache {path}")
            lock = hold_lock(lock_path, wait=True)
    with lock if lock is not None else contextlib.nullcontext():  # closing the lock file drops it
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


def log_stores_of_other_formats(features: Path) -> None:
    for manifest in sorted(features.glob(f"*/{MANIFEST}")):
        try:
            found = json.loads(manifest.read_text(encoding="utf-8")).get("format")
        except (OSError, ValueError, AttributeError):
            continue
        if found != FORMAT:
            size = sum(file.stat().st_size for file in manifest.parent.iterdir())
            why = f", which this version does not read: delete it to free {size / 1e9:.2f} GB"
            logger.warning(f"{manifest.parent} is a feature store of another format ({found!r}, not {FORMAT!r}){why}")
