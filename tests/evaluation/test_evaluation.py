"""FID, its reference statistics, the caption draws and `evaluate`, against independent references and offline."""

import inspect
import json
import os
import shutil
import sys
import types
from pathlib import Path
from unittest import mock

import datasets
import numpy as np
import pytest
import torch
from coco_fixture import write_coco2014
from PIL import Image, ImageFilter
from safetensors import safe_open
from safetensors.torch import save_file
from torchmetrics.image.fid import FrechetInceptionDistance

from diffusers_lmlp import LMLPPipeline
from diffusers_lmlp.durable import hold_lock
from diffusers_lmlp.evaluation import Processes, draw_captions, evaluate, frechet_distance, load_extractor
from diffusers_lmlp.evaluation.evaluate import image_seed
from diffusers_lmlp.evaluation.fid import FeatureMoments, FIDStatistics, InceptionFeatures, image_features
from diffusers_lmlp.evaluation.resume import EvaluationInterrupted, remove_progress
from diffusers_lmlp.image_tensors import images_to_tensor
from diffusers_lmlp.shapes import pretrained_shapes_pipeline
from diffusers_lmlp.shapes.scorer import ShapesScorer, accuracies, parse_caption, read_image, score_image
from diffusers_lmlp.shapes.world import ShapeSpec, all_specs, render


class TinyFeatures(torch.nn.Module):
    """A fixed random conv net: (B, 3, H, W) in [0, 1] → (B, 16) pooled ReLU features."""

    num_features = 16

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(3, 16, 3, padding=1)

    def forward(self, images):
        return torch.relu(self.conv(images * 2 - 1)).mean(dim=(2, 3))


def renders(num_images: int, seed: int) -> list[Image.Image]:
    """Real shapes-world images of every combination in turn, with seeded jitter."""
    rng, specs = np.random.default_rng(seed), all_specs()
    return [render(specs[i % len(specs)], rng=rng) for i in range(num_images)]


def corrupt(images, noise: float = 0.0, blur: float = 0.0) -> list[Image.Image]:
    rng, out = np.random.default_rng(0), []
    for image in images:
        image = image.filter(ImageFilter.GaussianBlur(blur)) if blur else image
        pixels = np.asarray(image, np.float32) + rng.normal(0, noise * 255, (32, 32, 3))
        out.append(Image.fromarray(np.clip(np.round(pixels), 0, 255).astype(np.uint8)))
    return out


def statistics_of(extractor, images) -> FIDStatistics:
    moments = FeatureMoments(extractor.num_features)
    moments.update(image_features(extractor, images_to_tensor(images)))
    return moments.statistics(getattr(extractor, "name", None))


def png(path, dtype=np.uint8) -> np.ndarray:
    return np.asarray(Image.open(path), dtype)


def without_seconds(report: dict) -> dict:
    return {key: value for key, value in report.items() if key != "seconds"}


@pytest.fixture(scope="module")
def pipe(one_thread):
    return pretrained_shapes_pipeline()


def test_fid_is_the_closed_form_for_diagonal_covariances_equals_torchmetrics_and_its_moments_add_up_in_parts():
    rng = np.random.default_rng(0)
    mu1, mu2, var1, var2 = rng.normal(size=5), rng.normal(size=5), rng.uniform(0.1, 2, 5), rng.uniform(0.1, 2, 5)
    expected = ((mu1 - mu2) ** 2).sum() + ((np.sqrt(var1) - np.sqrt(var2)) ** 2).sum()
    actual = frechet_distance(FIDStatistics(mu1, np.diag(var1)), FIDStatistics(mu2, np.diag(var2)))
    assert actual == pytest.approx(expected, rel=1e-10)
    extractor = TinyFeatures()
    real, fake = renders(64, seed=1), corrupt(renders(48, seed=2), noise=0.3, blur=1)
    reference = FrechetInceptionDistance(feature=extractor, normalize=True, input_img_size=(3, 32, 32))
    reference.update(images_to_tensor(real), real=True)
    reference.update(images_to_tensor(fake), real=False)
    real, fid = statistics_of(extractor, real), float(reference.compute())
    assert frechet_distance(statistics_of(extractor, fake), real) == pytest.approx(fid, rel=1e-5) and fid > 0.01
    assert abs(frechet_distance(real, real)) < 1e-9
    # The moments give numpy's mean and covariance, the same in parts, and refuse NaN.
    features = torch.randn(37, 6, generator=torch.Generator().manual_seed(0)) * 3 + 1
    whole, parts = FeatureMoments(6), FeatureMoments(6)
    whole.update(features)
    for part in features.split(10):
        parts.update(part)
    for moments in (whole, parts):
        statistics = moments.statistics("tiny")
        np.testing.assert_allclose(statistics.mu, features.double().mean(0).numpy(), rtol=1e-12)
        np.testing.assert_allclose(statistics.sigma, np.cov(features.double().numpy(), rowvar=False), rtol=1e-10)
        assert statistics.num_images == 37 and statistics.extractor == "tiny"
    moments = FeatureMoments(4)
    with pytest.raises(FloatingPointError, match="NaN"):
        moments.update(torch.tensor([[0.0, float("nan"), 0.0, 0.0]]))
    with pytest.raises(ValueError, match=r"expected \(batch, 4\)"):
        moments.update(torch.zeros(2, 5))
    with pytest.raises(ValueError, match="at least 2 images"):
        moments.statistics()


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "levels"), [("noise", [0, 0.05, 0.1, 0.2, 0.4]), ("blur", [0, 0.5, 1, 1.5, 2.5])])
def test_shapes_fid_grows_monotonically_with_corruption(kind, levels):
    extractor = load_extractor("shapes")
    reference, images = statistics_of(extractor, renders(200, seed=4)), renders(200, seed=5)
    fids = [frechet_distance(statistics_of(extractor, corrupt(images, **{kind: x})), reference) for x in levels]
    assert fids == sorted(fids) and fids[-1] > 10 * fids[0], fids


def test_statistics_round_trip_in_pytorch_fids_format(tmp_path):
    a = np.random.default_rng(0).normal(size=(8, 9))
    FIDStatistics(a[:, 8], a[:, :8] @ a[:, :8].T, 123, "tiny").save(tmp_path / "stats.npz")
    loaded = FIDStatistics.load(tmp_path / "stats.npz")
    np.testing.assert_array_equal(loaded.sigma, a[:, :8] @ a[:, :8].T)
    assert (loaded.num_images, loaded.extractor) == (123, "tiny")
    # A file as pytorch-fid and U-ViT write and read it: mu and sigma only.
    np.savez(tmp_path / "fid_stats_mscoco256_val.npz", mu=loaded.mu, sigma=loaded.sigma)
    plain = FIDStatistics.load(tmp_path / "fid_stats_mscoco256_val.npz")
    assert plain.num_images is None and plain.extractor is None
    with np.load(tmp_path / "stats.npz") as f:
        np.testing.assert_array_equal(f["mu"][:], plain.mu)


class Payload:
    def __reduce__(self):  # unpickling this touches a marker file
        return (Path.touch, (Path(os.environ["MARKER"]),))


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        (dict(mu=np.zeros(3)), r"lacks \['sigma'\]"),
        (dict(mu=np.zeros(3), sigma=np.eye(2)), r"`mu` must be \(D,\) and `sigma` \(D, D\)"),
        (dict(mu=np.array([0.0, np.nan]), sigma=np.eye(2)), "NaN or inf"),
        (dict(mu=np.zeros(2), sigma=-np.eye(2)), r"`sigma` is not a covariance \(symmetric and positive semi"),
        (dict(mu=np.zeros(2), sigma=np.array([[1.0, 0.5], [0.0, 1.0]])), "`sigma` is not a covariance"),
        ("a pickled object", "not an .npz of arrays"),
    ],
)
def test_bad_statistics_files_are_named_and_never_unpickled(tmp_path, monkeypatch, arrays, message):
    monkeypatch.setenv("MARKER", str(tmp_path / "unpickled"))
    if arrays == "a pickled object":
        arrays = dict(mu=np.array([Payload()], dtype=object), sigma=np.eye(1))
    np.savez(tmp_path / "stats.npz", **arrays)
    with pytest.raises(ValueError, match=message):
        FIDStatistics.load(tmp_path / "stats.npz")
    assert not (tmp_path / "unpickled").exists()
    with pytest.raises(ValueError, match="no such file"):
        FIDStatistics.load(tmp_path / "missing.npz")


def test_inception_features_feed_torch_fidelity_exact_uint8_images_and_unknown_networks_are_named(monkeypatch):
    with pytest.raises(ValueError, match="Unknown FID feature network 'clip'"):
        load_extractor("clip")
    network = mock.Mock(return_value=(torch.zeros(3, 2048),))  # torch-fidelity's interface: uint8 in, a tuple out
    fidelity = types.SimpleNamespace(FeatureExtractorInceptionV3=mock.Mock(return_value=network))
    for name in ("torch_fidelity", "torch_fidelity.feature_extractor_inceptionv3"):
        monkeypatch.setitem(sys.modules, name, fidelity)
    images = renders(3, seed=0)
    assert image_features(InceptionFeatures(), images_to_tensor(images)).shape == (3, 2048)
    fidelity.FeatureExtractorInceptionV3.assert_called_once_with("inception-v3-compat", ["2048"], None)
    [((pixels,), _)] = network.call_args_list
    assert pixels.dtype == torch.uint8
    np.testing.assert_array_equal(pixels.permute(0, 2, 3, 1).numpy(), np.stack([np.asarray(i) for i in images]))


def test_captions_are_drawn_from_coco_as_the_reference_protocol_from_files_and_from_the_shapes_world(tmp_path):
    root = write_coco2014(tmp_path / "coco", num_train=2, num_val=6)
    annotations = root / "annotations" / "captions_val2014.json"
    assert draw_captions(str(root), 6, seed=0) == draw_captions(str(annotations), 6, seed=0)
    # Captions that name their image: each pass over the images covers each once, one of its captions per draw.
    coco = json.loads(annotations.read_text())
    for annotation in coco["annotations"]:
        annotation["caption"] = f"image {annotation['image_id']} caption {annotation['id']}"
    annotations.write_text(json.dumps(coco))
    drawn = draw_captions(str(root), 15, seed=0)
    owners = [int(caption.split()[1]) for caption in drawn]
    images = sorted(image["id"] for image in coco["images"])
    assert sorted(owners[:6]) == images and sorted(owners[6:12]) == images and owners[:6] != owners[6:12]
    assert len({caption.split()[3] for caption in drawn}) > 6  # not always an image's first caption
    assert drawn != draw_captions(str(root), 15, seed=1)
    # Caption files, and the shapes world's canonical and varied captions.
    (tmp_path / "captions.txt").write_text("# header\na red square\n\na blue circle\n", encoding="utf-8")
    assert draw_captions(str(tmp_path / "captions.txt")) == ["a red square", "a blue circle"]
    assert draw_captions(str(tmp_path / "captions.txt"), 3) == ["a red square", "a blue circle", "a red square"]
    for source, message in (("missing.txt", "no such file or folder"), ("", "without annotations/captions_val2014")):
        with pytest.raises(ValueError, match=message):
            draw_captions(str(tmp_path / source))
    with pytest.raises(ValueError, match="must be positive"):
        draw_captions("shapes", 0)
    canonical = draw_captions("shapes:heldout", 64, seed=0)
    assert len(set(canonical)) == 32 and all(canonical.count(c) == 2 for c in set(canonical))
    varied = draw_captions("shapes:heldout:varied", 64, seed=0)
    assert varied == draw_captions("shapes:heldout:varied", 64, seed=0) and varied != canonical
    triples = [[(s.colour, s.shape, s.position) for s in map(parse_caption, c)] for c in (canonical, varied)]
    assert triples[0] == triples[1]  # caption i describes the same combination
    assert all(parse_caption(c).size in (None, parse_caption(v).size) for c, v in zip(varied, canonical))
    assert any(parse_caption(c).size is None for c in varied)
    assert all(parse_caption(c).size is not None for c in canonical)


def test_shapes_references_draw_an_unstated_size_from_their_seed():
    first, again = (ShapesScorer().renders(["red circle, top left"] * 8, range(8), 3, 1, 32) for _ in range(2))
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(first, again))
    assert {read_image(image)["size"] for image in first} == {"small", "large"}
    assert {read_image(image)["position"] for image in first} == {"top left"}
    stated = ShapesScorer().renders(["a small red circle at the top left"], range(5, 6), 3, 1, 32)[0]
    expected = render(ShapeSpec("small", "red", "circle", "top left"), 32, np.random.default_rng([3, 1, 5]))
    np.testing.assert_array_equal(np.asarray(stated), np.asarray(expected))  # stated sizes: renders as before


def test_each_image_depends_only_on_its_seed_and_index_and_the_report_scores_the_saved_imagefolder(pipe, tmp_path):
    captions = draw_captions("shapes:varied", 12, seed=0)
    assert any(parse_caption(c).size is None for c in captions) and any(parse_caption(c).size for c in captions)
    settings = dict(num_inference_steps=3, guidance_scale=2.0, seed=7, progress=False)
    report, grid = evaluate(pipe, captions, fid_reference="shapes", batch_size=6, image_dir=tmp_path / "6", **settings)
    rebatched, _ = evaluate(pipe, captions, batch_size=4, image_dir=tmp_path / "4", **settings)
    generator = torch.Generator().manual_seed(image_seed(7, 4))
    alone = pipe(captions[4], num_inference_steps=3, guidance_scale=2.0, generator=generator).images[0]
    pixels = {size: [png(tmp_path / size / f"{i:06d}.png", np.int16) for i in range(12)] for size in "64"}
    assert max(np.abs(a - b).max() for a, b in zip(pixels["6"], pixels["4"])) <= 1  # float noise of batch shapes
    assert np.abs(pixels["6"][4] - np.asarray(alone, np.int16)).max() <= 1
    assert report["shapes"] == rebatched["shapes"] and "fid" not in rebatched
    assert image_seed(7, 4) != image_seed(4, 7) and grid.width > 6 * 32  # twelve captioned cells
    # FID and its real-vs-real floor, both measured (with so few images the floor itself is noisy).
    assert np.isfinite([report["fid"], report["fid_floor"]]).all() and min(report["fid"], report["fid_floor"]) > 0
    assert report["fid_extractor"] == load_extractor("shapes").name and report["num_images"] == 12
    assert set(report["shapes"]) == {"colour", "shape", "position", "size", "colour+position", "all"}
    saved = datasets.load_dataset("imagefolder", data_dir=str(tmp_path / "6"), split="train")
    assert saved["text"] == captions
    assert report["shapes"] == accuracies([score_image(image, text) for image, text in zip(saved["image"], captions)])


def test_a_reference_folder_is_read_once_then_cached(pipe, tmp_path):
    (tmp_path / "real").mkdir()
    for i, image in enumerate(renders(24, seed=9)):
        image.resize((48, 48)).save(tmp_path / "real" / f"{i}.png")  # resized back to the generated 32 px
    extractor, calls = load_extractor("shapes"), []
    extractor.register_forward_hook(lambda module, inputs, output: calls.append(inputs[0].shape))
    settings = dict(fid_reference=tmp_path / "real", fid_extractor=extractor, num_inference_steps=2, batch_size=8,
                    progress=False, cache_dir=tmp_path / "cache")  # fmt: skip
    first, _ = evaluate(pipe, draw_captions("shapes", 8), **settings)
    assert sum(shape[0] for shape in calls) == 24 + 8 and all(shape[-1] == 32 for shape in calls)
    calls.clear()
    second, _ = evaluate(pipe, draw_captions("shapes", 8), **settings)  # the reference comes from the cache:
    assert sum(shape[0] for shape in calls) == 8 and second["fid"] == pytest.approx(first["fid"], rel=1e-12)
    assert len(list((tmp_path / "cache").glob("real-32px-*.npz"))) == 1


def test_statistics_of_another_network_are_refused_before_sampling(pipe, tmp_path, monkeypatch):
    monkeypatch.setattr(type(pipe), "__call__", lambda *a, **k: pytest.fail("sampled"))
    FIDStatistics(np.zeros(16), np.eye(16), 10, "another network").save(tmp_path / "other.npz")
    np.savez(tmp_path / "wide.npz", mu=np.zeros(32), sigma=np.eye(32))
    for name, message in [("other", "computed with another network, not"),
                          ("wide", "holds 32-d statistics, but TinyFeatures gives 16-d features")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            evaluate(pipe, ["a small red circle at the top left"], fid_reference=tmp_path / f"{name}.npz",
                     fid_extractor=TinyFeatures())  # fmt: skip
    with pytest.raises(ValueError, match="some captions are not shapes-world captions"):
        evaluate(pipe, ["a dog on a beach"], fid_reference="shapes")


def test_processes_split_batches_round_robin_and_evaluate_samples_at_the_pipelines_defaults():
    shares = [Processes(index, 3).batches(23, 4) for index in range(3)]
    assert [list(map(list, share))[0] for share in shares] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert sorted(i for share in shares for batch in share for i in batch) == list(range(23))
    # The training script's final scores and the model card say "the pipeline's defaults": they are evaluate()'s.
    pipeline_call, evaluation = inspect.signature(LMLPPipeline.__call__), inspect.signature(evaluate)
    for name in ("num_inference_steps", "guidance_scale"):
        assert evaluation.parameters[name].default == pipeline_call.parameters[name].default, name


# 10 images in batches of 4: batches 0 and 1 hold 4 images, batch 2 the last 2.
RESUMED = dict(fid_reference="shapes", num_inference_steps=2, batch_size=4, seed=3, progress=False)


def count_calls(pipe, patch: pytest.MonkeyPatch, stop_at: int | None = None) -> list[int]:
    """Each call's batch size, on `pipe`'s class until `patch` is undone; call number `stop_at` raises Ctrl-C."""
    calls, call = [], type(pipe).__call__

    def counting(self, prompts, *args, **kwargs):
        calls.append(len(prompts))
        if len(calls) == stop_at:
            raise KeyboardInterrupt
        return call(self, prompts, *args, **kwargs)

    patch.setattr(type(pipe), "__call__", counting)
    return calls


@pytest.fixture
def pipeline_calls(pipe, monkeypatch) -> list[int]:
    return count_calls(pipe, monkeypatch)


def interrupt_after_two_batches(pipe, captions, **settings) -> EvaluationInterrupted:
    with pytest.MonkeyPatch.context() as patch, pytest.raises(EvaluationInterrupted) as interruption:
        count_calls(pipe, patch, stop_at=3)
        evaluate(pipe, captions, **settings)
    return interruption.value


@pytest.mark.slow
def test_an_interrupted_evaluation_resumes_without_resampling_and_reports_as_an_uninterrupted_one(
    pipe, clip_scorer, pipeline_calls, tmp_path
):
    captions = draw_captions("shapes:varied", 10, seed=0)
    straight, straight_grid = evaluate(
        pipe, captions, clip_model=clip_scorer, image_dir=tmp_path / "straight", **RESUMED
    )
    settings = dict(clip_model=clip_scorer, image_dir=tmp_path / "images", resume_dir=tmp_path / "progress", **RESUMED)
    interrupted = interrupt_after_two_batches(pipe, captions, **settings)
    pipeline_calls.clear()
    assert isinstance(interrupted, KeyboardInterrupt)  # what callers that stop on Ctrl-C already catch
    partial = interrupted.report
    assert (interrupted.num_images_done, interrupted.num_images, partial["num_images_done"]) == (8, 10, 8)
    assert partial["partial"] is True and partial["num_images"] == 10
    first = [Image.open(tmp_path / "straight" / f"{i:06d}.png") for i in range(8)]
    assert partial["shapes"] == accuracies([score_image(image, caption) for image, caption in zip(first, captions)])
    assert partial["clip_score"] == pytest.approx(float(clip_scorer.score(first, captions[:8]).mean()), rel=1e-5)
    assert partial["fid_reference"] == "shapes (real images of the same captions, 8 images)"
    kept = [".evaluation.lock", "batch-000000.safetensors", "batch-000001.safetensors", "settings.json"]
    assert sorted(path.name for path in (tmp_path / "progress").iterdir()) == kept
    assert sorted(path.name for path in (tmp_path / "images").iterdir()) == [f"{i:06d}.png" for i in range(8)]
    resumed, resumed_grid = evaluate(pipe, captions, **settings)
    assert pipeline_calls == [2]  # only the last batch is sampled
    assert without_seconds(resumed) == without_seconds(straight)  # bit for bit: the same floats
    np.testing.assert_array_equal(np.asarray(resumed_grid), np.asarray(straight_grid))
    for name in (f"{i:06d}.png" for i in range(10)):
        np.testing.assert_array_equal(png(tmp_path / "images" / name), png(tmp_path / "straight" / name))
    (tmp_path / "images" / "000005.png").unlink()  # a batch whose images are gone is sampled again
    pipeline_calls.clear()
    again, _ = evaluate(pipe, captions, **settings)
    assert pipeline_calls == [4] and without_seconds(again) == without_seconds(straight)
    np.testing.assert_array_equal(png(tmp_path / "images" / "000005.png"), png(tmp_path / "straight" / "000005.png"))


@pytest.fixture(scope="module")
def kept_progress(pipe, tmp_path_factory):
    """An evaluation's progress, interrupted after two of three batches; its captions; its uninterrupted report."""
    folder = tmp_path_factory.mktemp("kept") / "progress"
    captions = draw_captions("shapes", 10, seed=0)
    straight, _ = evaluate(pipe, captions, **RESUMED)
    interrupt_after_two_batches(pipe, captions, resume_dir=folder, **RESUMED)
    return folder, captions, straight


@pytest.mark.parametrize("damage", ["cut short by a kill", "a flipped bit", "scores edited by hand"])
def test_a_damaged_batch_file_is_sampled_again(pipe, kept_progress, pipeline_calls, tmp_path, caplog, damage):
    kept, captions, straight = kept_progress
    progress = shutil.copytree(kept, tmp_path / "progress")
    path = progress / "batch-000001.safetensors"
    data = path.read_bytes()
    if damage == "cut short by a kill":  # and a temporary file written half-way, never renamed into place
        (progress / ".batch-000002.safetensors.tmp").write_bytes(data[: len(data) // 2])
        path.write_bytes(data[: len(data) // 2])
    elif damage == "a flipped bit":  # in the tensors' bytes
        path.write_bytes(data[:-5] + bytes([data[-5] ^ 1]) + data[-4:])
    else:  # a valid file with its metadata kept
        with safe_open(path, "pt") as f:
            metadata, tensors = f.metadata(), {name: f.get_tensor(name) for name in f.keys()}
        tensors["rows"][:, 1:] = 1.0
        save_file(tensors, path, metadata)
    resumed, _ = evaluate(pipe, captions, resume_dir=progress, **RESUMED)
    assert pipeline_calls == [4, 2]  # batch 0 is taken from disk, batches 1 and 2 are sampled
    assert without_seconds(resumed) == without_seconds(straight)
    warning = "does not read" if damage.startswith("cut") else "does not match its checksum (damaged or edited)"
    assert f"batch-000001.safetensors {warning}" in caplog.text and not list(progress.glob("*.tmp"))


def test_a_progress_folder_in_use_or_not_an_evaluations_is_refused(pipe, pipeline_calls, tmp_path):
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "settings.json").write_text(json.dumps({"settings": [1]}))
    captions = draw_captions("shapes", 10, seed=0)
    with pytest.raises(ValueError, match=r"settings.json is not an evaluation's progress .*its settings are a list"):
        evaluate(pipe, captions, resume_dir=tmp_path / "other", **RESUMED)
    (tmp_path / "progress").mkdir()
    held = hold_lock(tmp_path / "progress" / ".evaluation.lock")  # as a running evaluation holds it
    with pytest.raises(ValueError, match="Another evaluation is using .*progress"):
        evaluate(pipe, captions, resume_dir=tmp_path / "progress", **RESUMED)
    assert not pipeline_calls
    held.close()
    evaluate(pipe, captions, resume_dir=tmp_path / "progress", **RESUMED)
    remove_progress(tmp_path / "progress")
    assert not (tmp_path / "progress").exists()  # the lock goes with the progress


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_inference_steps": 3}, "num_inference_steps (2 there, 3 now)"),
        ({"seed": 4}, "seed (3 there, 4 now)"),
        ({"guidance_scale": 3.0}, "guidance_scale (2.0 there, 3.0 now)"),
        ({"batch_size": 5}, "batch_size (4 there, 5 now)"),
        ({"captions": "shapes:heldout"}, "captions."),
        ({"dtype": torch.float64}, "the pipeline's weights or configs"),
        ({"fid_reference": None}, "fid_extractor (shapes-features there, None now)"),
    ],
)
def test_progress_of_other_settings_is_refused_before_sampling_and_left_intact(
    pipe, kept_progress, pipeline_calls, change, message
):
    folder, captions, _ = kept_progress
    files = {path.name: path.read_bytes() for path in folder.iterdir()}
    change = dict(change)
    if "captions" in change:
        captions = draw_captions(change.pop("captions"), 10, seed=0)
    if "dtype" in change:
        pipe = pretrained_shapes_pipeline(dtype=change.pop("dtype"))
    with pytest.raises(ValueError) as error:
        evaluate(pipe, captions, resume_dir=folder, **{**RESUMED, **change})
    assert str(error.value).startswith(f"{folder} holds the progress of an evaluation with other settings: {message}")
    assert f"delete {folder} to start over" in str(error.value) and not pipeline_calls
    assert {path.name: path.read_bytes() for path in folder.iterdir()} == files


def test_kept_progress_scores_another_reference_of_the_same_network_without_sampling(pipe, pipeline_calls, tmp_path):
    extractor, captions = load_extractor("shapes"), draw_captions("shapes", 10, seed=0)
    for seed in (1, 2):
        statistics_of(extractor, renders(64, seed=seed)).save(tmp_path / f"real-{seed}.npz")
    settings = {**RESUMED, "fid_extractor": "shapes", "resume_dir": tmp_path / "progress"}
    first, _ = evaluate(pipe, captions, **{**settings, "fid_reference": tmp_path / "real-1.npz"})
    pipeline_calls.clear()
    settings["fid_reference"] = tmp_path / "real-2.npz"
    second, _ = evaluate(pipe, captions, **settings)
    assert not pipeline_calls
    straight, _ = evaluate(pipe, captions, **{**settings, "resume_dir": None})
    assert second["fid"] == straight["fid"] != first["fid"]
    assert second["fid_reference"] == str(tmp_path / "real-2.npz")
