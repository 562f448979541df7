#!/usr/bin/env python
"""Train the small AutoencoderKL of the shapes world, reproducibly, and save it into the package.

    python scripts/train_shapes_vae.py                      # writes ./shapes-vae

The package's VAE (`src/diffusers_lmlp/shapes/assets/pipeline/vae`) was made by this command with the defaults:
681,911 parameters, held-out PSNR 36.64 dB, scaling_factor 0.64161, 401 s on 2 CPU cores. A new VAE changes the
latents, so the shipped pipeline must then be retrained on it.

The VAE maps 32×32 RGB images to 8×8×4 latents (factor 4). Loss: L1 + MSE reconstruction plus a small KL term.
After training, `scaling_factor` is set to 1 / std of the training latents (how U-ViT derived COCO's 0.23010), and
the held-out reconstruction PSNR is printed.
"""

import argparse
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL
from tqdm.auto import tqdm

from diffusers_lmlp.shapes.world import IMAGE_SIZE, make_dataset


def to_pixels(dataset) -> torch.Tensor:
    """(N, 3, H, W) in [-1, 1]."""
    arrays = np.stack([np.asarray(image, dtype=np.float32) for image in dataset["image"]])  # (N, H, W, 3)
    return torch.from_numpy(arrays / 127.5 - 1.0).permute(0, 3, 1, 2).contiguous()


@torch.no_grad()
def psnr(vae: AutoencoderKL, pixels: torch.Tensor) -> float:
    """Mean reconstruction PSNR in dB of images in [-1, 1], decoding the posterior mode."""
    values = []
    for batch in pixels.split(256):
        recon = vae.decode(vae.encode(batch).latent_dist.mode()).sample.clamp(-1, 1)
        mse = ((recon - batch) / 2).pow(2).mean(dim=(1, 2, 3))
        values.append(10 * torch.log10(1 / mse))
    return torch.cat(values).mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=900)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--kl-weight", type=float, default=1e-4)
    parser.add_argument("--num-images", type=int, default=4000)
    parser.add_argument("--output-dir", type=Path, default=Path("shapes-vae"))
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    train = to_pixels(make_dataset("train", num_images=args.num_images, seed=args.seed))
    held_out = to_pixels(make_dataset("heldout", seed=args.seed + 1))
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(16, 32, 64),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=8,
        sample_size=IMAGE_SIZE,
    )
    optimizer = torch.optim.AdamW(vae.parameters(), lr=args.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=args.steps, pct_start=0.05)
    generator = torch.Generator().manual_seed(args.seed)
    start = time.perf_counter()
    for _ in (progress := tqdm(range(args.steps), desc="training the shapes VAE")):
        batch = train[torch.randint(0, len(train), (args.batch_size,), generator=generator)]  # (b, 3, H, W)
        posterior = vae.encode(batch).latent_dist
        recon = vae.decode(posterior.sample(generator=generator)).sample
        kl = posterior.kl().mean() / batch[0].numel()
        loss = F.l1_loss(recon, batch) + F.mse_loss(recon, batch) + args.kl_weight * kl
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        progress.set_postfix(loss=f"{loss.item():.4f}")

    vae.eval()
    with torch.no_grad():
        latents = torch.cat([vae.encode(batch).latent_dist.mode() for batch in train.split(256)])  # (N, 4, h, w)
    vae.register_to_config(scaling_factor=round(1.0 / latents.std().item(), 5))
    vae.save_pretrained(args.output_dir)
    print(
        f"saved {args.output_dir}: {sum(p.numel() for p in vae.parameters()):,} parameters, latents "
        f"{tuple(latents.shape[1:])}, scaling_factor {vae.config.scaling_factor}, held-out PSNR "
        f"{psnr(vae, held_out):.2f} dB, {time.perf_counter() - start:.0f} s"
    )


if __name__ == "__main__":
    main()
