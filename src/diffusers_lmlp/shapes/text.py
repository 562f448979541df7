"""The shapes world's offline text side: a CLIP tokenizer over its words, and the small pretrained CLIP text encoder
and VAE shipped in `assets/pipeline/` (`scripts/train_shapes_text_encoder.py`, `scripts/train_vae.py`)."""

from pathlib import Path

import torch
from diffusers import AutoencoderKL
from transformers import CLIPTextModel, CLIPTokenizer

from ..tiny import tiny_clip_text_encoder, tiny_clip_tokenizer
from .world import COLOURS, SHAPES, SIZES


# bos + the longest phrasing (8 words and marks, "a small red circle at the top left") + eos; "," and ":" are tokens.
TEXT_SEQ_LEN = 10
# The words of every phrasing, one token each; new words go last, so that earlier ids stay.
WORLD_WORDS = ("a", "at", "the", *SIZES, *COLOURS, *SHAPES, "top", "bottom", "left", "right", "center",
               "in", "big", "upper", "lower", "middle", "centre")  # fmt: skip
TEXT_ENCODER_PATH = Path(__file__).resolve().parent / "assets" / "pipeline" / "text_encoder"
VAE_PATH = Path(__file__).resolve().parent / "assets" / "pipeline" / "vae"


def shapes_tokenizer(save_directory: str | None = None) -> CLIPTokenizer:
    """A CLIP BPE tokenizer with one token per world word (other words tokenise byte by byte), written to
    `save_directory` (a temporary folder when not given)."""
    return tiny_clip_tokenizer(TEXT_SEQ_LEN, save_directory, words=WORLD_WORDS)


def shapes_text_encoder(tokenizer: CLIPTokenizer, seed: int = 0) -> CLIPTextModel:
    """The world's text encoder architecture (width 64, 2 layers), frozen, randomly initialised from `seed` alone."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        encoder = tiny_clip_text_encoder(tokenizer, hidden_size=64, intermediate_size=128)
    return encoder.requires_grad_(False).eval()


def shapes_components() -> tuple[CLIPTokenizer, CLIPTextModel, AutoencoderKL]:
    """The embedded default's frozen `(tokenizer, text_encoder, vae)`: the tokenizer, the shipped encoder and VAE."""
    tokenizer = shapes_tokenizer()
    text_encoder = CLIPTextModel.from_pretrained(TEXT_ENCODER_PATH, use_safetensors=True)
    if text_encoder.config.vocab_size != len(tokenizer):
        raise ValueError(
            f"The shipped shapes text encoder reads {text_encoder.config.vocab_size} token ids, but the world's "
            f"tokenizer has {len(tokenizer)}: retrain it with scripts/train_shapes_text_encoder.py."
        )
    vae = AutoencoderKL.from_pretrained(VAE_PATH, use_safetensors=True)
    return tokenizer, text_encoder.requires_grad_(False).eval(), vae.requires_grad_(False).eval()
