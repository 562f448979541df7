"""Tiny, randomly initialised `LMLPPipeline` components, built offline: `build_tiny_pipeline()` is a complete
pipeline, deterministic for a seed, that samples quickly on a CPU (for tests, examples and the Space)."""

import json
import os
import tempfile

import torch
from diffusers import AutoencoderKL
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

from .models import FAMILIES
from .pipelines import LMLPPipeline, default_scheduler


# Words that get whole-word BPE merges; any other word still tokenizes, byte by byte.
TINY_VOCAB_WORDS = (
    "a", "an", "the", "of", "on", "in", "and", "with", "photo", "picture", "small", "large", "big", "red", "green",
    "blue", "yellow", "white", "black", "circle", "square", "triangle", "shape", "cat", "dog", "astronaut", "horse",
    "riding", "painting",
)  # fmt: skip


def tiny_clip_tokenizer(
    model_max_length: int = 16,
    save_directory: str | os.PathLike | None = None,
    words: tuple[str, ...] = TINY_VOCAB_WORDS,
) -> CLIPTokenizer:
    """A `CLIPTokenizer` of CLIP's byte-level alphabet (any word tokenizes), one token per word of `words` and SD 1.x
    special tokens, written to `save_directory` (default: a temporary one); `model_max_length` is `text_seq_len`."""
    if save_directory is None:
        with tempfile.TemporaryDirectory() as temporary_directory:
            return tiny_clip_tokenizer(model_max_length, temporary_directory, words)
    # GPT-2's reversible byte -> printable unicode map, the base alphabet of CLIP's byte-level BPE.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [byte for byte in range(256) if byte not in printable]
    byte_symbols = dict(zip(printable + others, map(chr, printable + [256 + i for i in range(len(others))])))
    alphabet = list(byte_symbols.values())
    tokens = alphabet + [symbol + "</w>" for symbol in alphabet]
    ranks: dict[tuple[str, str], int] = {}  # merge -> its rank, in the order of merges.txt
    for word in ("".join(byte_symbols[byte] for byte in word.encode("utf-8")) for word in words):
        symbols = list(word[:-1]) + [word[-1] + "</w>"]
        while len(symbols) > 1:  # apply the earlier merges, lowest rank first
            rank, i = min((ranks.get(pair, len(ranks)), i) for i, pair in enumerate(zip(symbols, symbols[1:])))
            if rank == len(ranks):
                break
            symbols = symbols[:i] + [symbols[i] + symbols[i + 1]] + symbols[i + 2 :]
        while len(symbols) > 1:  # then merge what is left, left to right, into one token
            ranks.setdefault((symbols[0], symbols[1]), len(ranks))
            symbols = [symbols[0] + symbols[1]] + symbols[2:]
            tokens.append(symbols[0])
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    os.makedirs(save_directory, exist_ok=True)
    with open(os.path.join(save_directory, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump({token: i for i, token in enumerate(dict.fromkeys(tokens))}, f, ensure_ascii=False)
    with open(os.path.join(save_directory, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "".join(f"{left} {right}\n" for left, right in ranks))  # a header, then merges
    return CLIPTokenizer.from_pretrained(save_directory, model_max_length=model_max_length)


def tiny_clip_text_encoder(
    tokenizer: CLIPTokenizer, hidden_size: int = 32, intermediate_size: int = 37
) -> CLIPTextModel:
    """A randomly initialised 2-layer, 4-head CLIP text encoder that reads `tokenizer`'s ids and length; seed the
    global RNG first for reproducible weights."""
    config = CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size, num_attention_heads=4,
        num_hidden_layers=2, max_position_embeddings=tokenizer.model_max_length, projection_dim=hidden_size,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    return CLIPTextModel(config)


def build_tiny_pipeline(
    backbone: str = "lmlp", seed: int = 0, text_seq_len: int = 16, sample_size: int = 8, hidden_size: int = 32
) -> LMLPPipeline:
    """A complete, tiny, randomly initialised `LMLPPipeline` in eval mode with a 2-layer backbone of the family
    `backbone`; equal seeds give equal weights, and the global RNG is left untouched."""
    if backbone not in FAMILIES:
        raise ValueError(f"Unknown backbone {backbone!r}; choose a block family among {sorted(FAMILIES)}.")
    family = FAMILIES[backbone]
    tokenizer = tiny_clip_tokenizer(model_max_length=text_seq_len)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = tiny_clip_text_encoder(tokenizer)
        vae = AutoencoderKL(
            down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
            block_out_channels=(8, 16), latent_channels=4, norm_num_groups=4, sample_size=2 * sample_size,
            scaling_factor=0.23010,
        )  # fmt: skip
        transformer = family.model_class(
            sample_size=sample_size, patch_size=2, in_channels=4, hidden_size=hidden_size, num_layers=2,
            text_embed_dim=text_encoder.config.hidden_size, text_seq_len=text_seq_len, **family.tiny_overrides,
        )  # fmt: skip
    return LMLPPipeline(
        vae=vae.eval(), text_encoder=text_encoder.eval(), tokenizer=tokenizer, transformer=transformer.eval(),
        scheduler=default_scheduler(),
    )  # fmt: skip
