#!/usr/bin/env python
"""Train the small AutoencoderKL of the shapes world, reproducibly, and save it into the package.

    python scripts/train_shapes_vae.py                      # writes ./shapes-vae

The VAE maps 32×32 RGB images to 8×8×8 latents (factor 4). The background fills most of every image, so a plain
pixel loss is satisfied by blobs; the loss here weighs the shape: L1 + MSE with the pixels of (and next to) the
shape weighted `--foreground-weight` times, an L1 term on the image gradients (the edges that tell a square from a
circle), and a small KL term. After training, `scaling_factor` is set to 1 / std of the training latents (how U-ViT
derived COCO's 0.23010), and the reconstructions of held-out renders are scored by the world's scorer.

A new VAE changes the latents, so the shipped pipeline must then be retrained on it.
"""

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL
from tqdm.auto import tqdm

from diffusers_lmlp.shapes.autoencoder import foreground_mask, held_out_renders, reconstruction_report, to_pixels
from diffusers_lmlp.shapes.world import IMAGE_SIZE, make_dataset


def image_gradients(pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Horizontal and vertical differences of (N, C, H, W) images: (N, C, H, W-1) and (N, C, H-1, W)."""
    return pixels[..., :, 1:] - pixels[..., :, :-1], pixels[..., 1:, :] - pixels[..., :-1, :]


def reconstruction_loss(recon: torch.Tensor, target: torch.Tensor, foreground_weight: float, edge_weight: float):
    """L1 + MSE weighted towards the shape, plus L1 on the image gradients; images (N, 3, H, W) in [-1, 1]."""
    near_shape = F.max_pool2d(foreground_mask(target).float(), 3, stride=1, padding=1)  # (N, 1, H, W), dilated 1 px
    weight = 1 + foreground_weight * near_shape
    pixel = (weight * ((recon - target).abs() + (recon - target).pow(2))).mean() / weight.mean()
    edges = sum(F.l1_loss(r, t) for r, t in zip(image_gradients(recon), image_gradients(target)))
    return pixel + edge_weight * edges


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--kl-weight", type=float, default=1e-4)
    parser.add_argument("--foreground-weight", type=float, default=20.0)
    parser.add_argument("--edge-weight", type=float, default=1.0)
    parser.add_argument("--latent-channels", type=int, default=8)
    parser.add_argument("--block-out-channels", type=int, nargs="+", default=(16, 32, 64))
    parser.add_argument("--num-images", type=int, default=4000)
    parser.add_argument("--output-dir", type=Path, default=Path("shapes-vae"))
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    train = to_pixels(make_dataset("train", num_images=args.num_images, seed=args.seed)["image"])
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * len(args.block_out_channels),
        up_block_types=("UpDecoderBlock2D",) * len(args.block_out_channels),
        block_out_channels=tuple(args.block_out_channels),
        layers_per_block=1,
        latent_channels=args.latent_channels,
        norm_num_groups=8,
        mid_block_add_attention=False,  # the images hold one shape: convolutions see enough of it
        sample_size=IMAGE_SIZE,
    )
    optimizer = torch.optim.AdamW(vae.parameters(), lr=args.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=args.steps, pct_start=0.05)
    generator = torch.Generator().manual_seed(args.seed)
    start = time.perf_counter()
    for _ in (progress := tqdm(range(args.steps), desc="training the shapes VAE", mininterval=10)):
        batch = train[torch.randint(0, len(train), (args.batch_size,), generator=generator)]  # (b, 3, H, W)
        posterior = vae.encode(batch).latent_dist
        recon = vae.decode(posterior.sample(generator=generator)).sample
        kl = posterior.kl().mean() / batch[0].numel()
        loss = reconstruction_loss(recon, batch, args.foreground_weight, args.edge_weight) + args.kl_weight * kl
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        progress.set_postfix(loss=f"{loss.item():.4f}", refresh=False)
    seconds = time.perf_counter() - start

    vae.eval()
    with torch.no_grad():
        latents = torch.cat([vae.encode(batch).latent_dist.mode() for batch in train.split(256)])  # (N, C, h, w)
    vae.register_to_config(scaling_factor=round(1.0 / latents.std().item(), 5))
    vae.save_pretrained(args.output_dir)
    report = reconstruction_report(vae, *held_out_renders())
    print(
        f"saved {args.output_dir}: {sum(p.numel() for p in vae.parameters()):,} parameters, latents "
        f"{tuple(latents.shape[1:])}, scaling_factor {vae.config.scaling_factor}, {seconds:.0f} s of training\n"
        f"held-out reconstructions: {json.dumps({k: round(v, 4) for k, v in report.items()})}"
    )


if __name__ == "__main__":
    main()
