"""CLIP score offline on tiny CLIPs in the real repo layout: loading, torchmetrics' numbers, refusals."""

import shutil

import huggingface_hub
import numpy as np
import pytest
import torch
from coco_fixture import CLIP_REPO, WORDS
from PIL import Image
from test_pipeline_loading import fill_hub_cache
from torchmetrics.functional.multimodal import clip_score
from torchmetrics.multimodal import CLIPScore
from transformers import CLIPModel, CLIPProcessor

from diffusers_lmlp.evaluation.clip_score import CLIPScorer


CAPTIONS = ["a red circle", "a photo of a blue square", "the green triangle at the top", "a yellow shape", "a", "cat"]
pytestmark = pytest.mark.usefixtures("no_unpickling", "one_thread")


class TensorFeaturesCLIP(CLIPModel):
    """`CLIPModel` whose `get_*_features` return a tensor, as torchmetrics expects."""

    def get_image_features(self, *args, **kwargs):
        return super().get_image_features(*args, **kwargs).pooler_output

    def get_text_features(self, *args, **kwargs):
        return super().get_text_features(*args, **kwargs).pooler_output


def varied_images(count: int, seed: int = 0) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    sizes = [(int(rng.integers(20, 80)), int(rng.integers(20, 80))) for _ in range(count)]
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


def use_hub_cache(cache, monkeypatch) -> None:  # huggingface_hub at `cache`, offline (constants too)
    for name, value in (("HF_HOME", str(cache.parent)), ("HF_HUB_CACHE", str(cache)), ("HF_HUB_OFFLINE", "1")):
        monkeypatch.setenv(name, value)
        monkeypatch.setattr(huggingface_hub.constants, name, value if name != "HF_HUB_OFFLINE" else True)


def test_the_default_id_loads_from_a_prefilled_hub_cache_offline_and_a_folder_as_given(
    clip_folder, tmp_path, monkeypatch
):
    fill_hub_cache(clip_folder, tmp_path / "hf" / "hub", CLIP_REPO)
    use_hub_cache(tmp_path / "hf" / "hub", monkeypatch)
    scorer = CLIPScorer.from_pretrained()
    assert scorer.name == CLIP_REPO == "openai/clip-vit-large-patch14"
    assert not scorer.model.training and scorer.model.dtype == torch.float32
    reference = CLIPModel.from_pretrained(clip_folder, use_safetensors=True)
    for (name, loaded), expected in zip(scorer.model.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(loaded, expected, rtol=0, atol=0, msg=name)
    scores = scorer.score(varied_images(3), CAPTIONS[:3])
    assert scores.shape == (3,) and scores.dtype == torch.float64 and scores.device.type == "cpu"
    assert ((scores >= 0) & (scores <= 100)).all()
    for name_or_path in (clip_folder, str(clip_folder)):
        scorer = CLIPScorer.from_pretrained(name_or_path, dtype=torch.float64)
        assert scorer.name == str(clip_folder) and scorer.model.dtype == torch.float64


@pytest.mark.parametrize("sign", [1, -1], ids=["as-saved", "negated-text-projection"])
def test_scores_match_torchmetrics_per_pair_and_in_mean(clip_folder, sign):
    # sign -1 negates every cosine, so that one of the two cases has negative ones and checks the clamp at 0.
    model = TensorFeaturesCLIP.from_pretrained(clip_folder, use_safetensors=True)  # for torchmetrics and the scorer
    processor = CLIPProcessor.from_pretrained(clip_folder)
    with torch.no_grad():
        model.text_projection.weight.mul_(sign)
    scorer, load = CLIPScorer(model, processor, name="tiny"), lambda: (model.eval(), processor)
    images = varied_images(len(CAPTIONS))
    tensors = [torch.from_numpy(np.array(image)).permute(2, 0, 1) for image in images]  # (3, H, W) uint8
    scores = scorer.score(images, CAPTIONS, batch_size=4)  # (6,)
    raw = scorer.score(images, CAPTIONS, batch_size=4, clamp=False)  # (6,) 100 · cos
    assert (raw != 0).all()
    torch.testing.assert_close(scores, raw.clamp(min=0), rtol=0, atol=0)
    # torchmetrics clamps the mean, so one pair per call gives the per-pair score.
    expected = torch.stack([clip_score(t, c, load).double() for t, c in zip(tensors, CAPTIONS)])
    torch.testing.assert_close(scores, expected, rtol=0, atol=1e-4)
    # Over the set, torchmetrics' function and metric give max(mean(100 · cos), 0) ...
    metric = CLIPScore(model_name_or_path=load)
    metric.update(tensors[:4], CAPTIONS[:4])
    metric.update(tensors[4:], CAPTIONS[4:])
    for value in (clip_score(tensors, CAPTIONS, load), metric.compute()):
        assert value.item() == pytest.approx(raw.mean().clamp(min=0).item(), abs=1e-4)
        if (raw > 0).all() or (raw < 0).all():  # then that is the mean of the per-pair scores (or both are 0)
            assert value.item() == pytest.approx(scores.mean().item(), abs=1e-4)


def test_the_batch_size_float_tensors_and_words_past_77_tokens_do_not_change_the_scores(clip_scorer):
    images, captions, score = varied_images(5, seed=1), CAPTIONS[:5], clip_scorer.score
    torch.testing.assert_close(score(images, captions, batch_size=2), score(images, captions), atol=1e-4, rtol=0)
    images = torch.rand(3, 3, 40, 52, generator=torch.Generator().manual_seed(0))  # (N, 3, H, W) in [0, 1]
    pixels = (images * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()  # (N, H, W, 3)
    as_pil = [Image.fromarray(array) for array in pixels]
    torch.testing.assert_close(score(images, CAPTIONS[:3]), score(as_pil, CAPTIONS[:3]), rtol=0, atol=0)
    # A 200-word caption is truncated to 77 tokens (bos, 75 words, eos): words past them cannot change the score.
    words = [str(w) for w in np.random.default_rng(0).choice(WORDS, size=200)]
    assert len(clip_scorer.processor.tokenizer.tokenize(" ".join(words))) == 200  # one token each
    captions = [" ".join(words), " ".join(words[:75] + ["circle"] * 125), " ".join(words[:75]), " ".join(words[:74])]
    scores = clip_scorer.score(varied_images(1) * 4, captions)  # (4,)
    torch.testing.assert_close(scores[:3], scores[:1].expand(3), rtol=0, atol=1e-4)  # padding: float noise only
    assert abs(scores[3] - scores[0]) > 1e-2


@pytest.mark.parametrize(
    "images, captions, batch_size, message",
    [
        (2, ["a red circle"], 1, "Got 2 images and 1 captions"),
        (0, [], 1, "at least one image"),
        (2, ["a red circle", ""], 1, "Caption 1 is ''"),
        (1, ["   "], 1, "Caption 0 is '   '"),
        (1, [None], 1, "Caption 0 is None"),
        (torch.zeros(1, 3, 8, 8) - 1, ["a"], 1, r"\[0, 1\]"),
        (torch.zeros(1, 8, 8), ["a"], 1, r"\(N, 3, H, W\)"),
        (["not an image"], ["a"], 1, "Image 0 is a str"),
        (1, ["a"], 0, "batch_size must be at least 1"),
    ],
)
def test_bad_inputs_raise_value_errors_that_say_what_to_pass(clip_scorer, images, captions, batch_size, message):
    images = varied_images(images) if isinstance(images, int) else images
    with pytest.raises(ValueError, match=message):
        clip_scorer.score(images, captions, batch_size=batch_size)


@pytest.mark.parametrize(
    ("where", "message"),
    [
        ("folder", r"no safetensors weights .* pickled weights only \(pytorch_model.bin\), which CLIPScorer never"),
        ("cache", r"'openai/clip-vit-large-patch14' is in the Hugging Face cache .* without `model.safetensors`"),
        ("nowhere", r"'openai/clip-vit-large-patch14' is not in the Hugging Face cache .* HF_HUB_OFFLINE is set"),
    ],
)
def test_pickled_weights_are_refused_unread_and_a_missing_model_says_how_to_get_it(
    clip_folder, tmp_path, monkeypatch, where, message
):
    pickled = tmp_path / "pickled"  # the repo with a (fake) `pytorch_model.bin` instead of `model.safetensors`
    shutil.copytree(clip_folder, pickled, ignore=shutil.ignore_patterns("model.safetensors"))
    (pickled / "pytorch_model.bin").write_bytes(b"not a pickle: unpickling this fails loudly")
    if where == "cache":
        fill_hub_cache(pickled, tmp_path / "hf" / "hub", CLIP_REPO)
    use_hub_cache(tmp_path / "hf" / "hub", monkeypatch)
    with pytest.raises(OSError, match=message) as error:
        CLIPScorer.from_pretrained(pickled if where == "folder" else CLIP_REPO)
    if where != "folder":
        assert f"`hf download {CLIP_REPO} --include" in str(error.value) and "pass a local folder" in str(error.value)
