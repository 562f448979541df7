"""PIL images as the float batches that feature networks and autoencoders read, and the reference's square crop."""

import numpy as np
import torch
from PIL import Image


def images_to_tensor(images: list[Image.Image]) -> torch.Tensor:
    """Images of one size (any mode) → an RGB (B, 3, H, W) float32 batch in [0, 1]."""
    sizes = {image.size for image in images}
    if len(sizes) != 1:
        raise ValueError(f"The images of one batch must have one size; got {sorted(sizes)}")
    pixels = np.stack([np.asarray(image.convert("RGB"), dtype=np.float32) for image in images]) / 255.0
    return torch.from_numpy(pixels).permute(0, 3, 1, 2).contiguous()  # (B, 3, H, W)


def center_crop_resize(image: Image.Image, resolution: int) -> Image.Image:
    """Centre-crop to a square on the short side and resize to `resolution` with Lanczos, as U-ViT prepares COCO."""
    image = image.convert("RGB")
    side = min(image.size)
    left, top = (image.width - side) // 2, (image.height - side) // 2
    return image.crop((left, top, left + side, top + side)).resize((resolution, resolution), Image.Resampling.LANCZOS)
