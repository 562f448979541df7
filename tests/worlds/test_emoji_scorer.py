"""The emoji world's scorer: which real emoji a picture is nearest to, by the emoji CLIP and by pixels; the tone among
an emoji's variants; emoji-FID's real images and floor; the emoji caption sources and the evaluation on them."""

import json
import math
import shlex

import numpy as np
import pytest
from documents import block
from PIL import Image

from diffusers_lmlp.emoji import EmojiScorer, load_emoji, load_images, split_indices
from diffusers_lmlp.emoji.scorer import CLIP_PATH, FLAGS, caption_targets
from diffusers_lmlp.evaluation import draw_captions, evaluate
from diffusers_lmlp.evaluation.__main__ import main, parse_args


@pytest.fixture(scope="module")
def scorer():
    return EmojiScorer.from_pretrained()


@pytest.fixture
def one_scorer(scorer, monkeypatch):
    """The evaluation's emoji scorer is the module's: the world's pictures are embedded once."""
    monkeypatch.setattr(EmojiScorer, "from_pretrained", lambda *args, **kwargs: scorer)


def index_of(name: str) -> int:
    return next(i for i, emoji in enumerate(load_emoji()) if emoji.name == name)


@pytest.mark.slow  # the scorer embeds the world's 3,786 pictures first (about 9 s)
def test_every_real_picture_is_nearest_to_itself_and_not_to_another_tone_or_emoji(scorer):
    rows = split_indices("heldout")[:20] + split_indices("train")[::200]
    # any tone of the asked emoji is the emoji, but not the tone; another emoji is not the asked one
    tone = {"top-1": 1, "pixel top-1": 1, "tone": 0, "pixel tone": 0}
    others = [("surfer: light skin tone", "surfer: dark skin tone", tone)]
    others.append(("rocket", "red apple", {"top-1": 0, "pixel top-5": 0}))
    pictures = [load_images()[i] for i in rows] + [load_images()[index_of(picture)] for picture, *_ in others]
    captions = [load_emoji()[i].name for i in rows] + [caption for _, caption, _ in others]
    verdicts = [dict(zip(FLAGS, row)) for row in scorer.flags(list(map(Image.fromarray, pictures)), captions)]
    for i, verdict in zip(rows, verdicts):
        assert verdict["top-1"] == verdict["top-5"] == verdict["pixel top-1"] == verdict["pixel top-5"] == 1.0
        if len(load_emoji()[i].tones) == 1:  # a single-tone variant: its tone is told
            assert verdict["tone"] == verdict["pixel tone"] == 1.0
        else:
            assert math.isnan(verdict["tone"]) and math.isnan(verdict["pixel tone"])
    for verdict, (*_, expected) in zip(verdicts[len(rows) :], others):
        assert {key: verdict[key] for key in expected} == expected


@pytest.mark.slow  # the scorer embeds the world's 3,786 pictures first (about 9 s)
def test_emoji_fid_takes_the_captions_pictures_and_draws_the_floor_from_their_split(scorer):
    held = [load_emoji()[i].name for i in split_indices("heldout")[:6]]
    real = scorer.renders(held, range(6), seed=0, stream=1, resolution=32)
    assert all(np.array_equal(np.asarray(image), load_images()[index_of(name)]) for image, name in zip(real, held))
    floor, again = (scorer.renders(held, range(6), seed=0, stream=2, resolution=32) for _ in range(2))
    pictures = {load_images()[i].tobytes() for i in split_indices("heldout")}
    assert all(np.asarray(image).tobytes() in pictures for image in floor)  # from the held-out split
    assert [np.asarray(a).tobytes() for a in floor] == [np.asarray(b).tobytes() for b in again]
    assert scorer.renders(held[:1], range(1), 0, 1, 16)[0].size == (16, 16)


def test_emoji_caption_sources_draw_each_picture_evenly_by_plain_name_or_in_any_phrasing():
    held = draw_captions("emoji:heldout", 2 * 162, seed=3)
    assert sorted(held) == sorted([load_emoji()[i].name for i in split_indices("heldout")] * 2)
    varied = draw_captions("emoji:heldout:varied", 2 * 162, seed=3)
    assert all(phrasing in load_emoji()[index_of(name)].captions for name, phrasing in zip(held, varied))  # in order
    assert len(set(draw_captions("emoji:train", 100, seed=0))) == 100
    assert len(caption_targets()["man in tuxedo"]) == 2  # a name two emoji share asks for either


@pytest.mark.slow
def test_evaluate_scores_emoji_captions_with_the_emoji_scorer_and_emoji_fid(make_pipe, one_scorer):
    captions = draw_captions("emoji:heldout", 4, seed=0)
    report, _ = evaluate(make_pipe(), captions, fid_reference="emoji", num_inference_steps=1, batch_size=4)
    assert set(report["emoji"]) == set(report["emoji_intervals"]) == set(FLAGS)
    assert report["fid_extractor"] == "emoji-clip" and report["fid"] > 0 and report["fid_floor"] > 0
    assert report["fid_reference"] == "emoji (real images of the same captions, 4 images)"
    with pytest.raises(ValueError, match="some captions are not emoji-world captions"):
        evaluate(make_pipe(), ["a small red circle at the top left"], fid_reference="emoji")


@pytest.mark.slow
def test_the_documented_emoji_evaluations_run_on_the_shipped_pipeline(tmp_path, one_scorer):
    """docs/emoji.md's commands in this process, each with 4 of its images at 2 steps."""
    commands = block("docs/emoji.md", "How samples are scored").strip().splitlines()
    assert len(commands) == 2
    for number, command in enumerate(commands):
        argv = shlex.split(command)[3:]  # after `python -m diffusers_lmlp.evaluation`
        defaults = parse_args(argv)
        assert (defaults.fid_reference, defaults.clip_model) == ("emoji", str(CLIP_PATH))
        out = tmp_path / str(number)
        main([*argv, "--num_images", "4", "--num_inference_steps", "2", "--output_dir", str(out), "--no_progress"])
        report = json.loads((out / "report.json").read_text())
        assert report["captions"] == defaults.captions and set(report["emoji"]) == set(FLAGS)
        assert report["fid_floor"] > 0 and report["clip_model"] == str(CLIP_PATH)
