"""The emoji world's trained components and its scorer, `EmojiScorer`: which real emoji a picture is nearest to, by
the emoji CLIP's image tower (also emoji-FID's) and, independently of any model, by pixels; and, for a caption that
asks for one skin tone, whether that tone's variant is the nearest of the emoji's."""

import functools
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

from ..image_tensors import images_to_tensor
from .world import load_emoji, load_images, split_indices, tone_group


ASSETS = Path(__file__).resolve().parent / "assets"
CLIP_PATH = ASSETS / "clip"
PIPELINE_PATH = ASSETS / "pipeline"
# bos + the longest phrasing (23 tokens: a two-person emoji with two tones) + eos.
TEXT_SEQ_LEN = 25
# What `EmojiScorer.flags` says of each image: by CLIP, then by pixels.
FLAGS = ("top-1", "top-5", "tone", "pixel top-1", "pixel top-5", "pixel tone")


def emoji_components():
    """The shipped emoji pipeline's frozen `(tokenizer, text_encoder, vae)`; the encoder is the CLIP's text tower."""
    from diffusers import AutoencoderKL
    from transformers import CLIPTextModel, CLIPTokenizer

    tokenizer = CLIPTokenizer.from_pretrained(PIPELINE_PATH / "tokenizer")
    text_encoder = CLIPTextModel.from_pretrained(PIPELINE_PATH / "text_encoder", use_safetensors=True)
    vae = AutoencoderKL.from_pretrained(PIPELINE_PATH / "vae", use_safetensors=True)
    return tokenizer, text_encoder.requires_grad_(False).eval(), vae.requires_grad_(False).eval()


def pretrained_emoji_pipeline(**kwargs):
    """Load the UL-MLP emoji pipeline trained by `--preset emoji`, offline: 32×32 emoji from their names ("surfer:
    dark skin tone") or other phrasings ("a red apple emoji"); `kwargs` go to `LMLPPipeline.from_pretrained`."""
    from ..pipelines import LMLPPipeline

    return LMLPPipeline.from_pretrained(PIPELINE_PATH, **kwargs)


@functools.cache
def caption_targets() -> dict[str, tuple[int, ...]]:
    """Every phrasing of the world → the pictures it describes (two emoji share the name "man in tuxedo")."""
    targets: dict[str, list[int]] = {}
    for index, emoji in enumerate(load_emoji()):
        for caption in emoji.captions:
            targets.setdefault(caption, []).append(index)
    return {caption: tuple(indices) for caption, indices in targets.items()}


def is_emoji_caption(caption: str) -> bool:
    return caption in caption_targets()


class EmojiFeatures(nn.Module):
    """The emoji CLIP's image tower as a feature network: (B, 3, H, W) images in [0, 1] → (B, D) unit embeddings,
    resized to the tower's 32×32 first; `mean` and `std` are its image processor's normalisation."""

    name = "emoji-clip"

    def __init__(self, model, mean: list[float], std: list[float]):
        super().__init__()
        self.model = model.eval()
        self.num_features = model.config.projection_dim
        self.register_buffer("mean", torch.tensor(mean).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std).view(1, 3, 1, 1), persistent=False)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        size = self.model.config.vision_config.image_size
        if images.shape[-1] != size:
            images = F.interpolate(images, size=(size, size), mode="bilinear", antialias=True)
        pixels = ((images - self.mean) / self.std).to(self.mean.device, self.model.dtype)
        features = self.model.get_image_features(pixel_values=pixels).pooler_output  # (B, D)
        return F.normalize(features.float(), dim=-1)


def emoji_features(path: str | Path = CLIP_PATH) -> EmojiFeatures:
    """The emoji-FID feature network of a saved emoji CLIP folder (safetensors only), the shipped one by default."""
    from transformers import CLIPImageProcessor, CLIPModel

    processor = CLIPImageProcessor.from_pretrained(path)
    model = CLIPModel.from_pretrained(path, use_safetensors=True)
    return EmojiFeatures(model, processor.image_mean, processor.image_std)


class EmojiScorer:
    """Finds the real emoji nearest to images, by the emoji CLIP's `CLIPScorer` `clip` and by pixels."""

    FLAGS = FLAGS

    def __init__(self, clip):
        self.clip = clip
        processor = clip.processor.image_processor
        self.features = EmojiFeatures(clip.model, processor.image_mean, processor.image_std)
        pictures = torch.from_numpy(load_images()).permute(0, 3, 1, 2).float() / 255  # (N, 3, 32, 32)
        self.pixels = pictures.flatten(1)  # (N, 3·32·32)
        self.real = self.embed(pictures)  # (N, D)
        self.bases = np.array([emoji.base for emoji in load_emoji()])

    @classmethod
    def from_pretrained(cls, path: str | Path = CLIP_PATH, device: str | torch.device = "cpu") -> "EmojiScorer":
        """The scorer of a saved emoji CLIP folder (safetensors only), the shipped one by default, run on `device`."""
        from ..evaluation.clip_score import CLIPScorer

        return cls(CLIPScorer.from_pretrained(path, device=device))

    @torch.no_grad()
    def embed(self, pixels: torch.Tensor) -> torch.Tensor:
        """(N, 3, H, W) images in [0, 1] → (N, D) unit image embeddings, on the CPU."""
        return torch.cat([self.features(batch.to(self.clip.device)).cpu() for batch in pixels.split(512)])

    def similarities(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The (B, N) CLIP cosines and negative pixel distances of (B, 3, 32, 32) images in [0, 1] to the real ones."""
        by_clip = self.embed(pixels) @ self.real.T  # (B, N)
        by_pixels = -torch.cdist(pixels.flatten(1).float(), self.pixels)  # (B, N)
        return by_clip, by_pixels

    def flags(self, images: list[Image.Image], captions: list[str]) -> list[list[float]]:
        """Per image, 1.0 or 0.0 for each of `FLAGS`, by CLIP then by pixels: the asked emoji (any tone) is the nearest
        real one, or among the 5 nearest; the asked tone is the nearest of its variants (NaN unless one is asked)."""
        pixels = images_to_tensor(images)  # (B, 3, H, W)
        if pixels.shape[-1] != 32:
            pixels = F.interpolate(pixels, size=(32, 32), mode="bilinear", antialias=True)
        rows = []
        for similarity in self.similarities(pixels):
            top = similarity.topk(5, dim=-1).indices.numpy()  # (B, 5)
            columns = []
            for b, caption in enumerate(captions):
                targets = caption_targets()[caption]
                bases = set(self.bases[list(targets)])
                hits = [self.bases[i] in bases for i in top[b]]
                group = list(tone_group(targets[0])) if len(load_emoji()[targets[0]].tones) == 1 else []
                tone = float(group[int(similarity[b, group].argmax())] == targets[0]) if group else float("nan")
                columns.append([float(hits[0]), float(any(hits)), tone])
            rows.append(columns)
        return [clip + pixel for clip, pixel in zip(*rows)]

    def renders(self, captions: list[str], batch: range, seed: int, stream: int, resolution: int) -> list[Image.Image]:
        """Real pictures for emoji-FID: of each caption (stream 1), or, for the floor (stream 2), a picture of the
        caption's split drawn by (seed, stream, index in `batch`)."""
        images, emoji = load_images(), load_emoji()
        pictures = []
        for caption, index in zip(captions, batch):
            target = caption_targets()[caption][0]
            if stream == 2:
                split = split_indices("heldout" if emoji[target].held_out else "train")
                target = split[np.random.default_rng([seed, stream, index]).integers(len(split))]
            pictures.append(Image.fromarray(images[target]).resize((resolution, resolution), Image.BILINEAR))
        return pictures

    @staticmethod
    def accuracies(flags: list[dict[str, bool]]) -> dict[str, float]:
        """The share of images for which each flag holds, over those it applies to."""
        columns = {name: [row[name] for row in flags if name in row] for name in FLAGS}
        return {name: float(np.mean(values)) for name, values in columns.items() if values}

    @staticmethod
    def intervals(flags: np.ndarray, captions: list[str], seed: int) -> dict[str, list[float]]:
        """95% intervals of each accuracy of (images, len(FLAGS)) `flags`, resampling captions with their images."""
        from ..evaluation.intervals import bootstrap_intervals

        return bootstrap_intervals(flags, captions, seed=seed, columns=dict(zip(FLAGS, flags.T)))


def reconstruction_report(vae, scorer: EmojiScorer) -> dict[str, float]:
    """How well an autoencoder keeps the emoji world: for the pictures of each split, the reconstruction PSNR and the
    share whose reconstruction has its own picture as the nearest of all, by CLIP and by pixels."""
    from ..shapes.autoencoder import psnr, reconstruct

    pictures = torch.from_numpy(load_images()).permute(0, 3, 1, 2).float() / 255  # (N, 3, 32, 32)
    report = {}
    for split in ("train", "heldout"):
        rows = split_indices(split)
        target = pictures[rows] * 2 - 1
        recon = reconstruct(vae, target)  # (n, 3, 32, 32) in [-1, 1]
        rounded = ((recon + 1) * 127.5).round() / 255  # as a saved image
        for name, similarity in zip(("clip", "pixel"), scorer.similarities(rounded)):
            report[f"{split} {name} top-1"] = (similarity.argmax(-1) == torch.tensor(rows)).float().mean().item()
        report[f"{split} psnr"] = psnr(recon, target)
    return report
