"""The shapes world's offline text side and components: a CLIP tokenizer over its words, and the small pretrained
CLIP text encoder and VAE that ship in `assets/pipeline/` (trained by `scripts/train_shapes_text_encoder.py` and
`scripts/train_vae.py`)."""

from pathlib import Path

import torch
from diffusers import AutoencoderKL
from transformers import CLIPTextModel, CLIPTokenizer

from ..tiny import tiny_clip_text_encoder, tiny_clip_tokenizer
from .world import COLOURS, SHAPES, SIZES


# bos + the longest phrasings (8 words and punctuation marks, e.g. "a small red circle at the top left") + eos: every
# caption fits (the backbone's sequence is 1 + 10 + 16 tokens). "," and ":" are tokens of their own.
TEXT_SEQ_LEN = 10
# The words of every phrasing (`world.phrasings`), one token each; new words go last, so that earlier ids stay.
WORLD_WORDS = ("a", "at", "the", *SIZES, *COLOURS, *SHAPES, "top", "bottom", "left", "right", "center",
               "in", "big", "upper", "lower", "middle", "centre")  # fmt: skip
# The text encoder and VAE of the shipped pipeline; the embedded default trains on their text states and latents, so
# each stays one file.
TEXT_ENCODER_PATH = Path(__file__).resolve().parent / "assets" / "pipeline" / "text_encoder"
VAE_PATH = Path(__file__).resolve().parent / "assets" / "pipeline" / "vae"


def shapes_tokenizer(save_directory: str | None = None) -> CLIPTokenizer:
    """A CLIP BPE tokenizer with one token per world word; other words still tokenise, byte by byte.

    Args:
        save_directory (`str`, *optional*): Where to write `vocab.json` and `merges.txt` (a temporary folder when
            not given).
    """
    return tiny_clip_tokenizer(TEXT_SEQ_LEN, save_directory, words=WORLD_WORDS)


def shapes_text_encoder(tokenizer: CLIPTokenizer, seed: int = 0) -> CLIPTextModel:
    """The shapes world's text encoder architecture (width 64, 2 layers), frozen and randomly initialised from `seed`
    without touching the global random state; `scripts/train_shapes_text_encoder.py` pretrains it.

    Args:
        tokenizer (`CLIPTokenizer`): The tokenizer it reads (`shapes_tokenizer()`).
        seed (`int`, *optional*, defaults to 0): Seed of the initialisation.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        encoder = tiny_clip_text_encoder(tokenizer, hidden_size=64, intermediate_size=128)
    return encoder.requires_grad_(False).eval()


def shapes_components() -> tuple[CLIPTokenizer, CLIPTextModel, AutoencoderKL]:
    """The frozen components of the embedded default: the tokenizer, and the shipped pretrained text encoder and VAE.

    Returns:
        `tuple`: `(tokenizer, text_encoder, vae)`.

    Raises:
        `ValueError`: When the shipped text encoder does not read this tokenizer's ids (a world word added since).
    """
    tokenizer = shapes_tokenizer()
    text_encoder = CLIPTextModel.from_pretrained(TEXT_ENCODER_PATH, use_safetensors=True)
    if text_encoder.config.vocab_size != len(tokenizer):
        raise ValueError(
            f"The shipped shapes text encoder reads {text_encoder.config.vocab_size} token ids, but the world's "
            f"tokenizer has {len(tokenizer)}: retrain it with scripts/train_shapes_text_encoder.py."
        )
    vae = AutoencoderKL.from_pretrained(VAE_PATH, use_safetensors=True)
    return tokenizer, text_encoder.requires_grad_(False).eval(), vae.requires_grad_(False).eval()
