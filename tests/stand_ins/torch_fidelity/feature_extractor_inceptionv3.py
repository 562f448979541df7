"""torch-fidelity's `FeatureExtractorInceptionV3` interface, with a fixed random network instead of the Inception
weights (nothing is downloaded): uint8 (B, 3, H, W) images in, a tuple of (B, 2048) features out."""

import torch
import torch.nn.functional as F


class FeatureExtractorInceptionV3(torch.nn.Module):
    def __init__(self, name, features_list, feature_extractor_weights_path=None):
        super().__init__()
        if name != "inception-v3-compat" or features_list != ["2048"]:
            raise ValueError(f"the stand-in only provides inception-v3-compat 2048, not {name} {features_list}")
        generator = torch.Generator().manual_seed(0)
        self.register_buffer("projection", torch.randn(3 * 8 * 8, 2048, generator=generator) / 14)

    def forward(self, x):
        if x.dtype != torch.uint8:
            raise TypeError("Expecting image as torch.Tensor with dtype=torch.uint8")
        pixels = F.interpolate(x.float() / 255, size=(8, 8), mode="bilinear", antialias=True)  # (B, 3, 8, 8)
        return (torch.relu(pixels.flatten(1) @ self.projection),)
