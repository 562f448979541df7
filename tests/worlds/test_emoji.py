"""The emoji world: its build script on npm-layout stand-ins, the shipped world, its CLIP, tokenizer and scorer."""

import json
import math
import shlex
from hashlib import sha256
from pathlib import Path

import numpy as np
import pytest
import torch
from documents import block
from PIL import Image
from transformers import CLIPTextModel, CLIPTokenizer

from diffusers_lmlp.emoji import HELD_OUT, EmojiScorer, load_emoji, load_images, make_dataset
from diffusers_lmlp.emoji.scorer import CLIP_PATH, FLAGS, PIPELINE_PATH, TEXT_SEQ_LEN, caption_targets
from diffusers_lmlp.emoji.world import VALIDATION_PROMPTS, WORLD_PATH, split_indices, tone_group
from diffusers_lmlp.evaluation import draw_captions, evaluate
from diffusers_lmlp.evaluation.__main__ import main, parse_args


SCRIPT = "build_emoji_world"
TONES = ("1F3FB", "1F3FC", "1F3FD", "1F3FE", "1F3FF")
TONE_WORDS = [f"{words} skin tone" for words in ("light", "medium-light", "medium", "medium-dark", "dark")]


@pytest.fixture(scope="module")
def scorer():
    return EmojiScorer.from_pretrained()


def index_of(name: str) -> int:
    return next(i for i, emoji in enumerate(load_emoji()) if emoji.name == name)


@pytest.mark.slow  # the scorer embeds the world's 3,786 pictures first (about 9 s)
def test_every_real_picture_is_nearest_to_itself_and_emoji_fid_takes_the_captions_pictures(scorer):
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
    # emoji-FID's real images are the captions' pictures, and its floor is drawn from their split
    held = [load_emoji()[i].name for i in split_indices("heldout")[:6]]
    real = scorer.renders(held, range(6), seed=0, stream=1, resolution=32)
    assert all(np.array_equal(np.asarray(image), load_images()[index_of(name)]) for image, name in zip(real, held))
    floor, again = (scorer.renders(held, range(6), seed=0, stream=2, resolution=32) for _ in range(2))
    pictures = {load_images()[i].tobytes() for i in split_indices("heldout")}
    assert all(np.asarray(image).tobytes() in pictures for image in floor)  # from the held-out split
    assert [np.asarray(a).tobytes() for a in floor] == [np.asarray(b).tobytes() for b in again]
    assert scorer.renders(held[:1], range(1), 0, 1, 16)[0].size == (16, 16)


def test_emoji_caption_sources_draw_each_picture_evenly_and_other_captions_are_refused_emoji_fid(make_pipe):
    held = draw_captions("emoji:heldout", 2 * 162, seed=3)
    assert sorted(held) == sorted([load_emoji()[i].name for i in split_indices("heldout")] * 2)
    varied = draw_captions("emoji:heldout:varied", 2 * 162, seed=3)
    assert all(phrasing in load_emoji()[index_of(name)].captions for name, phrasing in zip(held, varied))  # in order
    assert len(set(draw_captions("emoji:train", 100, seed=0))) == 100
    assert len(caption_targets()["man in tuxedo"]) == 2  # a name two emoji share asks for either
    with pytest.raises(ValueError, match="some captions are not emoji-world captions"):
        evaluate(make_pipe(), ["a small red circle at the top left"], fid_reference="emoji")


@pytest.mark.slow
def test_the_documented_emoji_evaluations_run_on_the_shipped_pipeline(tmp_path, scorer, monkeypatch):
    """docs/emoji.md's commands in this process, each with 4 of its images at 2 steps, with the module's scorer."""
    monkeypatch.setattr(EmojiScorer, "from_pretrained", lambda *args, **kwargs: scorer)
    commands = block("docs/emoji.md", "How samples are scored").strip().splitlines()
    assert len(commands) == 2
    for number, command in enumerate(commands):
        argv = shlex.split(command)[3:]  # after `python -m diffusers_lmlp.evaluation`
        defaults = parse_args(argv)
        assert (defaults.fid_reference, defaults.clip_model) == ("emoji", str(CLIP_PATH))
        out = tmp_path / str(number)
        main([*argv, "--num_images", "4", "--num_inference_steps", "2", "--output_dir", str(out), "--no_progress"])
        report = json.loads((out / "report.json").read_text())
        assert report["captions"] == defaults.captions and set(report["emoji"]) == set(report["emoji_intervals"])
        assert set(report["emoji"]) == set(FLAGS) and report["clip_model"] == str(CLIP_PATH)
        assert report["fid_extractor"] == "emoji-clip" and report["fid"] > 0 and report["fid_floor"] > 0
        assert report["fid_reference"] == "emoji (real images of the same captions, 4 images)"


def npm_stand_ins(root: Path) -> tuple[Path, Path]:
    """The two npm packages' layout with an apple and two hands (five tones each), out of sort order."""
    datasource, cldr = root / "emoji-datasource-google", root / "cldr-annotations-full"
    (pictures := datasource / "img" / "google" / "64").mkdir(parents=True)

    def entry(unified, name, order, category, subcategory, tones=False):
        record = {
            "name": name, "unified": unified, "image": f"{unified.lower()}.png", "sort_order": order,
            "category": category, "subcategory": subcategory, "has_img_google": True,
        }  # fmt: skip
        Image.new("RGBA", (64, 64), (200, 30, 30, 128)).save(pictures / record["image"])
        variants = [f"{unified}-{tone}" for tone in TONES] if tones else []
        for i, variant in enumerate(variants):
            Image.new("RGBA", (64, 64), (40 * i, 90, 90, 255)).save(pictures / f"{variant.lower()}.png")
        skins = {v[-5:]: {"unified": v, "image": f"{v.lower()}.png"} for v in variants}
        return record | ({"skin_variations": skins} if tones else {})

    emoji = [
        entry("270C-FE0F", "VICTORY HAND", 3, "People & Body", "hand-fingers-partial", tones=True),
        entry("1F34E", "RED APPLE", 1, "Food & Drink", "food-fruit"),
        entry("1F44B", "WAVING HAND SIGN", 2, "People & Body", "hand-fingers-open", tones=True),
    ]
    (datasource / "emoji.json").write_text(json.dumps(emoji), encoding="utf-8")
    annotations = {
        "🍎": {"default": ["apple", "fruit", "red"], "tts": ["red apple"]},
        "👋": {"default": ["hand", "wave"], "tts": ["waving hand"]},
        "✌": {"default": ["hand", "peace"], "tts": ["victory hand"]},
        **{chr(int(tone, 16)): {"default": ["skin"], "tts": [words]} for tone, words in zip(TONES, TONE_WORDS)},
    }
    (cldr / "annotations" / "en").mkdir(parents=True)
    annotations = json.dumps({"annotations": {"identity": {}, "annotations": annotations}}, ensure_ascii=False)
    (cldr / "annotations" / "en" / "annotations.json").write_text(annotations, "utf-8")
    for folder, version in ((datasource, "16.0.0"), (cldr, "48.2.0")):
        (folder / "package.json").write_text(json.dumps({"version": version}), encoding="utf-8")
        (folder / "LICENSE").write_text(f"licence of {folder.name}\n", encoding="utf-8")
    return datasource, cldr


def test_the_shipped_world_dataset_and_tokenizer_hold_every_picture_and_hold_out_a_tenth_of_its_tones():
    emoji, images = load_emoji(), load_images()
    assert len(emoji) == 3786 and images.shape == (3786, 32, 32, 3) and sum(not e.tones for e in emoji) == 1911
    assert {"extraterrestrial alien", "surfer: dark skin tone", "red apple"} <= {e.name for e in emoji}
    assert "surfer: dark skin tone" in {e.name for e in emoji if e.unified == "1F3C4-1F3FF"}
    assert all(e.captions[0] == e.name and len(e.captions) >= 4 for e in emoji)
    assert (images[:, 0, 0] == 255).all(axis=-1).mean() > 0.9  # composited on white
    assert sum(path.stat().st_size for path in WORLD_PATH.iterdir()) <= 6_000_000
    dataset = make_dataset("train")  # every phrasing of each training picture
    row, first = dataset[0], emoji[split_indices("train")[0]]
    assert len(dataset) == 3786 - 162 and row["text"] == list(first.captions) and row["image"].size == (32, 32)
    with pytest.raises(ValueError, match="choose one of"):
        make_dataset("test")
    tokenizer = CLIPTokenizer.from_pretrained(PIPELINE_PATH / "tokenizer")
    assert tokenizer.model_max_length == TEXT_SEQ_LEN
    captions = [caption for e in emoji for caption in e.captions]
    assert max(len(ids) for ids in tokenizer(captions).input_ids) <= TEXT_SEQ_LEN
    assert tokenizer.tokenize("extraterrestrial alien") == ["extraterrestrial</w>", "alien</w>"]
    assert tokenizer.tokenize("são tomé") == ["sÃ£o</w>", "tomÃ©</w>"]  # whole words in UTF-8 bytes too
    # a tenth of the single-tone variants is held out, keeping every tone and emoji in training
    held, train = [emoji[i] for i in split_indices("heldout")], [emoji[i] for i in split_indices("train")]
    assert tuple(e.unified for e in held) == HELD_OUT and len(HELD_OUT) == 162 and len(train) + 162 == len(emoji)
    single = sum(len(e.tones) == 1 for e in emoji)
    assert all(len(e.tones) == 1 for e in held) and abs(len(held) / single - 0.1) < 0.005
    for e in held:  # its emoji keeps its default picture and four tones in training
        assert len([t for t in train if t.base == e.base and len(t.tones) <= 1]) == 5
    for tone in TONES:  # every tone stays in training, on most emoji
        assert sum(1 for t in train if t.tones == (tone,)) > 250
    # the validation grid: 6 trained, 2 held out
    assert {*VALIDATION_PROMPTS[:6]} <= {e.name for e in train} and {*VALIDATION_PROMPTS[6:]} <= {e.name for e in held}
    index = split_indices("heldout")[0]  # a tone group is the emoji's five single-tone variants, in order
    assert index in tone_group(index) and [emoji[i].tones for i in tone_group(index)] == [(tone,) for tone in TONES]
    assert tone_group(0) == ()  # grinning face: no tones


def test_the_documented_build_commands_run_on_the_npm_layout(script, tmp_path, monkeypatch, capsys):
    install, *builds = block("docs/emoji.md", "The pictures and their names").strip().splitlines()
    assert install.startswith(npm := "npm install emoji-datasource-google@16.0.0 cldr-annotations-full@48.2.0")
    with pytest.raises(SystemExit):  # a missing package: the error names that install
        script.main(["--emoji-datasource", str(tmp_path / "missing")])
    assert npm in capsys.readouterr().err
    _, cldr = npm_stand_ins(tmp_path / "node_modules")  # what that install leaves in ./node_modules
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "shipped"  # the first command writes into the package: here, into a copy's place
    for command in builds:
        argv = command.split("#")[0].split()
        assert argv[:2] == ["python", "scripts/build_emoji_world.py"]
        script.main([*argv[2:], *([] if "--output-dir" in argv else ["--output-dir", str(out)])])
    assert Image.open(tmp_path / "emoji-world-64" / "emoji-64.png").size == (64 * 64, 64)
    assert load_images(tmp_path / "emoji-world-64").shape == (13, 64, 64, 3)
    world = json.loads((out / "world.json").read_text(encoding="utf-8"))
    names = [record["name"] for record in world["emoji"]]
    # emoji.json's sort order, each emoji then its variants; the plain name is the lowercased name, a colon and tone.
    assert names[:3] == ["red apple", "waving hand sign", "waving hand sign: light skin tone"]
    assert names[-1] == "victory hand: dark skin tone" and len(names) == 13
    apple = world["emoji"][0]["captions"]
    assert apple[0] == "red apple" and "a red apple, fruit" in apple
    assert {"red apple emoji", "food and drink: red apple"} <= set(apple)
    assert "a waving hand with dark skin tone" in world["emoji"][6]["captions"]
    # Every second emoji with tones holds out one tone, the tones in turn: the first hand its light variant.
    assert [r["unified"] for r in world["emoji"] if r["held_out"]] == ["1F44B-1F3FB"]
    # The sheet: 32×32 pictures on white in rows of 64; the apple's half-transparent red is composited on white.
    sheet = np.asarray(Image.open(out / world["sheet"]))
    assert sheet.shape == (32, 64 * 32, 3) and world["size"] == 32
    assert tuple(sheet[16, 16]) == (227, 142, 142)  # 255 + 128/255 · (200 − 255) = 227.4, ...
    assert (sheet[:, 13 * 32 :] == 255).all()  # past the last picture: white
    annotations = sha256((cldr / "annotations" / "en" / "annotations.json").read_bytes()).hexdigest()
    assert world["sources"]["emoji-datasource-google"]["version"] == "16.0.0"
    assert world["sources"]["cldr-annotations-full"]["annotations/en/annotations.json sha256"] == annotations
    assert {path.name for path in out.iterdir()} == {
        "world.json", "emoji-32.png", "NOTICE", "LICENSE-emoji-datasource", "LICENSE-cldr", "LICENSE-noto-emoji",
    }  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("script", ["train_emoji_clip"], indirect=True)
def test_the_documented_command_writes_the_scorers_clip_and_the_pipelines_text_side(script, tmp_path, capsys):
    argv = shlex.split(block("docs/emoji.md", "The components, trained on the world").strip().splitlines()[0])
    assert argv[:2] == ["python", "scripts/train_emoji_clip.py"]
    clip, pipeline = tmp_path / "clip", tmp_path / "pipeline"
    tiny = ["--steps", "2", "--batch-size", "8", "--width", "16", "--layers", "1"]
    script.main([*argv[2:], *tiny, "--output-dir", str(clip), "--pipeline-dir", str(pipeline)])
    assert "plain names to pictures among all 3,786" in capsys.readouterr().out
    scorer = EmojiScorer.from_pretrained(clip)  # safetensors, with its processor
    text_encoder = CLIPTextModel.from_pretrained(pipeline / "text_encoder", use_safetensors=True)
    ids = CLIPTokenizer.from_pretrained(pipeline / "tokenizer")(["red apple"], padding="max_length").input_ids
    ours, theirs = text_encoder(torch.tensor(ids)), scorer.clip.model.text_model(torch.tensor(ids))  # the same tower
    torch.testing.assert_close(ours.last_hidden_state, theirs.last_hidden_state)
