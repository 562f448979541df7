#!/usr/bin/env python
"""Train the small CLIP text encoder of the shapes world to read its captions in any phrasing, and save it.

    python scripts/train_shapes_text_encoder.py            # writes ./shapes-text-encoder

A text-to-image model reads a caption through a pretrained text encoder (CLIP for the papers' models). The shapes
world's encoder is small (width 64, 2 layers, as `shapes_text_encoder` builds it), and a randomly initialised one
maps each caption to a different state but scatters what it says over positions that move with the wording ("red
circle, top left" vs "a small red circle at the top left"). An MLP backbone mixes tokens with fixed weights per
position, so it cannot look for the colour word wherever it is. Here the encoder is pretrained once, as CLIP was:
from its state at the last position (which, under CLIP's causal attention, sees the whole padded caption), linear
heads must read the size (or that none is stated), colour, shape and position of random phrasings of the training
combinations (`describe`). The held-out combinations are never seen, and the script reports the heads' accuracy on
their phrasings. The heads are thrown away; the encoder is frozen when the backbone trains.

The shipped pipeline's encoder (`src/diffusers_lmlp/shapes/assets/pipeline/text_encoder`) was made by this command with
the defaults, and the embedded default trains on it (`shapes_components`).
"""

import argparse
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from diffusers_lmlp.shapes.scorer import parse_caption
from diffusers_lmlp.shapes.text import shapes_text_encoder, shapes_tokenizer
from diffusers_lmlp.shapes.world import COLOURS, POSITIONS, SHAPES, SIZES, describe, held_out_specs, train_specs


# What the heads read, and their classes; the size has a class for "not stated".
TARGETS = {"size": (*SIZES, None), "colour": tuple(COLOURS), "shape": SHAPES, "position": POSITIONS}


def batch(specs, tokenizer, rng: np.random.Generator, size: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Random phrasings of random specs: token ids (size, T) and each head's class (size,)."""
    chosen = [specs[i] for i in rng.integers(len(specs), size=size)]
    captions = [describe(spec, rng) for spec in chosen]
    ids = tokenizer(captions, padding="max_length", max_length=tokenizer.model_max_length, return_tensors="pt")
    stated = [parse_caption(caption) for caption in captions]  # the size may be left out by the phrasing
    labels = {
        name: torch.tensor([classes.index(getattr(spec, name)) for spec in stated])
        for name, classes in TARGETS.items()
    }
    return ids.input_ids, labels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--output-dir", type=Path, default=Path("shapes-text-encoder"))
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    tokenizer = shapes_tokenizer()
    encoder = shapes_text_encoder(tokenizer, seed=args.seed).requires_grad_(True).train()
    width = encoder.config.hidden_size
    heads = torch.nn.ModuleDict({name: torch.nn.Linear(width, len(classes)) for name, classes in TARGETS.items()})
    optimizer = torch.optim.AdamW([*encoder.parameters(), *heads.parameters()], lr=args.lr, weight_decay=0.0)
    rng = np.random.default_rng(args.seed)
    specs = train_specs()
    start = time.perf_counter()
    for _ in (progress := tqdm(range(args.steps), desc="training the shapes text encoder", mininterval=10)):
        ids, labels = batch(specs, tokenizer, rng, args.batch_size)
        last = encoder(ids)[0][:, -1]  # (b, width): the last position, which sees the whole caption
        loss = sum(F.cross_entropy(heads[name](last), labels[name]) for name in TARGETS)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        progress.set_postfix(loss=f"{loss.item():.4f}", refresh=False)
    seconds = time.perf_counter() - start

    encoder.requires_grad_(False).eval()
    with torch.no_grad():
        ids, labels = batch(held_out_specs(), tokenizer, np.random.default_rng([args.seed, 1]), 2000)
        last = encoder(ids)[0][:, -1]
        accuracy = {name: (heads[name](last).argmax(-1) == labels[name]).float().mean().item() for name in TARGETS}
    encoder.save_pretrained(args.output_dir)
    print(
        f"saved {args.output_dir}: {sum(p.numel() for p in encoder.parameters()):,} parameters, {seconds:.0f} s of "
        f"training; heads on 2,000 phrasings of held-out combinations: "
        + ", ".join(f"{name} {value:.1%}" for name, value in accuracy.items())
    )


if __name__ == "__main__":
    main()
