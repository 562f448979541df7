"""Resumable evaluations: a progress folder holds `settings.json` (other settings are refused, never mixed in) and a
durably written `batch-<k>.safetensors` per finished batch, whatever the process count (it may change on resume)."""

import hashlib
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save as safetensors_bytes

from ..durable import fsync_tree, hold_lock, write_durably, write_json_durably


logger = logging.getLogger(__name__)

SETTINGS_FILE = "settings.json"
LOCK_FILE = ".evaluation.lock"
BATCH_GLOB = "batch-*.safetensors"
TEMPORARY_GLOB = ".*.tmp"
FORMAT = 2  # bumped when the files change meaning: progress of another format is refused like other settings
# How the refusal of other settings names them; a setting not listed here is named by its key (the option's name).
SETTING_NAMES = {
    "format": "the progress format of this diffusers-lmlp version",
    "resolution": "the image size",
    "pipeline": "the pipeline's weights or configs (another model, checkpoint or dtype)",
    "fid_renders": "the FID reference (the world's renders, or statistics)",
    "fid_extractor_weights": "the FID feature network's weights",
    "clip_weights": "the CLIP model's weights",
}
DIGESTS = {"captions", "pipeline", "fid_extractor_weights", "clip_weights"}  # hashes, not shown in that message


@dataclass
class BatchResult:
    """One batch: (B, C) float64 score rows (index first), (B, D) FID features by name, (n, H, W, 3) uint8 grid
    images, and the seconds it took."""

    rows: torch.Tensor
    features: dict[str, torch.Tensor]
    grid: torch.Tensor
    seconds: float


class EvaluationInterrupted(KeyboardInterrupt):
    """An evaluation stopped (Ctrl-C, SIGTERM), its batches kept in `folder`; `report`: process 0's partial one."""

    def __init__(self, folder: Path, num_images_done: int, num_images: int, report: dict | None):
        super().__init__(f"evaluation interrupted after {num_images_done} of {num_images} images; kept in {folder}")
        self.folder, self.num_images_done, self.num_images, self.report = folder, num_images_done, num_images, report


def tensors_digest(tensors: dict[str, torch.Tensor], digest=None) -> str:
    """The SHA-256 of each tensor's name, shape, dtype and bytes, fed to `digest` (a new one by default)."""
    digest = digest or hashlib.sha256()
    for name, tensor in tensors.items():
        digest.update(f"{name} {tuple(tensor.shape)} {tensor.dtype}\n".encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def batch_digest(tensors: dict[str, torch.Tensor], seconds: str | None) -> str:
    """The checksum of a batch file's tensors and time, kept in its metadata: a flipped bit or an edit shows."""
    return tensors_digest(dict(sorted(tensors.items())), hashlib.sha256(f"{seconds}\n".encode()))


def pipeline_digest(pipeline) -> str:
    """The SHA-256 of a pipeline's component classes, configs (no `_*` or version keys), vocabularies and weights."""
    digest = hashlib.sha256()
    for name, component in sorted(pipeline.components.items()):
        digest.update(f"{name}={type(component).__qualname__}\n".encode())
        config = getattr(component, "config", None)
        if config is not None:
            config = config.to_dict() if hasattr(config, "to_dict") else dict(config)
            public = {key: value for key, value in config.items() if key != "transformers_version" and key[0] != "_"}
            digest.update(json.dumps(public, sort_keys=True, default=str).encode())
        if hasattr(component, "get_vocab"):
            digest.update(json.dumps(component.get_vocab(), sort_keys=True).encode())
        if isinstance(component, torch.nn.Module):
            tensors_digest(component.state_dict(), digest)
    return digest.hexdigest()


class ProgressStore:
    """The progress folder of one evaluation; with `image_dir`, a batch is done only when its images are there too."""

    def __init__(self, folder: str | Path, settings: dict, processes, image_dir: Path | None = None):
        self.folder, self.settings, self.processes = Path(folder), {"format": FORMAT, **settings}, processes
        self.image_dir = Path(image_dir) if image_dir is not None else None
        self.key = hashlib.sha256(json.dumps(self.settings, sort_keys=True).encode()).hexdigest()
        self.lock = None

    def open(self) -> None:
        """On every process: refuse progress of other settings, record these, lock, remove a killed run's leftovers."""
        path = self.folder / SETTINGS_FILE
        try:
            recorded = json.loads(path.read_text(encoding="utf-8"))["settings"]
            if not isinstance(recorded, dict):
                raise TypeError(f"its settings are a {type(recorded).__name__}, not an object")
        except FileNotFoundError:
            recorded = None
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"{path} is not an evaluation's progress ({error}); delete {self.folder} or pass another "
                             "output folder") from None  # fmt: skip
        if recorded is not None and recorded != self.settings:
            differences = [
                SETTING_NAMES.get(name, name)
                + ("" if name in DIGESTS else f" ({recorded.get(name)} there, {self.settings.get(name)} now)")
                for name in sorted(recorded.keys() | self.settings.keys())
                if recorded.get(name) != self.settings.get(name)
            ]
            raise ValueError(
                f"{self.folder} holds the progress of an evaluation with other settings: {'; '.join(differences)}. "
                f"Finish it with the earlier command, pass another output folder, or delete {self.folder} to start over."
            )
        if self.processes.index == 0:
            self.folder.mkdir(parents=True, exist_ok=True)
            self.lock = hold_lock(self.folder / LOCK_FILE)  # released by the OS however this process ends
        busy = self.processes.gather(torch.tensor([[0.0, float(self.processes.index == 0 and self.lock is None)]]))
        if busy[:, 1].any():
            raise ValueError(f"Another evaluation is using {self.folder}: wait for it, or pass another output folder.")
        if self.processes.index == 0:
            for folder in (self.folder, self.image_dir):
                for leftover in folder.glob(TEMPORARY_GLOB) if folder is not None and folder.is_dir() else ():
                    leftover.unlink(missing_ok=True)  # written by a run killed before the rename
            if recorded is None:
                write_json_durably(path, {"settings": self.settings})
            else:
                logger.info(f"Resuming the evaluation kept in {self.folder}: {self.num_images_done()} of "
                            f"{self.settings['num_images']} images are done.")  # fmt: skip
        self.processes.wait()

    def close(self) -> None:
        if self.lock is not None:
            self.lock.close()
            self.lock = None

    def batch_path(self, number: int) -> Path:
        return self.folder / f"batch-{number:06d}.safetensors"

    def num_images_done(self) -> int:
        batch_size, num_images = self.settings["batch_size"], self.settings["num_images"]
        return sum(max(0, min(batch_size, num_images - number * batch_size)) for number in self.done_numbers())

    def done_numbers(self) -> list[int]:
        stems = (p.name.removeprefix("batch-").removesuffix(".safetensors") for p in self.folder.glob(BATCH_GLOB))
        return sorted(int(stem) for stem in stems if stem.isdigit())

    def read(self, number: int, batch: range | None = None, image_paths: list[Path] = ()) -> BatchResult | None:
        """Batch `number` from disk, or None when it must be sampled: missing, unreadable, of other settings, damaged,
        its `image_paths` missing, or not this `batch`."""
        path = self.batch_path(number)
        if not path.is_file():
            return None
        try:
            with safe_open(path, "pt") as f:
                metadata = f.metadata() or {}
                tensors = {name: f.get_tensor(name) for name in f.keys()}
        except (SafetensorError, OSError) as error:
            problem = f"does not read ({error})"
        else:
            indices = torch.arange(batch.start, batch.stop).double() if batch is not None else None
            problem = (
                "holds a batch of other settings" if metadata.get("settings") != self.key
                else "does not match its checksum (damaged or edited)"
                if metadata.get("sha256") != batch_digest(tensors, metadata.get("seconds"))
                else f"holds other images than batch {number}"
                if indices is not None and not torch.equal(tensors["rows"][:, 0], indices)
                else f"lacks its images in {self.image_dir}" if not all(image.is_file() for image in image_paths)
                else None
            )  # fmt: skip
        if problem is not None:
            logger.warning(f"{path} {problem}; its batch is sampled again.")
            return None
        features = {name.removeprefix("features."): value for name, value in tensors.items() if "." in name}
        return BatchResult(tensors["rows"], features, tensors["grid"], float(metadata["seconds"]))

    def save(self, number: int, result: BatchResult) -> None:
        """Keep batch `number` (after its images, which must already be on disk)."""
        if self.image_dir is not None:
            fsync_tree(self.image_dir, recursive=False)  # the images' renames, before the batch counts as done
        tensors = {
            "rows": result.rows,
            "grid": result.grid,
            **{f"features.{k}": v for k, v in result.features.items()},
        }
        metadata = {"settings": self.key, "seconds": repr(result.seconds)}
        metadata["sha256"] = batch_digest(tensors, metadata["seconds"])
        write_durably(self.batch_path(number), lambda f: f.write(safetensors_bytes(tensors, metadata)))
        fsync_tree(self.folder, recursive=False)

    def results(self) -> Iterator[BatchResult]:
        """Every readable batch on disk, in order (for the partial report)."""
        yield from filter(None, map(self.read, self.done_numbers()))


def remove_progress(folder: str | Path) -> None:
    """Delete a progress folder, settings last (a kill half-way leaves one that resumes); keep one with other files."""
    folder = Path(folder)
    for pattern in (BATCH_GLOB, TEMPORARY_GLOB, SETTINGS_FILE, LOCK_FILE):
        for path in folder.glob(pattern):
            path.unlink(missing_ok=True)
    try:
        folder.rmdir()
    except FileNotFoundError:
        pass
    except OSError:
        logger.warning(f"Kept {folder}: it holds files that are not the evaluation's progress.")
