"""The shapes world's FID feature network (Inception has never seen its images): a small CNN trained by
`scripts/train_shapes_features.py` to read every attribute of a render. Two coordinate channels let the position
survive the global pooling; strided stages let the last one see a whole large shape.
"""

from pathlib import Path

import torch
import torch.nn.functional as F
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from torch import nn

from .world import COLOURS, IMAGE_SIZE, POSITIONS, SHAPES, SIZES


FEATURES_PATH = Path(__file__).resolve().parent / "assets" / "features"
ATTRIBUTES = {"size": SIZES, "colour": tuple(COLOURS), "shape": SHAPES, "position": POSITIONS}
PIXEL_MEAN, PIXEL_STD = 0.5, 0.25  # inputs in [0, 1] → roughly [-2, 2]


class ShapesFeatureNetwork(ModelMixin, ConfigMixin):
    """A CNN whose pooled activations are the shapes world's FID features, with a head per attribute: 3×3 conv stages
    of `channels` (each after the first halves the resolution), then a 1×1 conv to `num_features`, with GroupNorms of
    `norm_num_groups`; inputs are resized to `image_size`."""

    name = "shapes-features"

    @register_to_config
    def __init__(
        self,
        channels: tuple[int, ...] = (32, 48, 64, 96),
        num_features: int = 128,
        norm_num_groups: int = 8,
        image_size: int = IMAGE_SIZE,
    ):
        super().__init__()

        def conv_block(c_in: int, c_out: int, kernel_size: int, stride: int) -> nn.Sequential:
            conv = nn.Conv2d(c_in, c_out, kernel_size, stride=stride, padding=kernel_size // 2)  # same padding
            return nn.Sequential(conv, nn.GroupNorm(norm_num_groups, c_out), nn.ReLU())

        in_channels = [3 + 2, *channels[:-1]]  # RGB + (x, y) coordinates
        stages = [conv_block(c, d, 3, 2 if i else 1) for i, (c, d) in enumerate(zip(in_channels, channels))]
        self.stages = nn.Sequential(*stages, conv_block(channels[-1], num_features, 1, 1))
        self.heads = nn.ModuleDict({name: nn.Linear(num_features, len(values)) for name, values in ATTRIBUTES.items()})
        coordinates = torch.linspace(-1.0, 1.0, image_size)
        grid = torch.stack(torch.meshgrid(coordinates, coordinates, indexing="xy"))  # (2, S, S): x, then y
        self.register_buffer("coordinates", grid, persistent=False)

    @property
    def num_features(self) -> int:
        return self.config.num_features

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """The (B, num_features) non-negative pooled features of (B, 3, H, W) images in [0, 1]."""
        is_tensor = isinstance(images, torch.Tensor)
        if not is_tensor or not images.is_floating_point() or images.ndim != 4 or images.shape[1] != 3:
            got = f"{images.dtype} of shape {tuple(images.shape)}" if is_tensor else type(images).__name__
            raise ValueError(f"{self.name} expects a float tensor of shape (B, 3, H, W) in [0, 1], got {got}.")
        size = self.config.image_size
        images = images.to(self.coordinates.dtype)
        if images.shape[-2:] != (size, size):
            images = F.interpolate(images, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
        coordinates = self.coordinates.expand(len(images), -1, -1, -1)  # (B, 2, S, S)
        hidden = torch.cat([(images - PIXEL_MEAN) / PIXEL_STD, coordinates], dim=1)  # (B, 5, S, S)
        hidden = self.stages(hidden)  # (B, num_features, S / 8, S / 8) with 4 stages
        return hidden.mean(dim=(2, 3))  # (B, num_features)

    def classify(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        """The (B, num_values) logits of each attribute of `ATTRIBUTES`, in order."""
        features = self(images)  # (B, num_features)
        return {name: head(features) for name, head in self.heads.items()}


def pretrained_shapes_features(**kwargs) -> ShapesFeatureNetwork:
    """The trained feature network shipped in the package, in eval mode (`kwargs`: `from_pretrained`'s)."""
    return ShapesFeatureNetwork.from_pretrained(FEATURES_PATH, **kwargs).eval()
