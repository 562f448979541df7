"""The shapes world: renders, splits, datasets, scorer, text side, committed VAE and shapes-FID's feature network."""

import json
import os
import re
from dataclasses import replace

import datasets
import numpy as np
import pytest
import torch
from PIL import Image, ImageFilter

from diffusers_lmlp.shapes import make_dataset, pretrained_shapes_pipeline, shapes_tokenizer, world
from diffusers_lmlp.shapes.autoencoder import foreground_mask, held_out_renders, psnr, reconstruction_report, to_pixels
from diffusers_lmlp.shapes.features import ATTRIBUTES, FEATURES_PATH, ShapesFeatureNetwork, pretrained_shapes_features
from diffusers_lmlp.shapes.scorer import CAPTIONS, accuracies, parse_caption, read_image, score_image, score_images
from diffusers_lmlp.shapes.text import TEXT_SEQ_LEN, VAE_PATH, WORLD_WORDS, shapes_components, shapes_text_encoder
from diffusers_lmlp.shapes.world import ShapeSpec, all_specs, describe, held_out_specs, phrasings, render, train_specs


BLANK = Image.new("RGB", (32, 32), (128, 128, 128))
RED_CIRCLE = ShapeSpec("large", "red", "circle", "top left")
STATED = ("colour", "shape", "position", "size")


def sizeless(spec: ShapeSpec) -> ShapeSpec:
    return replace(spec, size=None)


HELD_OUT_TRIPLES = set(map(sizeless, held_out_specs()))


def template_of(caption: str) -> str:
    return next(template for template, pattern in zip(world.TEMPLATES, CAPTIONS) if pattern.fullmatch(caption))


def test_scorer_reads_every_jittered_render_tolerates_blur_and_noise_and_counts_accuracies():
    rng, captions = np.random.default_rng(0), [s.caption for s in all_specs()]
    renders = [render(s, rng=rng) for s in all_specs()]
    assert score_images(renders, captions) == dict.fromkeys([*STATED, "colour+position", "all"], 1.0)
    blurred = [np.asarray(image.filter(ImageFilter.GaussianBlur(0.7)), np.float32) for image in renders]
    noisy = [np.clip(image + rng.normal(0, 8, image.shape), 0, 255).astype(np.uint8) for image in blurred]
    scores = score_images(noisy, captions)
    assert scores["colour+position"] == 1.0 and scores["all"] >= 0.95
    # accuracies count each attribute over the captions that state it: the second and the fourth state no size
    results = [dict(zip(STATED, map(bool, flags))) for flags in [(1, 1, 1, 1), (1, 1, 1), (1, 0, 1, 0), (0, 1, 1)]]
    assert accuracies(results) == {
        "colour": 0.75, "shape": 0.75, "position": 1.0, "size": 0.5, "colour+position": 0.75, "all": 0.5,
    }  # fmt: skip
    assert "size" not in accuracies(results[1::2]) and accuracies(results[1::2])["all"] == 0.5


@pytest.mark.parametrize(
    ("image", "caption", "expected"),
    [
        (render(RED_CIRCLE), RED_CIRCLE.caption, dict.fromkeys(STATED, True)),
        (render(RED_CIRCLE), "a small blue square at the bottom right", dict.fromkeys(STATED, False)),
        (render(RED_CIRCLE), "red circle, upper left", dict.fromkeys(STATED[:3], True)),
        (render(RED_CIRCLE), "bottom: a blue circle", {"colour": False, "shape": True, "position": False}),
        (BLANK, RED_CIRCLE.caption, dict.fromkeys(STATED, False)),
        (BLANK, "red circle, top left", dict.fromkeys(STATED[:3], False)),
    ],
)  # fmt: skip
def test_a_caption_is_scored_on_what_it_states_and_a_blank_image_on_nothing(image, caption, expected):
    assert score_image(image, caption) == expected
    assert read_image(BLANK) is None


def test_every_phrasing_in_any_case_parses_back_to_its_spec_and_unknown_words_are_refused():
    for spec in all_specs() + list(dict.fromkeys(map(sizeless, all_specs()))):  # 324 + 162
        captions = phrasings(spec)
        assert captions[0] == spec.caption and len(set(captions)) == len(captions)
        assert {template_of(caption) for caption in captions} == set(world.TEMPLATES)
        assert all(parse_caption(caption) == spec for caption in captions), spec
    assert len(phrasings(ShapeSpec("large", "red", "circle", "center"))) == 4 * 2 * 2 * 3  # templates, "a", words
    assert ShapeSpec("small", "red", "circle", "top left").caption == "a small red circle at the top left"
    assert sizeless(RED_CIRCLE).caption == "a red circle at the top left"
    assert parse_caption("  Upper LEFT :a  Red circle ") == sizeless(RED_CIRCLE)  # any case and spacing
    assert parse_caption("red circle ,upper left") == sizeless(RED_CIRCLE)
    assert parse_caption("middle: a big blue square") == ShapeSpec("large", "blue", "square", "center")
    assert parse_caption("green triangle in the centre") == ShapeSpec(None, "green", "triangle", "center")
    assert parse_caption("lower right: small cyan circle") == ShapeSpec("small", "cyan", "circle", "bottom right")
    with pytest.raises(ValueError, match=r"Unknown size 'huge'; choose one of \['small', 'large'\]"):
        ShapeSpec("huge", "red", "circle", "top")
    with pytest.raises(ValueError, match="states no size, so it cannot be drawn"):
        render(ShapeSpec(None, "red", "circle", "top"))


FORMS = re.escape(": Expected one of '{object} at the {position}', '{object} in the {position}'")


@pytest.mark.parametrize(
    ("text", "match"),
    [
        *[(text, FORMS) for text in ("an astronaut riding a horse", "red circle top left", "a red circle at top", "")],
        ("a small purple circle at the top", "Unknown colour 'purple'; choose one of .* Expected one of"),
        ("a red circle at the upper", "Unknown position 'upper'"),
    ],
)
def test_foreign_text_is_refused_with_the_expected_forms(text, match):
    with pytest.raises(ValueError, match=f"^{re.escape(repr(text))} is not a shapes-world caption") as error:
        parse_caption(text)
    assert re.search(match, str(error.value)), error.value


def test_held_out_combinations_are_never_trained_and_the_datasets_vary_their_phrasing(tmp_path):
    held_out, train = set(held_out_specs()), set(train_specs())
    assert len(all_specs()) == 2 * 6 * 3 * 9 == len(held_out) + len(train) and not held_out & train
    assert len(HELD_OUT_TRIPLES) == 16 and len(held_out) == 2 * 16  # both sizes of each triple
    assert not HELD_OUT_TRIPLES & set(map(sizeless, train))
    for attribute in ("size", "colour", "shape", "position"):  # SIZES, COLOURS, SHAPES, POSITIONS
        values = set(getattr(world, attribute.upper() + "S"))
        assert {getattr(s, attribute) for s in train} == {getattr(s, attribute) for s in held_out} == values
    dataset = make_dataset("train", num_images=len(train_specs()), seed=0)  # every training combination once
    captions = dataset["text"]
    read = [parse_caption(caption) for caption in captions]
    assert not {sizeless(spec) for spec in read} & HELD_OUT_TRIPLES
    for spec, image in zip(read, dataset["image"][:40]):  # each caption describes its image
        assert all(score_image(image, spec.caption).values())
    assert {template_of(caption) for caption in captions} == set(world.TEMPLATES)
    spec, rng = ShapeSpec("large", "red", "circle", "center"), np.random.default_rng(0)
    assert describe(spec, np.random.default_rng(7)) == describe(spec, np.random.default_rng(7))  # seeded
    assert {parse_caption(describe(sizeless(spec), rng)) for _ in range(50)} == {sizeless(spec)}  # sizeless stays so
    canonical = [caption == spec.caption and spec.size is not None for caption, spec in zip(captions, read)]
    assert 0.3 < np.mean(canonical) < 0.5  # CANONICAL_SHARE plus the draws that land on it
    assert 0.18 < np.mean([spec.size is None for spec in read]) < 0.32  # a quarter leave the size out
    assert {bool(re.search(r"(^|: )a ", caption)) for caption in captions} == {True, False}  # with and without "a"
    words = set(" ".join(captions).replace(",", " ").replace(":", " ").split())
    assert {"big", "upper", "lower", "middle", "centre", "in"} <= words
    # a dataset is deterministic, uses its split and writes an image folder
    first, again = make_dataset("train", num_images=40, seed=3), make_dataset("train", num_images=40, seed=3)
    assert first.column_names == ["image", "text"] and len(first) == 40 and first["text"] == again["text"]
    assert first["text"] != make_dataset("train", num_images=40, seed=4)["text"]
    assert np.array_equal(np.asarray(first[7]["image"]), np.asarray(again[7]["image"]))
    assert first[0]["image"].size == (32, 32) and first[0]["image"].mode == "RGB"
    assert {sizeless(parse_caption(t)) for t in make_dataset("heldout", num_images=64)["text"]} <= HELD_OUT_TRIPLES
    folder = world.write_imagefolder(first, tmp_path / "folder")
    lines = (tmp_path / "folder" / "metadata.jsonl").read_text().splitlines()
    assert len(lines) == 40 and set(json.loads(lines[0])) == {"file_name", "text"}
    loaded = datasets.load_dataset("imagefolder", data_dir=str(folder), split="train")
    assert sorted(loaded["text"]) == sorted(first["text"])


def test_tokenizer_reads_each_world_word_as_one_token_and_the_text_encoder_is_frozen_and_seeded(monkeypatch):
    tokenizer = shapes_tokenizer()
    assert all(len(tokenizer(word, add_special_tokens=False).input_ids) == 1 for word in WORLD_WORDS)
    assert len(tokenizer("zebra", add_special_tokens=False).input_ids) > 1
    assert tokenizer.decode(tokenizer("a zebra").input_ids, skip_special_tokens=True) == "a zebra"
    captions = [caption for spec in all_specs() + list(map(sizeless, all_specs())) for caption in phrasings(spec)]
    ids = tokenizer(captions, add_special_tokens=False).input_ids
    assert [len(i) for i in ids] == [len(re.findall(r"\w+|[,:]", c)) for c in captions]  # "," and ":" are tokens
    assert tokenizer.batch_decode(ids) == [c.replace(",", " ,").replace(":", " :") for c in captions]
    assert max(len(i) + 2 for i in ids) == tokenizer.model_max_length == TEXT_SEQ_LEN == 10  # with bos and eos
    # the text encoder: frozen, deterministic for a seed, and it must read the tokenizer
    ids = tokenizer(["a small red circle at the top", "a large blue square at the left"], padding="max_length")
    encoder, ids = shapes_text_encoder(tokenizer, seed=0), torch.tensor(ids.input_ids)
    assert not any(p.requires_grad for p in encoder.parameters())
    states = encoder(ids)[0]
    assert states.shape == (2, 10, 64) and not torch.allclose(states[0], states[1])
    torch.testing.assert_close(shapes_text_encoder(tokenizer, seed=0)(ids)[0], states, rtol=0, atol=0)
    monkeypatch.setattr("diffusers_lmlp.shapes.text.WORLD_WORDS", (*WORLD_WORDS, "purple"))
    with pytest.raises(ValueError, match="retrain it with scripts/train_shapes_text_encoder.py"):
        shapes_components()


@pytest.mark.slow
def test_committed_vae_keeps_the_shapes_of_held_out_renders():
    # docs/training.md's VAE table on 800 held-out renders (shape 99.0%, PSNR 47.0 dB, foreground 35.0 dB); 384 here
    _, _, vae = shapes_components()
    images, captions = held_out_renders(num_per_spec=12)
    report = reconstruction_report(vae, images, captions)
    assert min(report[key] for key in ("colour", "position", "size")) >= 0.995, report
    assert report["shape"] >= 0.985 and report["psnr"] >= 46.0 and report["foreground psnr"] >= 34.0, report
    latents = vae.encode(to_pixels(images[:64])).latent_dist.mode()  # (64, 8, 8, 8)
    assert 0.5 < (latents * vae.config.scaling_factor).std() < 2.0  # the scaling factor normalises the latents
    assert sum(f.stat().st_size for f in VAE_PATH.iterdir()) < 3_000_000  # a few MB in the package


def test_foreground_psnr_counts_the_shape_pixels_only():
    target = to_pixels(held_out_renders(num_per_spec=1)[0][:4])
    mask, damaged = foreground_mask(target), target.clone()
    damaged[mask.expand_as(target)] = 0.0  # the shapes turn mid-grey; the background is kept
    overall, foreground = psnr(damaged, target), psnr(damaged, target, mask)  # 25.9 and 11.4 dB
    assert overall < 30.0 and foreground < 15.0 and overall - foreground > 10.0
    assert psnr(target, target, mask) == 100.0  # error floored at 1e-10


@pytest.mark.slow
def test_shipped_pipeline_draws_colour_and_position_in_any_phrasing():
    pipe, rng = pretrained_shapes_pipeline(), np.random.default_rng(0)
    pipe.set_progress_bar_config(disable=True)
    same = ["a red circle at the top left", "red circle, top left", "a small red circle at the top left",
            "upper left: a red circle"]  # fmt: skip
    for specs in (train_specs()[::24], held_out_specs()):  # a random phrasing of each, at 12 steps
        captions = [describe(spec, rng) for spec in specs]
        images = pipe(captions + same, num_inference_steps=12, generator=torch.Generator().manual_seed(0)).images
        assert images[0].size == (32, 32)
        scores = score_images(images[: len(captions)], captions)
        assert scores["colour+position"] >= 0.9, (scores, captions)
        assert {(read_image(image)["position"], read_image(image)["colour"]) for image in images[-4:]} == {
            ("top left", "red")}  # fmt: skip


SEED = 2024  # training used seed 0 and evaluation seed 1000 (`scripts/train_shapes_features.py`): these are new


def renders(specs: list[ShapeSpec], seed: int, image_size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Jittered renders (N, 3, S, S) in [0, 1] and their (N, 4) labels, a column per attribute of `ATTRIBUTES`."""
    rng = np.random.default_rng(seed)
    pixels = np.stack([np.asarray(render(spec, image_size, rng), dtype=np.float32) for spec in specs])  # (N, S, S, 3)
    labels = [[values.index(getattr(spec, name)) for name, values in ATTRIBUTES.items()] for spec in specs]
    return torch.from_numpy(pixels / 255).permute(0, 3, 1, 2).contiguous(), torch.tensor(labels)


def some_specs(count: int, seed: int) -> list[ShapeSpec]:
    return [all_specs()[i] for i in np.random.default_rng(seed).integers(0, len(all_specs()), count)]


@pytest.fixture(scope="module")
def network() -> ShapesFeatureNetwork:
    return pretrained_shapes_features()


def test_shipped_network_loads_offline_gives_deterministic_per_image_features_and_saves_them(network, tmp_path):
    assert not network.training and network.num_features == 128 and network.name == "shapes-features"
    assert sum(p.numel() for p in network.parameters()) < 150_000  # a few hundred KB of fp32 weights
    images, _ = renders(some_specs(8, SEED), SEED)
    features = network(images)
    assert features.shape == (8, 128) and features.dtype == torch.float32 and torch.equal(features, network(images))
    torch.testing.assert_close(network(images[:3]), features[:3], rtol=1e-5, atol=1e-6)  # whatever the batch
    network.save_pretrained(tmp_path)
    saved = {path.name for path in tmp_path.iterdir()}
    assert saved == {"config.json", "diffusion_pytorch_model.safetensors"} <= set(os.listdir(FEATURES_PATH))
    loaded = ShapesFeatureNetwork.from_pretrained(tmp_path).eval()
    config = lambda model: {k: v for k, v in model.config.items() if k != "_name_or_path"}  # noqa: E731
    assert config(loaded) == config(network) and torch.equal(loaded(images), network(images))
    assert all(torch.equal(loaded.classify(images)[k], v) for k, v in network.classify(images).items())


@pytest.mark.parametrize(("count", "seed", "image_size"), [(216, SEED, 32), (108, SEED + 1, 64)])
def test_reads_every_attribute_of_fresh_renders_at_32_and_64_pixels(network, count, seed, image_size):
    images, labels = renders(some_specs(count, seed), seed, image_size)
    assert network(images).shape == (count, network.num_features)
    logits = network.classify(images)
    right = {name: (logits[name].argmax(1) == labels[:, i]).float().mean().item() for i, name in enumerate(ATTRIBUTES)}
    assert min(right.values()) >= 0.98, right


def test_a_64_pixel_upsampled_image_gives_nearly_the_32_pixel_features_and_bad_images_are_refused(network):
    small, _ = renders(some_specs(108, SEED + 1), SEED + 1)
    upsampled = small.repeat_interleave(2, dim=2).repeat_interleave(2, dim=3)  # (N, 3, 64, 64)
    features = network(small)  # (N, num_features)
    relative = (network(upsampled) - features).norm(dim=1) / features.norm(dim=1)  # (N,)
    assert relative.max() < 0.15, relative.max()
    for bad in [small[0], small[:, :1], torch.rand(2, 4, 32, 32), small.permute(0, 2, 3, 1), small.to(torch.uint8)]:
        with pytest.raises(ValueError, match=r"float tensor of shape \(B, 3, H, W\)"):  # 3-d, grey, RGBA, HWC, uint8
            network.classify(bad)
