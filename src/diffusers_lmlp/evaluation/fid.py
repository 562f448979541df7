"""FID: the Fréchet distance between Gaussian fits of image features, and the statistics it compares, stored as
pytorch-fid and U-ViT store them (an `.npz` of `mu` and `sigma`)."""

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch


@dataclass
class FIDStatistics:
    """The (D,) mean `mu` and (D, D) unbiased covariance `sigma` (float64) of a set of image features, with the
    number of images and the feature network's name when known."""

    mu: np.ndarray
    sigma: np.ndarray
    num_images: int | None = None
    extractor: str | None = None

    def save(self, path: str | os.PathLike) -> None:
        """Write an `.npz` of `mu` and `sigma` (and `num_images`, `extractor` when known) atomically."""
        from .resume import write_durably

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        extra = {"num_images": np.int64(self.num_images)} if self.num_images is not None else {}
        if self.extractor is not None:
            extra["extractor"] = np.str_(self.extractor)
        write_durably(path, lambda f: np.savez(f, mu=self.mu, sigma=self.sigma, **extra))

    @classmethod
    def load(cls, path: str | os.PathLike) -> "FIDStatistics":
        """Read an `.npz` of `mu` and `sigma`, never unpickling; `ValueError` for a missing or malformed file."""
        try:
            with np.load(path, allow_pickle=False) as data:
                arrays = {key: data[key] for key in data.files}
        except FileNotFoundError:
            raise ValueError(f"FID reference statistics {path}: no such file") from None
        except (OSError, ValueError) as error:
            raise ValueError(f"FID reference statistics {path} is not an .npz of arrays: {error}") from None
        if missing := {"mu", "sigma"} - arrays.keys():
            raise ValueError(f"FID reference statistics {path} lacks {sorted(missing)}; it has {sorted(arrays)}")
        mu, sigma = arrays["mu"].astype(np.float64), arrays["sigma"].astype(np.float64)
        if mu.ndim != 1 or sigma.shape != (mu.size, mu.size):
            raise ValueError(f"FID reference statistics {path}: `mu` must be (D,) and `sigma` (D, D); got {mu.shape} "
                             f"and {sigma.shape}")  # fmt: skip
        if not (np.isfinite(mu).all() and np.isfinite(sigma).all()):
            raise ValueError(f"FID reference statistics {path} holds NaN or inf")
        eigenvalues = np.linalg.eigvalsh((sigma + sigma.T) / 2)
        if not np.allclose(sigma, sigma.T) or eigenvalues.min() < -1e-6 * max(1.0, np.abs(eigenvalues).max()):
            raise ValueError(f"FID reference statistics {path}: `sigma` is not a covariance (symmetric and positive "
                             "semi-definite)")  # fmt: skip
        num_images = int(arrays["num_images"]) if "num_images" in arrays else None
        extractor = str(arrays["extractor"]) if "extractor" in arrays else None
        return cls(mu, sigma, num_images, extractor)


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
        state = torch.cat([self.count[None], self.total, self.outer.flatten()])
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            state = state.to(device)
            torch.distributed.all_reduce(state)
            state = state.cpu()
        num_features = self.total.numel()
        self.count, self.total = state[0], state[1 : 1 + num_features]
        self.outer = state[1 + num_features :].view(num_features, num_features)

    def statistics(self, extractor: str | None = None) -> FIDStatistics:
        """The mean and unbiased covariance of every feature added, recording the feature network's name."""
        count = int(self.count.item())
        if count < 2:
            raise ValueError(f"FID needs at least 2 images; got {count}")
        mu = self.total / count
        sigma = (self.outer - count * torch.outer(mu, mu)) / (count - 1)
        return FIDStatistics(mu.numpy(), sigma.numpy(), count, extractor)


def frechet_distance(first: FIDStatistics, second: FIDStatistics) -> float:
    """‖μ₁ − μ₂‖² + tr(Σ₁ + Σ₂ − 2 (Σ₁ Σ₂)^½), the FID of two Gaussian fits of the same feature size.

    The trace term is Σ √λ over the eigenvalues of the symmetric Σ₁^½ Σ₂ Σ₁^½, exact even for singular covariances
    (fewer images than features), where pytorch-fid's `sqrtm` needs an offset.
    """
    if first.mu.shape != second.mu.shape:
        raise ValueError(f"FID compares features of one network, but these statistics have {first.mu.size} and "
                         f"{second.mu.size} features ({first.extractor} and {second.extractor})")  # fmt: skip
    values, vectors = np.linalg.eigh(first.sigma)
    root = (vectors * np.sqrt(np.clip(values, 0.0, None))) @ vectors.T  # Σ₁^½, (D, D)
    product = np.linalg.eigvalsh(root @ second.sigma @ root)
    trace_root = np.sqrt(np.clip(product, 0.0, None)).sum()
    difference = first.mu - second.mu
    return float(difference @ difference + np.trace(first.sigma) + np.trace(second.sigma) - 2.0 * trace_root)
