"""The shapes world: renders, splits, datasets, the scorer, the offline text side and the committed VAE."""

import json

import datasets
import numpy as np
import pytest
import torch
from PIL import Image, ImageFilter

from diffusers_lmlp.shapes.pretrained import pretrained_shapes_pipeline
from diffusers_lmlp.shapes.scorer import parse_caption, read_image, score_image, score_images
from diffusers_lmlp.shapes.text import WORLD_WORDS, shapes_components, shapes_text_encoder, shapes_tokenizer
from diffusers_lmlp.shapes.world import (
    COLOURS,
    POSITIONS,
    SHAPES,
    SIZES,
    ShapeSpec,
    all_specs,
    held_out_specs,
    make_dataset,
    render,
    train_specs,
    write_imagefolder,
)


def test_scorer_reads_every_jittered_ground_truth_render():
    rng = np.random.default_rng(0)
    specs = all_specs() * 3  # 972 renders, each with its own jitter
    scores = score_images([render(s, rng=rng) for s in specs], [s.caption for s in specs])
    assert scores == dict.fromkeys(["colour", "shape", "position", "size", "colour+position", "all"], 1.0)


def test_scorer_tolerates_blur_and_noise_in_colour_and_position():
    rng = np.random.default_rng(1)
    images = []
    for spec in all_specs():
        blurred = np.asarray(render(spec, rng=rng).filter(ImageFilter.GaussianBlur(0.7)), np.float32)
        images.append(np.clip(blurred + rng.normal(0, 8, blurred.shape), 0, 255).astype(np.uint8))
    scores = score_images(images, [s.caption for s in all_specs()])
    assert scores["colour+position"] == 1.0 and scores["all"] >= 0.95


def test_scorer_says_no_to_wrong_captions_and_to_blank_images():
    spec = ShapeSpec("large", "red", "circle", "top left")
    image = render(spec)
    assert score_image(image, spec.caption) == dict.fromkeys(["colour", "shape", "position", "size"], True)
    assert score_image(image, "a small blue square at the bottom right") == dict.fromkeys(
        ["colour", "shape", "position", "size"], False
    )
    assert read_image(Image.new("RGB", (32, 32), (128, 128, 128))) is None
    assert not any(score_image(Image.new("RGB", (32, 32), (128, 128, 128)), spec.caption).values())


def test_captions_parse_back_and_foreign_text_is_refused():
    for spec in all_specs():
        assert parse_caption(spec.caption) == spec
    with pytest.raises(ValueError, match="is not a shapes-world caption: expected 'a {size}"):
        parse_caption("an astronaut riding a horse")
    with pytest.raises(ValueError, match="Unknown colour 'purple'"):
        parse_caption("a small purple circle at the top")


def test_held_out_combinations_are_never_trained_but_every_value_is():
    held_out, train = set(held_out_specs()), set(train_specs())
    assert len(all_specs()) == 2 * 6 * 3 * 9 == len(held_out) + len(train)
    assert held_out and not held_out & train
    for attribute, values in (("size", SIZES), ("colour", COLOURS), ("shape", SHAPES), ("position", POSITIONS)):
        assert {getattr(s, attribute) for s in train} == set(values)


def test_dataset_is_deterministic_and_uses_its_split(tmp_path):
    first, again = make_dataset("train", num_images=40, seed=3), make_dataset("train", num_images=40, seed=3)
    assert first.column_names == ["image", "text"] and len(first) == 40
    assert first["text"] == again["text"]
    assert np.array_equal(np.asarray(first[7]["image"]), np.asarray(again[7]["image"]))
    assert first[0]["image"].size == (32, 32) and first[0]["image"].mode == "RGB"
    assert {parse_caption(t) for t in make_dataset("heldout", num_images=64)["text"]} <= set(held_out_specs())

    folder = write_imagefolder(first, tmp_path / "folder")
    lines = (tmp_path / "folder" / "metadata.jsonl").read_text().splitlines()
    assert len(lines) == 40 and set(json.loads(lines[0])) == {"file_name", "text"}
    loaded = datasets.load_dataset("imagefolder", data_dir=str(folder), split="train")
    assert sorted(loaded["text"]) == sorted(first["text"])


def test_tokenizer_has_one_token_per_world_word_and_still_reads_other_words():
    tokenizer = shapes_tokenizer()
    for word in WORLD_WORDS:
        assert len(tokenizer(word, add_special_tokens=False).input_ids) == 1, word
    longest = max((s.caption for s in all_specs()), key=len)
    assert len(tokenizer(longest).input_ids) <= tokenizer.model_max_length == 10
    assert len(tokenizer("zebra", add_special_tokens=False).input_ids) > 1
    assert tokenizer.decode(tokenizer("a zebra").input_ids, skip_special_tokens=True) == "a zebra"


def test_text_encoder_is_frozen_and_deterministic_for_a_seed():
    tokenizer = shapes_tokenizer()
    ids = tokenizer(["a small red circle at the top", "a large blue square at the left"], padding="max_length",
                    return_tensors="pt").input_ids  # fmt: skip
    encoder = shapes_text_encoder(tokenizer, seed=0)
    assert not any(p.requires_grad for p in encoder.parameters())
    states = encoder(ids)[0]
    assert states.shape == (2, 10, 64)
    torch.testing.assert_close(shapes_text_encoder(tokenizer, seed=0)(ids)[0], states, rtol=0, atol=0)
    assert not torch.allclose(states[0], states[1])


def test_committed_vae_reconstructs_held_out_images():
    _, _, vae = shapes_components()
    images = make_dataset("heldout", num_images=64, seed=5)["image"]
    pixels = torch.from_numpy(np.stack([np.asarray(i, np.float32) for i in images]) / 127.5 - 1).permute(0, 3, 1, 2)
    with torch.no_grad():
        latents = vae.encode(pixels).latent_dist.mode()  # (64, 4, 8, 8)
        recon = vae.decode(latents).sample.clamp(-1, 1)
    assert latents.shape == (64, 4, 8, 8)
    psnr = (10 * torch.log10(1 / ((recon - pixels) / 2).pow(2).mean(dim=(1, 2, 3)))).mean()
    assert psnr >= 28.0
    assert 0.5 < (latents * vae.config.scaling_factor).std() < 2.0  # the scaling factor normalises the latents


def test_shipped_pipeline_draws_the_captions_colour_and_position():
    pipe = pretrained_shapes_pipeline()
    pipe.set_progress_bar_config(disable=True)
    # Measured at commit: 96% colour+position on these 25 training captions, 91% on the 32 held-out ones.
    for specs, least in ((train_specs()[::12], 0.88), (held_out_specs(), 0.8)):
        images = pipe([s.caption for s in specs], num_inference_steps=20, guidance_scale=4.0,
                      generator=torch.Generator().manual_seed(0)).images  # fmt: skip
        scores = score_images(images, [s.caption for s in specs])
        assert images[0].size == (32, 32)
        assert scores["colour+position"] >= least and scores["position"] >= 0.9, scores
