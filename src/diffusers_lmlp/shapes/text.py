"""The shapes world's offline text side and components: a CLIP tokenizer over its words, a small frozen CLIP text
encoder, and the trained VAE that ships in `assets/pipeline/vae` (trained by `scripts/train_shapes_vae.py`)."""

from pathlib import Path

import torch
from diffusers import AutoencoderKL
from transformers import CLIPTextModel, CLIPTokenizer

from ..tiny import tiny_clip_text_encoder, tiny_clip_tokenizer
from .world import COLOURS, SHAPES, SIZES


# bos + the longest phrasings (8 words and punctuation marks, e.g. "a small red circle at the top left") + eos: every
# caption fits, and the backbone mixes no padding tokens (its sequence is 1 + 10 + 16 tokens; with 16 text tokens,
# 1 + 16 + 16). "," and ":" are tokens of their own.
TEXT_SEQ_LEN = 10
# The words of every phrasing (`world.phrasings`), one token each; new words go last, so that earlier ids stay.
WORLD_WORDS = ("a", "at", "the", *SIZES, *COLOURS, *SHAPES, "top", "bottom", "left", "right", "center",
               "in", "big", "upper", "lower", "middle", "centre")  # fmt: skip
# The VAE of the shipped pipeline; the embedded default trains on its latents, so the two stay one file.
VAE_PATH = Path(__file__).resolve().parent / "assets" / "pipeline" / "vae"


def shapes_tokenizer(save_directory: str | None = None) -> CLIPTokenizer:
    """A CLIP BPE tokenizer with one token per world word; other words still tokenise, byte by byte.

    Args:
        save_directory (`str`, *optional*): Where to write `vocab.json` and `merges.txt` (a temporary folder when
            not given).
    """
    return tiny_clip_tokenizer(TEXT_SEQ_LEN, save_directory, words=WORLD_WORDS)


def shapes_text_encoder(tokenizer: CLIPTokenizer, seed: int = 0) -> CLIPTextModel:
    """A small CLIP text encoder (width 64, 2 layers), randomly initialised from `seed` and frozen.

    A frozen random transformer already maps different captions to different states, which is all the backbone
    needs; the global random state is left untouched.

    Args:
        tokenizer (`CLIPTokenizer`): The tokenizer it reads (`shapes_tokenizer()`).
        seed (`int`, *optional*, defaults to 0): Seed of the initialisation.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        encoder = tiny_clip_text_encoder(tokenizer, hidden_size=64, intermediate_size=128)
    return encoder.requires_grad_(False).eval()


def shapes_components(seed: int = 0) -> tuple[CLIPTokenizer, CLIPTextModel, AutoencoderKL]:
    """The frozen components of the embedded default: tokenizer, text encoder, and the trained shapes VAE.

    Args:
        seed (`int`, *optional*, defaults to 0): Seed of the text encoder's initialisation.

    Returns:
        `tuple`: `(tokenizer, text_encoder, vae)`.
    """
    tokenizer = shapes_tokenizer()
    vae = AutoencoderKL.from_pretrained(VAE_PATH, use_safetensors=True)
    return tokenizer, shapes_text_encoder(tokenizer, seed), vae.requires_grad_(False).eval()
