"""Feature networks for FID: (B, 3, H, W) RGB images in [0, 1] to (B, D) features. The standard Inception network,
the shapes and emoji worlds' networks, or any module (without an int `num_features`, D comes from a dummy batch)."""

import torch
from torch import nn


INCEPTION = "inception"
SHAPES = "shapes"
EMOJI = "emoji"


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
            raise ImportError(
                "FID with the standard Inception network needs torch-fidelity (`pip install torch-fidelity`, with the "
                "matching torchvision); or pass another feature network (`fid_extractor=<torch.nn.Module>`)."
            ) from None
        try:
            self.network = FeatureExtractorInceptionV3("inception-v3-compat", ["2048"], weights_path)
        except OSError as error:  # includes urllib's URLError: no internet and no cached weights
            raise OSError(f"Could not load the FID Inception weights ({error}): copy pt_inception-2015-12-05-6726825d"
                          ".pth into torch's hub cache, or pass it as `weights_path`.") from None  # fmt: skip
        self.network.eval()

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """The (B, 2048) pool features of (B, 3, H, W) images in [0, 1]."""
        pixels = (images.clamp(0, 1) * 255).round().to(torch.uint8)  # exact for images that were uint8
        (features,) = self.network(pixels)
        return features


def load_extractor(extractor: str | nn.Module) -> nn.Module:
    """The feature network `"inception"`, `"shapes"` or `"emoji"`, or a module as is (in eval mode)."""
    if isinstance(extractor, nn.Module):
        return extractor.eval()
    if extractor == INCEPTION:
        return InceptionFeatures()
    if extractor == SHAPES:
        from .shapes_features import pretrained_shapes_features

        return pretrained_shapes_features()
    if extractor == EMOJI:
        from ..emoji.scorer import emoji_features

        return emoji_features()
    raise ValueError(
        f"Unknown FID feature network {extractor!r}: use {INCEPTION!r}, {SHAPES!r}, {EMOJI!r} or a module"
    )


def extractor_name(extractor: nn.Module) -> str:
    return str(getattr(extractor, "name", type(extractor).__name__))


def feature_size(extractor: nn.Module, resolution: int) -> int:
    """D: the network's `num_features`, else the width of its output for one black image of the given size."""
    if isinstance(getattr(extractor, "num_features", None), int):
        return extractor.num_features
    return image_features(extractor, torch.zeros(1, 3, resolution, resolution)).shape[1]


@torch.no_grad()
def image_features(extractor: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """(B, D) float32 CPU features of (B, 3, H, W) images in [0, 1], run on the network's device."""
    parameter = next(extractor.parameters(), None)
    device = parameter.device if parameter is not None else images.device
    features = extractor(images.to(device))
    if not isinstance(features, torch.Tensor) or features.ndim != 2 or features.shape[0] != images.shape[0]:
        shape = tuple(features.shape) if isinstance(features, torch.Tensor) else type(features).__name__
        raise ValueError(f"The FID feature network {extractor_name(extractor)} returned {shape} for "
                         f"{images.shape[0]} images, not a (batch, features) tensor")  # fmt: skip
    return features.float().cpu()
