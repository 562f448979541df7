#!/usr/bin/env python
"""Train the small AutoencoderKL of a world (`--world shapes` or `emoji`), reproducibly, and save it.

    python scripts/train_vae.py                                  # the shapes world's, into ./shapes-vae
    python scripts/train_vae.py --world emoji --output-dir emoji-vae

The VAE maps 32×32 RGB images to 8×8 latents (factor 4). The background fills much of every image, so a plain pixel
loss is satisfied by blobs; the loss here weighs what is drawn: L1 + MSE with the pixels that differ from the
world's background (and those next to them) weighted `--foreground-weight` times, an L1 term on the image gradients
(the edges that tell a square from a circle), and a small KL term. After training, `scaling_factor` is set to 1 / std
of the training latents (how U-ViT derived COCO's 0.23010), and the reconstructions are scored as the world scores
samples: the shapes scorer on held-out renders, or for the emoji world the nearest of all its pictures, by the
emoji CLIP's image tower and by pixels, for the pictures of each split. The emoji VAE sees only training pictures.

A new VAE changes the latents, so the shipped pipeline must then be retrained on it.

The second stage fine-tunes only the decoder of a saved VAE, on its posterior samples with Gaussian noise of a
standard deviation drawn per image from U(0, `--latent-noise`), in units of the scaled latents (the backbone's):

    python scripts/train_vae.py --decoder-from shapes-vae --latent-noise 0.4 --steps 600 --lr 5e-4

A diffusion model's samples land near the latents of sharp images, not on them, and a decoder trained on exact
latents only draws such a near miss softer (a square's corners rounder). The encoder, the latents and
`scaling_factor` stay as they were, so a pipeline trained on the VAE keeps its backbone.
"""

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL
from tqdm.auto import tqdm

from diffusers_lmlp.shapes.autoencoder import held_out_renders, reconstruction_report, to_pixels
from diffusers_lmlp.shapes.world import BACKGROUND, IMAGE_SIZE, make_dataset
from diffusers_lmlp.training.step import non_finite_parameters


def image_gradients(pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Horizontal and vertical differences of (N, C, H, W) images: (N, C, H, W-1) and (N, C, H-1, W)."""
    return pixels[..., :, 1:] - pixels[..., :, :-1], pixels[..., 1:, :] - pixels[..., :-1, :]


def world_data(args: argparse.Namespace) -> tuple[torch.Tensor, tuple[int, int, int], object]:
    """The world's training pictures (N, 3, 32, 32) in [-1, 1], its background colour, and the report of a VAE's
    reconstructions."""
    if args.world == "shapes":
        images = make_dataset("train", num_images=args.num_images, seed=args.seed)["image"]
        return to_pixels(images), BACKGROUND, lambda vae: reconstruction_report(vae, *held_out_renders())
    from diffusers_lmlp.emoji.scorer import EmojiScorer
    from diffusers_lmlp.emoji.scorer import reconstruction_report as emoji_report
    from diffusers_lmlp.emoji.world import load_images, split_indices

    pictures = torch.from_numpy(load_images()).permute(0, 3, 1, 2)[split_indices("train")]  # (N, 3, 32, 32) uint8
    return pictures.float() / 127.5 - 1, (255, 255, 255), lambda vae: emoji_report(vae, EmojiScorer.from_pretrained())


def reconstruction_loss(
    recon: torch.Tensor, target: torch.Tensor, background, foreground_weight: float, edge_weight: float
) -> torch.Tensor:
    """L1 + MSE weighted towards what differs from the `background` colour, plus L1 on the image gradients; images
    (N, 3, H, W) in [-1, 1]."""
    background = torch.tensor(background, dtype=target.dtype).view(1, 3, 1, 1) / 127.5 - 1.0
    drawn = (target - background).abs().amax(dim=1, keepdim=True) > 2 / 127.5  # (N, 1, H, W): 2 levels or more off
    near_shape = F.max_pool2d(drawn.float(), 3, stride=1, padding=1)  # (N, 1, H, W), dilated 1 px
    weight = 1 + foreground_weight * near_shape
    pixel = (weight * ((recon - target).abs() + (recon - target).pow(2))).mean() / weight.mean()
    edges = sum(F.l1_loss(r, t) for r, t in zip(image_gradients(recon), image_gradients(target)))
    return pixel + edge_weight * edges


def new_vae(args: argparse.Namespace) -> AutoencoderKL:
    """A randomly initialised VAE: 32×32 RGB images to (latent-channels, 8, 8) latents with 3 blocks."""
    return AutoencoderKL(
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


def latent_noise(shape: torch.Size, max_std: float, scaling_factor: float, generator: torch.Generator) -> torch.Tensor:
    """Gaussian noise for latents of `shape` (b, C, h, w), with a standard deviation drawn per image from
    U(0, `max_std`) in units of the scaled latents, returned in the VAE's own (unscaled) units."""
    std = max_std * torch.rand(shape[0], 1, 1, 1, generator=generator)  # (b, 1, 1, 1)
    return std * torch.randn(shape, generator=generator) / scaling_factor


class DivergedError(RuntimeError):
    """Training produced a loss, weights or a latent scale that is not finite; nothing was saved."""


def train(vae: AutoencoderKL, pixels: torch.Tensor, background, args: argparse.Namespace) -> float:
    """Train the VAE's parameters that require gradients on `pixels` (N, 3, H, W); returns the seconds taken.

    With a frozen encoder (the decoder stage) its posterior is computed without gradients and the KL term, which
    only the encoder could lower, is left out.

    Raises:
        DivergedError: At the first step whose loss is NaN or infinite, before that step updates any weight.
    """
    encoder_trains = any(p.requires_grad for p in vae.encoder.parameters())
    optimizer = torch.optim.AdamW([p for p in vae.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=args.steps, pct_start=0.05)
    generator = torch.Generator().manual_seed(args.seed)
    start = time.perf_counter()
    for step in (progress := tqdm(range(1, args.steps + 1), desc=f"training the {args.world} VAE", mininterval=10)):
        batch = pixels[torch.randint(0, len(pixels), (args.batch_size,), generator=generator)]  # (b, 3, H, W)
        with torch.autocast("cpu", torch.bfloat16, enabled=args.bf16):
            with torch.set_grad_enabled(encoder_trains):
                posterior = vae.encode(batch).latent_dist
                latents = posterior.sample(generator=generator)  # (b, C, h, w)
            if args.latent_noise:
                latents = latents + latent_noise(
                    latents.shape, args.latent_noise, vae.config.scaling_factor, generator
                )
            reconstruction = vae.decode(latents).sample.float()
        loss = reconstruction_loss(reconstruction, batch, background, args.foreground_weight, args.edge_weight)
        if encoder_trains:
            loss = loss + args.kl_weight * posterior.kl().mean() / batch[0].numel()
        if not math.isfinite(loss_value := loss.item()):
            raise DivergedError(
                f"the VAE's loss is {loss_value} at step {step} of {args.steps}: training diverged and nothing was "
                f"saved. Lower --lr (it is {args.lr}) and run again."
            )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        progress.set_postfix(loss=f"{loss_value:.4f}", refresh=False)
    return time.perf_counter() - start


def refuse_non_finite(vae: AutoencoderKL, output_dir: Path) -> None:
    """Raise `DivergedError`, before anything is written to `output_dir`, if a weight or the latent scale of `vae`
    is NaN or infinite: a finite loss at every step does not rule out a last update that overflowed.

    Args:
        vae (`AutoencoderKL`): The trained VAE, about to be saved.
        output_dir (`Path`): Where it would be saved, for the message.
    """
    bad = non_finite_parameters(vae)
    if not math.isfinite(vae.config.scaling_factor):
        bad.append(f"scaling_factor ({vae.config.scaling_factor})")
    if bad:
        raise DivergedError(
            f"{len(bad)} of the trained VAE's tensors hold NaN or inf ({', '.join(bad[:3])}"
            f"{', ...' if len(bad) > 3 else ''}), so it was not saved to {output_dir}. Lower --lr and run again."
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", choices=("shapes", "emoji"), default="shapes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--kl-weight", type=float, default=1e-4)
    parser.add_argument("--foreground-weight", type=float, default=20.0)
    parser.add_argument("--edge-weight", type=float, default=1.0)
    parser.add_argument("--latent-channels", type=int, default=8)
    parser.add_argument("--block-out-channels", type=int, nargs="+", default=(16, 32, 64))
    parser.add_argument("--num-images", type=int, default=4000, help="shapes renders to train on")
    parser.add_argument(
        "--bf16",
        action="store_true",
        help="autocast to bfloat16 (where the CPU runs it natively: about twice as fast)",
    )
    parser.add_argument(
        "--decoder-from", type=Path, help="a saved VAE folder: fine-tune its decoder only, keeping its latents"
    )
    parser.add_argument(
        "--latent-noise",
        type=float,
        default=0.0,
        help="the largest standard deviation of the noise added to the latents the decoder reads, in units of the "
        "scaled latents (0: none)",
    )
    parser.add_argument("--output-dir", type=Path, default=Path("shapes-vae"))
    args = parser.parse_args(argv)
    if not (math.isfinite(args.lr) and args.lr > 0):
        parser.error(f"--lr must be a finite number > 0, got {args.lr}")
    if not (math.isfinite(args.latent_noise) and args.latent_noise >= 0):
        parser.error(f"--latent-noise must be a finite number >= 0, got {args.latent_noise}")
    if args.decoder_from and not (args.decoder_from / "config.json").is_file():
        parser.error(f"--decoder-from {args.decoder_from} has no config.json: pass a folder saved by this script")

    torch.manual_seed(args.seed)
    train_pixels, background, report_of = world_data(args)
    if args.decoder_from:
        vae = AutoencoderKL.from_pretrained(args.decoder_from)  # safetensors only, as the package loads it
        for frozen in (vae.encoder, vae.quant_conv):
            frozen.requires_grad_(False)
    else:
        vae = new_vae(args)
    seconds = train(vae, train_pixels, background, args)

    vae.eval()
    with torch.no_grad():
        latents = torch.cat(
            [vae.encode(batch).latent_dist.mode() for batch in train_pixels.split(256)]
        )  # (N, C, h, w)
    if not args.decoder_from:  # the decoder stage keeps the latents, and so their scale
        vae.register_to_config(scaling_factor=round(1.0 / latents.std().item(), 5))
    refuse_non_finite(vae, args.output_dir)
    vae.save_pretrained(args.output_dir)
    report = report_of(vae)
    print(
        f"saved {args.output_dir}: {sum(p.numel() for p in vae.parameters()):,} parameters, latents "
        f"{tuple(latents.shape[1:])}, scaling_factor {vae.config.scaling_factor}, {seconds:.0f} s of training\n"
        f"reconstructions: {json.dumps({k: round(v, 4) for k, v in report.items()})}"
    )


if __name__ == "__main__":
    main()
