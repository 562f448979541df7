"""The shapes world's FID feature network: the role Inception plays for photos, which it has never seen.

A small CNN, trained by `scripts/train_shapes_features.py` to read every attribute of a render (size, colour, shape,
position), so its pooled features measure what the world's images are made of. Two coordinate channels let the
position survive the global pooling; strided stages let the last one see a whole large shape.
"""

from pathlib import Path

import torch
import torch.nn.functional as F
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from torch import nn

from ..shapes.world import COLOURS, IMAGE_SIZE, POSITIONS, SHAPES, SIZES


FEATURES_PATH = Path(__file__).resolve().parent.parent / "shapes" / "assets" / "features"
# Each classification head: attribute → its values, in label order.
ATTRIBUTES: dict[str, tuple[str, ...]] = {
    "size": SIZES,
    "colour": tuple(COLOURS),
    "shape": SHAPES,
    "position": POSITIONS,
}
PIXEL_MEAN, PIXEL_STD = 0.5, 0.25  # inputs in [0, 1] → roughly [-2, 2]


def conv_block(in_channels: int, out_channels: int, kernel_size: int, stride: int, groups: int) -> nn.Sequential:
    """Conv (same padding) → GroupNorm → ReLU."""
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, kernel_size, stride=stride, padding=kernel_size // 2),
        nn.GroupNorm(groups, out_channels),
        nn.ReLU(),
    )


class ShapesFeatureNetwork(ModelMixin, ConfigMixin):
    """A CNN whose pooled activations are the shapes world's FID features, with heads that read each attribute.

    Args:
        channels (`tuple[int, ...]`, *optional*, defaults to `(32, 48, 64, 96)`): The 3×3 conv stages' channels;
            each after the first halves the resolution.
        num_features (`int`, *optional*, defaults to 128): Size of the feature vector (the 1×1 conv's channels).
        norm_num_groups (`int`, *optional*, defaults to 8): Groups of every GroupNorm.
        image_size (`int`, *optional*, defaults to `IMAGE_SIZE`): Side the network reads; other inputs are resized.
    """

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
        in_channels = [3 + 2, *channels[:-1]]  # RGB + (x, y) coordinates
        self.stages = nn.Sequential(
            *(
                conv_block(c_in, c_out, 3, stride=1 if i == 0 else 2, groups=norm_num_groups)
                for i, (c_in, c_out) in enumerate(zip(in_channels, channels))
            ),
            conv_block(channels[-1], num_features, 1, stride=1, groups=norm_num_groups),
        )
        self.heads = nn.ModuleDict({name: nn.Linear(num_features, len(values)) for name, values in ATTRIBUTES.items()})
        coordinates = torch.linspace(-1.0, 1.0, image_size)
        grid = torch.stack(torch.meshgrid(coordinates, coordinates, indexing="xy"))  # (2, S, S): x, then y
        self.register_buffer("coordinates", grid, persistent=False)

    @property
    def num_features(self) -> int:
        """Size of the feature vector that `forward` returns."""
        return self.config.num_features

    def check_images(self, images: torch.Tensor) -> None:
        """Raise a `ValueError` unless `images` is a float (B, 3, H, W) tensor.

        Args:
            images (`torch.Tensor`): The input to check.
        """
        if not isinstance(images, torch.Tensor) or not images.is_floating_point():
            raise ValueError(
                f"{self.name} expects a float tensor of shape (B, 3, H, W) with values in [0, 1], got "
                f"{type(images).__name__}{'' if not isinstance(images, torch.Tensor) else f' of {images.dtype}'}."
            )
        if images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(
                f"{self.name} expects images of shape (B, 3, H, W) with values in [0, 1], got shape "
                f"{tuple(images.shape)}."
            )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """The pooled features FID is computed on.

        Args:
            images (`torch.Tensor`): (B, 3, H, W) in [0, 1]; resized (bilinear) unless `image_size` square.

        Returns:
            `torch.Tensor`: (B, num_features), non-negative.
        """
        self.check_images(images)
        size = self.config.image_size
        images = images.to(self.coordinates.dtype)
        if images.shape[-2:] != (size, size):
            images = F.interpolate(images, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
        coordinates = self.coordinates.expand(len(images), -1, -1, -1)  # (B, 2, S, S)
        hidden = torch.cat([(images - PIXEL_MEAN) / PIXEL_STD, coordinates], dim=1)  # (B, 5, S, S)
        hidden = self.stages(hidden)  # (B, num_features, S / 8, S / 8) with 4 stages
        return hidden.mean(dim=(2, 3))  # (B, num_features)

    def classify(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        """The logits of each attribute.

        Args:
            images (`torch.Tensor`): As for `forward`.

        Returns:
            `dict[str, torch.Tensor]`: (B, num_values) logits per attribute, in the order of `ATTRIBUTES`.
        """
        features = self(images)  # (B, num_features)
        return {name: head(features) for name, head in self.heads.items()}


def pretrained_shapes_features(**kwargs) -> ShapesFeatureNetwork:
    """The trained feature network shipped in the package (`shapes/assets/features`), in eval mode.

    Args:
        **kwargs: Passed to `ShapesFeatureNetwork.from_pretrained` (e.g. `torch_dtype`).
    """
    return ShapesFeatureNetwork.from_pretrained(FEATURES_PATH, **kwargs).eval()
