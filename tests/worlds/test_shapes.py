"""The shapes world: renders, splits, datasets, the scorer, the offline text side and the committed VAE."""

import json
import re
from dataclasses import replace

import datasets
import numpy as np
import pytest
import torch
from PIL import Image, ImageFilter

from diffusers_lmlp.shapes.autoencoder import (
    foreground_mask,
    held_out_renders,
    psnr,
    reconstruction_report,
    to_pixels,
)
from diffusers_lmlp.shapes.pretrained import pretrained_shapes_pipeline
from diffusers_lmlp.shapes.scorer import CAPTIONS, accuracies, parse_caption, read_image, score_image, score_images
from diffusers_lmlp.shapes.text import (
    TEXT_SEQ_LEN,
    VAE_PATH,
    WORLD_WORDS,
    shapes_components,
    shapes_text_encoder,
    shapes_tokenizer,
)
from diffusers_lmlp.shapes.world import (
    COLOURS,
    POSITION_WORDS,
    POSITIONS,
    SHAPES,
    SIZES,
    TEMPLATES,
    ShapeSpec,
    all_specs,
    describe,
    held_out_specs,
    make_dataset,
    phrasings,
    render,
    train_specs,
    write_imagefolder,
)


def sizeless(spec: ShapeSpec) -> ShapeSpec:
    """What a caption that leaves the size unstated says of `spec`."""
    return replace(spec, size=None)


def template_of(caption: str) -> str:
    """The template a world caption is phrased in."""
    return next(template for template, pattern in zip(TEMPLATES, CAPTIONS) if pattern.fullmatch(caption))


@pytest.mark.slow
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


def test_a_caption_is_scored_only_on_what_it_states():
    image = render(ShapeSpec("large", "red", "circle", "top left"))
    assert score_image(image, "red circle, upper left") == dict.fromkeys(["colour", "shape", "position"], True)
    assert score_image(image, "bottom: a blue circle") == {"colour": False, "shape": True, "position": False}
    assert score_image(Image.new("RGB", (32, 32), (128, 128, 128)), "red circle, top left") == dict.fromkeys(
        ["colour", "shape", "position"], False
    )


def test_accuracies_count_each_attribute_over_the_captions_that_state_it():
    results = [
        {"colour": True, "shape": True, "position": True, "size": True},
        {"colour": True, "shape": True, "position": True},  # a caption without size
        {"colour": True, "shape": False, "position": True, "size": False},
        {"colour": False, "shape": True, "position": True},
    ]
    assert accuracies(results) == {
        "colour": 0.75, "shape": 0.75, "position": 1.0, "size": 0.5, "colour+position": 0.75, "all": 0.5,
    }  # fmt: skip
    assert "size" not in accuracies(results[1::2]) and accuracies(results[1::2])["all"] == 0.5


def test_every_phrasing_of_every_spec_parses_back_to_it():
    specs = all_specs() + list(dict.fromkeys(map(sizeless, all_specs())))  # 324 + 162
    for spec in specs:
        captions = phrasings(spec)
        assert captions[0] == spec.caption and len(set(captions)) == len(captions)
        assert {template_of(caption) for caption in captions} == set(TEMPLATES)
        for caption in captions:
            assert parse_caption(caption) == spec, caption
    assert len(phrasings(ShapeSpec("large", "red", "circle", "center"))) == 4 * 2 * 2 * 3  # templates, "a", words
    assert ShapeSpec("small", "red", "circle", "top left").caption == "a small red circle at the top left"
    assert sizeless(ShapeSpec("small", "red", "circle", "top left")).caption == "a red circle at the top left"


def test_the_issues_phrasings_name_the_same_shape_whatever_the_case_and_spacing():
    read = [parse_caption(text) for text in (
        "a red circle at the top left", "red circle, top left", "a small red circle at the top left",
        "  Upper LEFT :a  Red circle ", "red circle ,upper left",
    )]  # fmt: skip
    assert {(spec.colour, spec.shape, spec.position) for spec in read} == {("red", "circle", "top left")}
    assert [spec.size for spec in read] == [None, None, "small", None, None]
    assert parse_caption("middle: a big blue square") == ShapeSpec("large", "blue", "square", "center")
    assert parse_caption("green triangle in the centre") == ShapeSpec(None, "green", "triangle", "center")
    assert parse_caption("lower right: small cyan circle") == ShapeSpec("small", "cyan", "circle", "bottom right")


def test_foreign_text_is_refused_with_the_expected_forms():
    forms = "Expected one of '{object} at the {position}', '{object} in the {position}', '{object}, {position}', "
    for text in ("an astronaut riding a horse", "red circle top left", "a small red circle at top left", ""):
        with pytest.raises(
            ValueError, match=f"^{re.escape(repr(text))} is not a shapes-world caption: {re.escape(forms)}"
        ):
            parse_caption(text)
    with pytest.raises(ValueError, match="Unknown colour 'purple'; choose one of .* Expected one of"):
        parse_caption("a small purple circle at the top")
    with pytest.raises(ValueError, match="Unknown position 'upper'"):
        parse_caption("a red circle at the upper")
    with pytest.raises(ValueError, match=r"Unknown size 'huge'; choose one of \['small', 'large'\]"):
        ShapeSpec("huge", "red", "circle", "top")
    with pytest.raises(ValueError, match="states no size, so it cannot be drawn"):
        render(ShapeSpec(None, "red", "circle", "top"))


def test_held_out_combinations_are_never_trained_with_or_without_size_but_every_value_is():
    held_out, train = set(held_out_specs()), set(train_specs())
    assert len(all_specs()) == 2 * 6 * 3 * 9 == len(held_out) + len(train)
    assert held_out and not held_out & train
    held_out_triples = set(map(sizeless, held_out))
    assert len(held_out_triples) == 16 and len(held_out) == 2 * 16  # both sizes of each triple
    assert not held_out_triples & set(map(sizeless, train))
    for attribute, values in (("size", SIZES), ("colour", COLOURS), ("shape", SHAPES), ("position", POSITIONS)):
        assert {getattr(s, attribute) for s in train} == set(values)
        assert {getattr(s, attribute) for s in held_out} == set(values)


def test_dataset_is_deterministic_and_uses_its_split(tmp_path):
    first, again = make_dataset("train", num_images=40, seed=3), make_dataset("train", num_images=40, seed=3)
    assert first.column_names == ["image", "text"] and len(first) == 40
    assert first["text"] == again["text"]
    assert first["text"] != make_dataset("train", num_images=40, seed=4)["text"]
    assert np.array_equal(np.asarray(first[7]["image"]), np.asarray(again[7]["image"]))
    assert first[0]["image"].size == (32, 32) and first[0]["image"].mode == "RGB"
    held_out_triples = set(map(sizeless, held_out_specs()))
    assert {sizeless(parse_caption(t)) for t in make_dataset("heldout", num_images=64)["text"]} <= held_out_triples

    folder = write_imagefolder(first, tmp_path / "folder")
    lines = (tmp_path / "folder" / "metadata.jsonl").read_text().splitlines()
    assert len(lines) == 40 and set(json.loads(lines[0])) == {"file_name", "text"}
    loaded = datasets.load_dataset("imagefolder", data_dir=str(folder), split="train")
    assert sorted(loaded["text"]) == sorted(first["text"])


def test_training_captions_vary_their_phrasing_and_never_name_a_held_out_triple():
    dataset = make_dataset("train", num_images=len(train_specs()), seed=0)  # every training combination once
    captions, images = dataset["text"], dataset["image"]
    read = [parse_caption(caption) for caption in captions]
    held_out_triples = set(map(sizeless, held_out_specs()))
    assert not {sizeless(spec) for spec in read} & held_out_triples
    for spec, image in zip(read, images[:40]):  # each caption describes its image
        assert all(score_image(image, spec.caption).values())
    assert {template_of(caption) for caption in captions} == set(TEMPLATES)
    canonical = [
        caption == replace(spec, size=spec.size).caption and spec.size for caption, spec in zip(captions, read)
    ]
    assert 0.3 < np.mean([bool(c) for c in canonical]) < 0.5  # CANONICAL_SHARE plus the draws that land on it
    assert 0.18 < np.mean([spec.size is None for spec in read]) < 0.32  # a quarter leave the size out
    assert {bool(re.search(r"(^|: )a ", caption)) for caption in captions} == {True, False}  # with and without "a"
    words = set(" ".join(captions).replace(",", " ").replace(":", " ").split())
    assert {"big", "upper", "lower", "middle", "centre", "in"} <= words


def test_describe_is_seeded_and_keeps_a_sizeless_spec_sizeless():
    spec = ShapeSpec("large", "red", "circle", "center")
    draws = [describe(spec, np.random.default_rng(7)) for _ in range(2)]
    assert draws[0] == draws[1]
    rng = np.random.default_rng(0)
    assert all(parse_caption(describe(sizeless(spec), rng)) == sizeless(spec) for _ in range(50))
    assert set(POSITION_WORDS) == set(POSITIONS)


def test_tokenizer_has_one_token_per_world_word_and_still_reads_other_words():
    tokenizer = shapes_tokenizer()
    for word in WORLD_WORDS:
        assert len(tokenizer(word, add_special_tokens=False).input_ids) == 1, word
    assert len(tokenizer("zebra", add_special_tokens=False).input_ids) > 1
    assert tokenizer.decode(tokenizer("a zebra").input_ids, skip_special_tokens=True) == "a zebra"


@pytest.mark.slow
def test_every_phrasing_fits_the_text_length_one_token_per_word():
    tokenizer = shapes_tokenizer()
    lengths = []
    for spec in all_specs() + list(map(sizeless, all_specs())):
        for caption in phrasings(spec):
            ids = tokenizer(caption, add_special_tokens=False).input_ids
            assert len(ids) == len(re.findall(r"\w+|[,:]", caption)), caption  # "," and ":" are tokens too
            assert tokenizer.decode(ids) == caption.replace(",", " ,").replace(":", " :")
            lengths.append(len(ids) + 2)  # bos and eos
    assert max(lengths) == tokenizer.model_max_length == TEXT_SEQ_LEN == 10


def test_text_encoder_architecture_is_frozen_and_deterministic_for_a_seed():
    tokenizer = shapes_tokenizer()
    ids = tokenizer(["a small red circle at the top", "a large blue square at the left"], padding="max_length",
                    return_tensors="pt").input_ids  # fmt: skip
    encoder = shapes_text_encoder(tokenizer, seed=0)
    assert not any(p.requires_grad for p in encoder.parameters())
    states = encoder(ids)[0]
    assert states.shape == (2, 10, 64)
    torch.testing.assert_close(shapes_text_encoder(tokenizer, seed=0)(ids)[0], states, rtol=0, atol=0)
    assert not torch.allclose(states[0], states[1])


def last_states(encoder, tokenizer, specs) -> tuple[torch.Tensor, list[ShapeSpec]]:
    """The encoder's state at the last position for every phrasing of `specs`, and what each phrasing states."""
    captions = [caption for spec in specs for caption in phrasings(spec)]
    ids = tokenizer(captions, padding="max_length", max_length=tokenizer.model_max_length, return_tensors="pt")
    with torch.no_grad():
        return encoder(ids.input_ids)[0][:, -1], [parse_caption(caption) for caption in captions]  # (N, 64)


@pytest.mark.slow
def test_shipped_text_encoder_reads_any_phrasing_of_held_out_combinations():
    # Nearest class centroid of the training phrasings' last states, on every phrasing of the held-out combinations
    # (none seen in pretraining): each attribute is read whatever the word order, article, size or synonyms.
    tokenizer, encoder, _ = shapes_components()
    assert not any(p.requires_grad for p in encoder.parameters())
    train, train_stated = last_states(encoder, tokenizer, train_specs())
    held_out, held_out_stated = last_states(encoder, tokenizer, held_out_specs())
    for attribute in ("colour", "shape", "position"):
        classes = sorted({getattr(spec, attribute) for spec in train_stated})
        centroids = torch.stack([train[[getattr(s, attribute) == c for s in train_stated]].mean(0) for c in classes])
        nearest = torch.cdist(held_out, centroids).argmin(dim=1).tolist()
        right = [classes[i] == getattr(spec, attribute) for i, spec in zip(nearest, held_out_stated)]
        assert np.mean(right) >= 0.99, attribute


def test_components_refuse_a_text_encoder_that_does_not_read_the_tokenizer(monkeypatch):
    monkeypatch.setattr("diffusers_lmlp.shapes.text.WORLD_WORDS", (*WORLD_WORDS, "purple"))
    with pytest.raises(ValueError, match="retrain it with scripts/train_shapes_text_encoder.py"):
        shapes_components()


@pytest.mark.slow
def test_committed_vae_keeps_the_shapes_of_held_out_renders():
    _, _, vae = shapes_components()
    # The 800 renders of docs/training.md's VAE table (25 of each held-out combination, which the VAE never trained on),
    # measured there at commit: colour, position and size 100%, shape 99.0%, PSNR 47.0 dB, foreground 35.0 dB. The
    # decoder's second stage (noisy latents) costs a little on exact ones: shape 99.4% before it, the margin here.
    images, captions = held_out_renders()
    report = reconstruction_report(vae, images, captions)
    assert min(report[key] for key in ("colour", "position", "size")) >= 0.995, report
    assert report["shape"] >= 0.985, report
    assert report["psnr"] >= 46.0 and report["foreground psnr"] >= 34.0, report
    with torch.no_grad():
        latents = vae.encode(to_pixels(images[:64])).latent_dist.mode()  # (64, 8, 8, 8)
    assert 0.5 < (latents * vae.config.scaling_factor).std() < 2.0  # the scaling factor normalises the latents
    weights = sum(f.stat().st_size for f in VAE_PATH.iterdir())
    assert weights < 3_000_000  # a few MB in the package


def test_foreground_psnr_counts_the_shape_pixels_only():
    images, captions = held_out_renders(num_per_spec=1)
    target = to_pixels(images[:4])
    damaged = target.clone()
    damaged[foreground_mask(target).expand_as(target)] = 0.0  # the shapes turn mid-grey; the background is kept
    overall, foreground = psnr(damaged, target), psnr(damaged, target, foreground_mask(target))  # 25.9 and 11.4 dB
    assert overall < 30.0 and foreground < 15.0 and overall - foreground > 10.0
    assert psnr(target, target, foreground_mask(target)) == 100.0  # error floored at 1e-10


@pytest.mark.slow
def test_shipped_pipeline_draws_colour_and_position_in_any_phrasing():
    pipe = pretrained_shapes_pipeline()
    pipe.set_progress_bar_config(disable=True)
    # At the pipeline's defaults, as a user samples it. The model card's figures (3-4 seeds of 32 captions per split):
    # colour+position 100% on training captions and 98% on held-out ones.
    rng = np.random.default_rng(0)
    for specs in (train_specs()[::12], held_out_specs()):
        captions = [describe(spec, rng) for spec in specs]  # a random phrasing of each
        images = pipe(captions, generator=torch.Generator().manual_seed(0)).images
        assert images[0].size == (32, 32)
        scores = score_images(images, captions)
        assert scores["colour+position"] >= 0.9, (scores, captions)
    # The issue's example: the size and "at the" are optional, and the word order does not move the shape.
    captions = ["a red circle at the top left", "red circle, top left", "a small red circle at the top left",
                "upper left: a red circle"]  # fmt: skip
    images = pipe(captions, generator=torch.Generator().manual_seed(0)).images
    assert [read_image(image)["position"] for image in images] == ["top left"] * 4
    assert [read_image(image)["colour"] for image in images] == ["red"] * 4
