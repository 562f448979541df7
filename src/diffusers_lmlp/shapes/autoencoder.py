"""How well an autoencoder keeps the shapes world: the scorer's accuracies on reconstructions of ground-truth
renders, and the PSNR over all pixels and over the shape's own (the background hides a rounded square)."""

import numpy as np
import torch
from diffusers import AutoencoderKL
from diffusers.image_processor import VaeImageProcessor
from PIL import Image

from ..image_tensors import images_to_tensor
from .scorer import score_images
from .world import BACKGROUND, held_out_specs, render


FOREGROUND_LEVELS = 2  # a foreground pixel differs from the background by more (8-bit levels) in some channel


def to_pixels(images: list[Image.Image]) -> torch.Tensor:
    """RGB images as a float tensor (N, 3, H, W) in [-1, 1], the VAE's input range."""
    return 2 * images_to_tensor(images) - 1


def foreground_mask(pixels: torch.Tensor) -> torch.Tensor:
    """Where ground-truth renders (N, 3, H, W) in [-1, 1] differ from the world's background: (N, 1, H, W) bool."""
    background = torch.tensor(BACKGROUND, dtype=pixels.dtype).view(1, 3, 1, 1) / 127.5 - 1.0
    return (pixels - background).abs().amax(dim=1, keepdim=True) > FOREGROUND_LEVELS / 127.5


@torch.no_grad()
def reconstruct(vae: AutoencoderKL, pixels: torch.Tensor, batch_size: int = 256) -> torch.Tensor:
    """Encode to the posterior mode and decode: (N, 3, H, W) in [-1, 1] -> (N, 3, H, W) clamped to [-1, 1]."""
    parameter = next(vae.parameters())
    latents = (vae.encode(batch.to(parameter)).latent_dist.mode() for batch in pixels.split(batch_size))
    return torch.cat([vae.decode(batch).sample.float().cpu().clamp(-1, 1) for batch in latents])


def psnr(reconstruction: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """Mean per-image PSNR in dB of images in [-1, 1], over all pixels or over a mask (N, 1, H, W) of them."""
    error = ((reconstruction - target) / 2).pow(2)  # (N, 3, H, W), in [0, 1]² units
    if mask is None:
        mse = error.mean(dim=(1, 2, 3))
    else:
        mse = (error * mask).sum(dim=(1, 2, 3)) / (3 * mask.sum(dim=(1, 2, 3)).clamp(min=1))
    return (10 * torch.log10(1 / mse.clamp(min=1e-10))).mean().item()


def held_out_renders(num_per_spec: int = 25, seed: int = 0) -> tuple[list[Image.Image], list[str]]:
    """`(images, captions)`: `num_per_spec` seeded, jittered renders of every held-out combination."""
    rng = np.random.default_rng([seed, 7])
    specs = [spec for spec in held_out_specs() for _ in range(num_per_spec)]
    return [render(spec, rng=rng) for spec in specs], [spec.caption for spec in specs]


def reconstruction_report(vae: AutoencoderKL, images: list[Image.Image], captions: list[str]) -> dict[str, float]:
    """The scorer's accuracies on an autoencoder's reconstructions of renders, "ground truth all" on the renders,
    and "psnr" and "foreground psnr" in dB."""
    target = to_pixels(images)  # (N, 3, H, W)
    reconstruction = reconstruct(vae, target)
    report = score_images(VaeImageProcessor().postprocess(reconstruction, output_type="pil"), captions)
    report["ground truth all"] = score_images(images, captions)["all"]
    report["psnr"] = psnr(reconstruction, target)
    report["foreground psnr"] = psnr(reconstruction, target, foreground_mask(target))
    return report
