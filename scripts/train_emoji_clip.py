#!/usr/bin/env python
"""Train the emoji world's small CLIP contrastively on its training pictures and their phrasings, and save it.

    python scripts/train_emoji_clip.py          # writes the package's emoji/assets/clip and the pipeline's text side

As CLIP was trained: each batch pairs pictures with one random phrasing each, and a symmetric cross-entropy over the
batch's cosine similarities pulls every pair together and pushes the others apart. Tone variants of one emoji in a
batch are each other's negatives, so both towers learn the tone. The held-out variants are never seen by either
tower. The pictures are shifted, blurred and noised a little, so that the image tower also reads a sample that is
close to a picture without being it.

It writes the `CLIPModel` with its processor (the tokenizer, one token per world word, and a 32×32 image processor)
to `--output-dir`, the evaluator that `diffusers_lmlp.emoji.EmojiScorer` loads; and its text tower as a
`CLIPTextModel` with the tokenizer to `--pipeline-dir`, the text side that the emoji pipeline is trained on. A new
CLIP changes the text states, so the shipped pipeline must then be retrained on it.
"""

import argparse
import re
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTextModel

from diffusers_lmlp.emoji.scorer import CLIP_PATH, PIPELINE_PATH, TEXT_SEQ_LEN
from diffusers_lmlp.emoji.world import load_emoji, load_images, split_indices
from diffusers_lmlp.tiny import tiny_clip_tokenizer


# CLIP's pre-tokenizer: letters, single digits, runs of other symbols (the tokenizer lowercases first).
WORD = re.compile(r"'s|'t|'re|'ve|'m|'ll|'d|[^\W\d_]+|\d|[^\s\w]+|_")
CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]


def world_words() -> tuple[str, ...]:
    """Every word of every phrasing, the most frequent first: each becomes one token."""
    counts: dict[str, int] = {}
    for emoji in load_emoji():
        for caption in emoji.captions:
            for word in WORD.findall(caption.lower()):
                counts[word] = counts.get(word, 0) + 1
    return tuple(sorted(counts, key=lambda word: (-counts[word], word)))


def new_clip(tokenizer, width: int, layers: int, seed: int) -> CLIPModel:
    """A randomly initialised CLIP: a causal text tower over the tokenizer's ids and a ViT over 32×32 pictures in 4×4
    patches, both `width` wide and `layers` deep, projected to `width`."""
    tower = dict(hidden_size=width, intermediate_size=4 * width, num_attention_heads=4, num_hidden_layers=layers)
    config = CLIPConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            max_position_embeddings=TEXT_SEQ_LEN,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            **tower,
        ),
        vision_config=dict(image_size=32, patch_size=4, **tower),
        projection_dim=width,
    )
    torch.manual_seed(seed)
    return CLIPModel(config)


def augment(pixels: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Pictures (B, 3, 32, 32) in [0, 1] shifted by up to 2 px on white, half of them blurred, all with a little
    noise."""
    b = len(pixels)
    padded = F.pad(pixels, (2, 2, 2, 2), value=1.0)  # (B, 3, 36, 36)
    dx, dy = torch.randint(0, 5, (2, b), generator=generator)
    shifted = torch.stack([padded[i, :, dy[i] : dy[i] + 32, dx[i] : dx[i] + 32] for i in range(b)])
    kernel = torch.tensor([1.0, 2.0, 1.0]) / 4
    kernel = (kernel[:, None] * kernel[None, :]).expand(3, 1, 3, 3)
    blurred = F.conv2d(F.pad(shifted, (1, 1, 1, 1), mode="replicate"), kernel, groups=3)
    blur = (torch.rand(b, 1, 1, 1, generator=generator) < 0.5).float()
    noisy = shifted + blur * (blurred - shifted) + 0.03 * torch.randn(shifted.shape, generator=generator)
    return noisy.clamp(0, 1)


def normalise(pixels: torch.Tensor) -> torch.Tensor:
    """[0, 1] pictures as the image processor gives them to the vision tower."""
    return (pixels - torch.tensor(CLIP_MEAN).view(1, 3, 1, 1)) / torch.tensor(CLIP_STD).view(1, 3, 1, 1)


@torch.no_grad()
def retrieval(model: CLIPModel, tokenizer, pixels: torch.Tensor, split: str) -> dict[str, float]:
    """Text-to-picture retrieval among all pictures for the split's plain names: the share whose own picture is the
    nearest, and among the 5 nearest."""
    emoji = load_emoji()
    model.eval()
    images = torch.cat([model.get_image_features(pixel_values=normalise(p)).pooler_output for p in pixels.split(512)])
    rows = split_indices(split)
    ids = tokenizer([emoji[i].name for i in rows], padding="max_length", return_tensors="pt").input_ids
    texts = model.get_text_features(input_ids=ids).pooler_output
    similarity = F.normalize(texts, dim=-1) @ F.normalize(images, dim=-1).T  # (n, N)
    top = similarity.topk(5, dim=-1).indices
    targets = torch.tensor(rows)[:, None]
    model.train()
    return {
        "top-1": (top[:, :1] == targets).any(1).float().mean().item(),
        "top-5": (top == targets).any(1).float().mean().item(),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--output-dir", type=Path, default=CLIP_PATH)
    parser.add_argument("--pipeline-dir", type=Path, default=PIPELINE_PATH)
    args = parser.parse_args(argv)

    tokenizer = tiny_clip_tokenizer(TEXT_SEQ_LEN, args.output_dir, words=world_words())
    model = new_clip(tokenizer, args.width, args.layers, args.seed)
    emoji = load_emoji()
    pixels = torch.from_numpy(load_images()).permute(0, 3, 1, 2).float() / 255  # (N, 3, 32, 32)
    train = split_indices("train")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=args.steps, pct_start=0.05)
    generator = torch.Generator().manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    start = time.perf_counter()
    for _ in (progress := tqdm(range(args.steps), desc="training the emoji CLIP", mininterval=10)):
        rows = [train[i] for i in rng.permutation(len(train))[: args.batch_size]]
        captions = [emoji[i].captions[rng.integers(len(emoji[i].captions))] for i in rows]
        ids = tokenizer(captions, padding="max_length", truncation=True, return_tensors="pt").input_ids
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(input_ids=ids, pixel_values=normalise(augment(pixels[rows], generator)))
        logits = out.logits_per_image.float()  # (b, b)
        labels = torch.arange(len(rows))
        loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        progress.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
    seconds = time.perf_counter() - start

    model.eval()
    processor = CLIPProcessor(
        image_processor=CLIPImageProcessor(
            size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}, image_mean=CLIP_MEAN, image_std=CLIP_STD
        ),
        tokenizer=tokenizer,
    )
    model.save_pretrained(args.output_dir)
    processor.save_pretrained(args.output_dir)
    text_encoder = CLIPTextModel(model.config.text_config)
    text_encoder.load_state_dict(model.text_model.state_dict())
    text_encoder.save_pretrained(args.pipeline_dir / "text_encoder")
    tokenizer.save_pretrained(args.pipeline_dir / "tokenizer")
    scores = {split: retrieval(model, tokenizer, pixels, split) for split in ("train", "heldout")}
    print(
        f"saved {args.output_dir}: {sum(p.numel() for p in model.parameters()):,} parameters, {seconds:.0f} s of "
        f"training; plain names to pictures among all {len(emoji):,}: "
        + "; ".join(f"{split} " + ", ".join(f"{k} {v:.1%}" for k, v in s.items()) for split, s in scores.items())
    )


if __name__ == "__main__":
    main()
