"""benchmarks/scorer_agreement.py: an independent second reader of shapes images, its comparison and its command."""

import ast
import json
import shlex
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from benchmark_scripts import load_benchmark
from documents import ROOT, block
from PIL import Image

from diffusers_lmlp.shapes.scorer import parse_caption
from diffusers_lmlp.shapes.world import BACKGROUND, ShapeSpec, all_specs, held_out_specs, render, train_specs


SCRIPT = ROOT / "benchmarks" / "scorer_agreement.py"
agreement = load_benchmark("scorer_agreement")
ATTRIBUTES = ("colour", "shape", "position", "size")


@pytest.mark.parametrize("image_size", [32, 64])
def test_the_second_reader_reads_every_combination_and_tells_the_shapes_apart_by_wide_margins(image_size):
    rng = np.random.default_rng(image_size)  # jittered centres and sizes, as the training images are
    drop, fill = {}, {}
    for shape in all_specs():
        reading = agreement.read_shape(render(shape, image_size=image_size, rng=rng))
        assert {key: reading[key] for key in ATTRIBUTES} == {key: getattr(shape, key) for key in ATTRIBUTES}, shape
        drop.setdefault(shape.shape, []).append(reading["drop"])
        fill.setdefault(shape.shape, []).append(reading["fill"])
    drop, fill = ({name: np.array(values) for name, values in found.items()} for found in (drop, fill))
    # A triangle's outline lies low in its box (1/6 of its height in theory), a circle's and a square's do not.
    assert drop["triangle"].min() > 0.08 > 0.04 > max(abs(drop["circle"]).max(), abs(drop["square"]).max())
    # A circle fills π/4 of its box, a square all of it.
    assert abs(np.median(fill["circle"]) - np.pi / 4) < 0.02 and fill["circle"].max() < 0.87
    assert fill["square"].min() > 0.93


def test_an_image_without_a_shape_is_read_as_nothing_and_scored_wrong_on_every_attribute():
    assert agreement.read_shape(Image.new("RGB", (32, 32), BACKGROUND)) is None
    nothing = dict.fromkeys(ATTRIBUTES, False)
    assert agreement.verdicts(None, ShapeSpec("small", "red", "circle", "top left")) == nothing
    assert agreement.verdicts(None, ShapeSpec(None, "red", "circle", "top")) == dict.fromkeys(ATTRIBUTES[:3], False)


def test_the_reader_imports_nothing_of_the_package():
    # Only the functions that sample and compare import diffusers_lmlp, inside themselves.
    tree = ast.parse(SCRIPT.read_text(encoding="utf-8"))
    imports = [node for node in tree.body if isinstance(node, ast.Import | ast.ImportFrom)]
    modules = [getattr(node, "module", None) or alias.name for node in imports for alias in node.names]
    assert not [module for module in modules if module.startswith("diffusers_lmlp")], modules
    reader = next(node for node in tree.body if getattr(node, "name", None) == "read_shape")
    assert not [node for node in ast.walk(reader) if isinstance(node, ast.Import | ast.ImportFrom)]


def test_the_summary_counts_each_scorer_and_their_agreement():
    right, wrong_shape = dict.fromkeys(ATTRIBUTES, True), {**dict.fromkeys(ATTRIBUTES, True), "shape": False}
    pairs = [(right, right), (right, wrong_shape), (wrong_shape, wrong_shape), ({**right, "position": False}, right)]
    records = [{"package": package, "independent": independent} for package, independent in pairs]
    assert agreement.summary(records) == {
        "package": {"colour": 1.0, "shape": 0.75, "position": 0.75, "size": 1.0, "colour+position": 0.75, "all": 0.5},
        "independent": {"colour": 1.0, "shape": 0.5, "position": 1.0, "size": 1.0, "colour+position": 1.0, "all": 0.5},
        "agree": {"colour": 1.0, "shape": 0.75, "position": 0.75, "size": 1.0, "colour+position": 0.75, "all": 0.5},
    }


def test_its_captions_are_its_own_draw_of_the_held_out_and_training_combinations():
    captions = agreement.own_captions(1128)
    assert [shape for shape, _ in captions["held-out"]] == held_out_specs()
    assert len(captions["train"]) == 32 and {shape for shape, _ in captions["train"]} <= set(train_specs())
    for shape, caption in captions["held-out"] + captions["train"]:
        assert parse_caption(caption) == shape, caption
    assert len({caption for _, caption in captions["held-out"]}) == 32
    assert captions == agreement.own_captions(1128) and captions != agreement.own_captions(1129)


@pytest.mark.slow
def test_the_documented_command_samples_scores_and_writes_its_results(tmp_path):
    argv = shlex.split(block("docs/evaluation.md", "A second scorer"))
    assert argv == ["python", "benchmarks/scorer_agreement.py"]
    defaults = agreement.parse_args(argv[2:])
    assert defaults.images_per_caption == (4, 3) and defaults.num_inference_steps is defaults.guidance_scale is None
    short = ["--num_inference_steps", "2", "--images_per_caption", "1", "1", "--output_dir", str(tmp_path / "out")]
    command = [sys.executable, str(ROOT / argv[1]), *short]
    result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "results.json").read_text(encoding="utf-8"))
    assert {split: len(images) for split, images in report["images"].items()} == {"held-out": 32, "train": 32}
    assert report["num_inference_steps"] == 2 and report["guidance_scale"] == 2.0 and report["seed"] == 1128
    for split in ("held-out", "train"):
        renders = report["references"]["render"][split]
        assert renders["package"]["all"] == 1.0 == renders["independent"]["all"]  # the world's own images
        assert set(report["references"]["round trip"][split]) == {"package", "independent", "agree"}
        assert f"| {split} | agree |" in result.stdout
        assert f"round trips of the {split} combinations, same seeds: all four" in result.stdout
    differ = sum(image["package"] != image["independent"] for images in report["images"].values() for image in images)
    assert f"{differ} images on which the two scorers differ" in result.stdout
    assert (tmp_path / "out" / "disagreements.png").is_file() == (differ > 0)
    assert "| split | shape asked for | images | median fill: samples | renders | round trips |" in result.stdout
    for split, by_shape in report["median_fills"].items():  # the renders': π/4 for a circle, all of a square
        assert abs(by_shape["circle"]["render"] - np.pi / 4) < 0.03 and by_shape["square"]["render"] > 0.93
        for shape, row in by_shape.items():  # test_the_median_fills_are_taken_per_shape checks the medians
            images = [image for image in report["images"][split] if image["shape"] == shape]
            assert row["images"] == len(images) and f"| {split} | {shape} | {len(images)} | " in result.stdout
        assert set(by_shape) == {"circle", "square", "triangle"}


class StubPipeline:
    """Draws a render per caption and records its sampler settings; its VAE is the identity."""

    vae = SimpleNamespace(dtype=torch.float32, decode=lambda z: SimpleNamespace(sample=z),
                          encode=lambda x: SimpleNamespace(latent_dist=SimpleNamespace(mode=lambda: x)))  # fmt: skip

    def __init__(self):
        self.calls = []

    def __call__(self, prompt, num_inference_steps: int = 50, guidance_scale: float = 2.0, generator=None):
        self.calls.append({"num_inference_steps": num_inference_steps, "guidance_scale": guidance_scale})
        return SimpleNamespace(images=[render(ShapeSpec("small", "red", "square", "top"))] * len(prompt))


SETTINGS = [([], 50, 2.0), (["--guidance_scale", "3.5", "--num_inference_steps", "7"], 7, 3.5),
            (["--guidance_scale", "1"], 50, 1.0)]  # fmt: skip


@pytest.mark.parametrize("options, steps, guidance", SETTINGS)
def test_the_sampler_settings_reach_the_pipeline(options, steps, guidance):
    pipe, args = StubPipeline(), agreement.parse_args(options)
    sampler = {"num_inference_steps": steps, "guidance_scale": guidance}
    items = [(ShapeSpec("small", "red", "square", "top"), "a small red square at the top", seed) for seed in range(3)]
    records = agreement.sample_and_score(pipe, items, args)
    assert pipe.calls == [sampler] and all(record["independent"]["shape"] for record in records)
    # the stub draws an unjittered render, and its VAE gives each seed's render back unchanged
    drawn = agreement.read_shape(render(ShapeSpec("small", "red", "square", "top")))["fill"]
    for record in records:
        assert record["shape"] == "square" and record["fill"]["sample"] == drawn > 0.93
        assert record["fill"]["render"] == record["fill"]["round trip"] > 0.93


def test_the_median_fills_are_taken_per_shape_over_the_images_that_show_one():
    # A square with nothing drawn is left out of the samples' median only; no triangle sample shows one: no median.
    fills = [("square", 0.90, 0.98, 0.95), ("square", 0.80, 0.99, 0.96), ("square", None, 0.97, 0.94),
             ("circle", 0.85, 0.78, 0.80), ("triangle", None, 0.60, 0.61)]  # fmt: skip
    records = [{"shape": shape, "fill": dict(zip(("sample", "render", "round trip"), f))} for shape, *f in fills]
    fills = agreement.median_fills(records)
    assert fills == {
        "circle": {"images": 1, "sample": 0.85, "render": 0.78, "round trip": 0.8},
        "square": {"images": 3, "sample": 0.85, "render": 0.98, "round trip": 0.95},
        "triangle": {"images": 1, "sample": None, "render": 0.6, "round trip": 0.61},
    }
    json.loads(json.dumps(fills, allow_nan=False))
    table = agreement.fill_table({"held-out": fills}).splitlines()
    assert "| held-out | square | 3 | 0.850 | 0.980 | 0.950 |" in table
    assert "| held-out | triangle | 1 | — | 0.600 | 0.610 |" in table
