"""FID: feature networks (Inception as torch-fidelity runs it, a world's network or any module), the statistics FID
compares (an `.npz` of `mu` and `sigma`, as pytorch-fid and U-ViT store them, or cached from a folder of real images)
and the Fréchet distance. The arithmetic is here, not torchmetrics' (whose metric takes images, not the features a
resumed evaluation keeps): the same numbers, and exact for singular covariances."""

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..worlds import WORLDS, load


INCEPTION, SHAPES, EMOJI = "inception", "shapes", "emoji"
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".bmp"}


@dataclass
class FIDStatistics:
    """The (D,) mean `mu` and (D, D) unbiased covariance `sigma` (float64) of image features, and where known their
    number and network."""

    mu: np.ndarray
    sigma: np.ndarray
    num_images: int | None = None
    extractor: str | None = None

    def save(self, path: str | os.PathLike) -> None:
        """Write an `.npz` of `mu` and `sigma` (and `num_images`, `extractor` when known) atomically."""
        from ..durable import write_durably

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        extra = {"num_images": np.int64(self.num_images)} if self.num_images is not None else {}
        if self.extractor is not None:
            extra["extractor"] = np.str_(self.extractor)
        write_durably(path, lambda f: np.savez(f, mu=self.mu, sigma=self.sigma, **extra))

    @classmethod
    def load(cls, path: str | os.PathLike) -> "FIDStatistics":
        """Read an `.npz` of `mu` and `sigma`, never unpickling; `ValueError` for a missing or malformed file."""
        where = f"FID reference statistics {path}"
        try:
            with np.load(path, allow_pickle=False) as data:
                arrays = {key: data[key] for key in data.files}
        except FileNotFoundError:
            raise ValueError(f"{where}: no such file") from None
        except (OSError, ValueError) as error:
            raise ValueError(f"{where} is not an .npz of arrays: {error}") from None
        if missing := {"mu", "sigma"} - arrays.keys():
            raise ValueError(f"{where} lacks {sorted(missing)}; it has {sorted(arrays)}")
        mu, sigma = arrays["mu"].astype(np.float64), arrays["sigma"].astype(np.float64)
        if mu.ndim != 1 or sigma.shape != (mu.size, mu.size):
            raise ValueError(f"{where}: `mu` must be (D,) and `sigma` (D, D); got {mu.shape} and {sigma.shape}")
        if not (np.isfinite(mu).all() and np.isfinite(sigma).all()):
            raise ValueError(f"{where} holds NaN or inf")
        eigenvalues = np.linalg.eigvalsh((sigma + sigma.T) / 2)
        if not np.allclose(sigma, sigma.T) or eigenvalues.min() < -1e-6 * max(1.0, np.abs(eigenvalues).max()):
            raise ValueError(f"{where}: `sigma` is not a covariance (symmetric and positive semi-definite)")
        num_images = int(arrays["num_images"]) if "num_images" in arrays else None
        return cls(mu, sigma, num_images, str(arrays["extractor"]) if "extractor" in arrays else None)


class FeatureMoments:
    """Running float64 sums of D-wide features, giving their mean and covariance; they add up across processes."""

    def __init__(self, num_features: int):
        self.count = torch.zeros((), dtype=torch.float64)
        self.total = torch.zeros(num_features, dtype=torch.float64)  # (D,)
        self.outer = torch.zeros(num_features, num_features, dtype=torch.float64)  # (D, D)

    def update(self, features: torch.Tensor) -> None:
        """Add a (B, D) batch of features."""
        if features.ndim != 2 or features.shape[1] != self.total.numel():
            raise ValueError(
                f"The feature network returned {tuple(features.shape)}; expected (batch, {self.total.numel()})"
            )
        if not torch.isfinite(features).all():
            raise FloatingPointError("The feature network returned NaN or inf features")
        features = features.detach().to("cpu", torch.float64)
        self.count += features.shape[0]
        self.total += features.sum(0)
        self.outer += features.T @ features

    def reduce(self, device: torch.device) -> None:
        """Sum the moments of every process in place, when several run (`device`: the process group's)."""
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return
        state = torch.cat([self.count[None], self.total, self.outer.flatten()]).to(device)
        torch.distributed.all_reduce(state)
        d = self.total.numel()
        self.count, self.total, self.outer = state[0].cpu(), state[1 : 1 + d].cpu(), state[1 + d :].view(d, d).cpu()

    def statistics(self, extractor: str | None = None) -> FIDStatistics:
        """The mean and unbiased covariance of every feature added, recording the feature network's name."""
        count = int(self.count.item())
        if count < 2:
            raise ValueError(f"FID needs at least 2 images; got {count}")
        mu = self.total / count
        sigma = (self.outer - count * torch.outer(mu, mu)) / (count - 1)
        return FIDStatistics(mu.numpy(), sigma.numpy(), count, extractor)


def frechet_distance(first: FIDStatistics, second: FIDStatistics) -> float:
    """‖μ₁ − μ₂‖² + tr(Σ₁ + Σ₂ − 2 (Σ₁ Σ₂)^½), the FID of two Gaussian fits of the same feature size; the trace term
    is Σ √λ over the eigenvalues of the symmetric Σ₁^½ Σ₂ Σ₁^½ (no `sqrtm` offset for singular covariances)."""
    if first.mu.shape != second.mu.shape:
        raise ValueError(f"FID compares features of one network, but these statistics have {first.mu.size} and "
                         f"{second.mu.size} features ({first.extractor} and {second.extractor})")  # fmt: skip
    values, vectors = np.linalg.eigh(first.sigma)
    root = (vectors * np.sqrt(np.clip(values, 0.0, None))) @ vectors.T  # Σ₁^½, (D, D)
    trace_root = np.sqrt(np.clip(np.linalg.eigvalsh(root @ second.sigma @ root), 0.0, None)).sum()
    difference = first.mu - second.mu
    return float(difference @ difference + np.trace(first.sigma) + np.trace(second.sigma) - 2.0 * trace_root)


class InceptionFeatures(nn.Module):
    """The papers' FID Inception network (2048-d pool features) as torch-fidelity runs it: uint8 input and a
    TensorFlow-1-compatible resize to 299 × 299. `weights_path`: a local copy of the weights, else downloaded."""

    num_features = 2048
    name = "inception-v3-compat (torch-fidelity, pt_inception-2015-12-05)"

    def __init__(self, weights_path: str | None = None):
        super().__init__()
        try:
            from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3
        except ImportError:
            raise ImportError("FID with the Inception network needs torch-fidelity: `pip install torch-fidelity`, "
                              "or pass another feature network") from None  # fmt: skip
        try:
            self.network = FeatureExtractorInceptionV3("inception-v3-compat", ["2048"], weights_path)
        except OSError as error:  # includes urllib's URLError: no internet and no cached weights
            raise OSError(f"Could not load the FID Inception weights ({error}): copy pt_inception-2015-12-05-6726825d"
                          ".pth into torch's hub cache, or pass it as `weights_path`.") from None  # fmt: skip
        self.network.eval()

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """The (B, 2048) pool features of (B, 3, H, W) images in [0, 1]."""
        (features,) = self.network((images.clamp(0, 1) * 255).round().to(torch.uint8))  # exact for 8-bit images
        return features


def load_extractor(extractor: str | nn.Module) -> nn.Module:
    """The feature network `"inception"`, `"shapes"` or `"emoji"`, or a module as is (in eval mode)."""
    if isinstance(extractor, nn.Module):
        return extractor.eval()
    if extractor == INCEPTION:
        return InceptionFeatures()
    if extractor in WORLDS:  # a world's own network (Inception has never seen its images)
        return load(WORLDS[extractor].fid_features)()
    raise ValueError(
        f"Unknown FID feature network {extractor!r}: use {INCEPTION!r}, {SHAPES!r}, {EMOJI!r} or a module"
    )


def extractor_name(extractor: nn.Module) -> str:
    return str(getattr(extractor, "name", type(extractor).__name__))


def feature_size(extractor: nn.Module, resolution: int) -> int:
    """D: the network's int `num_features`, else the width of its output for one black image."""
    if isinstance(getattr(extractor, "num_features", None), int):
        return extractor.num_features
    return image_features(extractor, torch.zeros(1, 3, resolution, resolution)).shape[1]


@torch.no_grad()
def image_features(extractor: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """(B, D) float32 CPU features of (B, 3, H, W) images in [0, 1], run on the network's device."""
    parameter = next(extractor.parameters(), None)
    features = extractor(images.to(parameter.device if parameter is not None else images.device))
    if not isinstance(features, torch.Tensor) or features.ndim != 2 or features.shape[0] != images.shape[0]:
        shape = tuple(features.shape) if isinstance(features, torch.Tensor) else type(features).__name__
        raise ValueError(f"The FID feature network {extractor_name(extractor)} returned {shape} for "
                         f"{images.shape[0]} images, not a (batch, features) tensor")  # fmt: skip
    return features.float().cpu()


def reference_statistics(
    reference, extractor, resolution: int, *, processes, cache_dir=None, batch_size: int = 50, progress: bool = True
) -> FIDStatistics:
    """The statistics FID compares with (`FIDStatistics`, an `.npz`, or a folder of real images resized to
    `resolution`, cached under `cache_dir`), refused unless they match the feature network `extractor`."""
    name = extractor_name(extractor)
    if isinstance(reference, FIDStatistics):
        statistics, source = reference, "the given statistics"
    elif (source := Path(reference)).is_dir():
        statistics = folder_statistics(source, extractor, resolution, processes, cache_dir, batch_size, progress)
    else:
        statistics = FIDStatistics.load(source)
    if statistics.extractor is not None and statistics.extractor != name:
        raise ValueError(f"FID reference {source} was computed with {statistics.extractor}, not {name}: recompute it "
                         "with this network or pass the matching one")  # fmt: skip
    if statistics.mu.size != (num_features := feature_size(extractor, resolution)):
        raise ValueError(f"FID reference {source} holds {statistics.mu.size}-d statistics, but {name} gives "
                         f"{num_features}-d features: the reference must come from the same network")  # fmt: skip
    return statistics


def folder_statistics(folder: Path, extractor, resolution, processes, cache_dir, batch_size, progress):
    """The statistics of every image under `folder`, cached by network, resolution and each file's size and time."""
    from huggingface_hub import constants
    from PIL import Image, UnidentifiedImageError

    from ..image_tensors import center_crop_resize, images_to_tensor
    from ..progress import progress_bar

    files = sorted(path for path in folder.rglob("*") if path.suffix.lower() in IMAGE_SUFFIXES and path.is_file())
    if len(files) < 2:
        raise ValueError(f"FID reference folder {folder} holds {len(files)} image(s) "
                         f"({', '.join(sorted(IMAGE_SUFFIXES))}); FID needs many real images")  # fmt: skip
    name = extractor_name(extractor)
    listing = [(str(path.relative_to(folder)), path.stat().st_size, path.stat().st_mtime_ns) for path in files]
    key = hashlib.sha256(json.dumps([name, resolution, listing]).encode()).hexdigest()[:16]
    cache_dir = cache_dir or Path(constants.HF_HOME) / "diffusers_lmlp" / "fid_stats"
    cache = Path(cache_dir) / f"{folder.resolve().name}-{resolution}px-{key}.npz"
    if cache.is_file():
        return FIDStatistics.load(cache)
    moments = FeatureMoments(feature_size(extractor, resolution))
    with progress_bar(len(files), "reference", unit="img", disable=not progress or processes.index != 0) as bar:
        for batch in processes.batches(len(files), batch_size):
            images = []
            for i in batch:
                try:
                    with Image.open(files[i]) as image:
                        images.append(center_crop_resize(image, resolution))
                except (UnidentifiedImageError, OSError) as error:
                    raise ValueError(f"FID reference folder: cannot read {files[i]} as an image ({error})") from None
            moments.update(image_features(extractor, images_to_tensor(images)))
            bar.update(min(len(batch) * processes.count, bar.total - bar.n))
    moments.reduce(processes.device)
    statistics = moments.statistics(name)
    if processes.index == 0:
        statistics.save(cache)
    processes.wait()
    return statistics
