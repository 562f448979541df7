"""The emoji world: `scripts/build_emoji_world.py` on npm-layout stand-ins, and the shipped world."""

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from documents import block
from PIL import Image

from diffusers_lmlp.emoji import HELD_OUT, load_emoji, load_images, make_dataset, split_indices, tone_group
from diffusers_lmlp.emoji.world import VALIDATION_PROMPTS, WORLD_PATH


SCRIPT = "build_emoji_world"
TONES = ("1F3FB", "1F3FC", "1F3FD", "1F3FE", "1F3FF")
TONE_WORDS = [f"{words} skin tone" for words in ("light", "medium-light", "medium", "medium-dark", "dark")]


def npm_stand_ins(root: Path) -> tuple[Path, Path]:
    """The two npm packages' layout with an apple and two hands (five tones each), out of sort order."""
    datasource, cldr = root / "emoji-datasource-google", root / "cldr-annotations-full"
    pictures = datasource / "img" / "google" / "64"
    pictures.mkdir(parents=True)

    def entry(unified, name, order, category, subcategory, tones=False):
        record = {
            "name": name, "unified": unified, "image": f"{unified.lower()}.png", "sort_order": order,
            "category": category, "subcategory": subcategory, "has_img_google": True,
        }  # fmt: skip
        Image.new("RGBA", (64, 64), (200, 30, 30, 128)).save(pictures / record["image"])
        if tones:
            record["skin_variations"] = {}
            for i, tone in enumerate(TONES):
                variant = f"{unified}-{tone}"
                record["skin_variations"][tone] = {"unified": variant, "image": f"{variant.lower()}.png"}
                Image.new("RGBA", (64, 64), (40 * i, 90, 90, 255)).save(pictures / f"{variant.lower()}.png")
        return record

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
    (cldr / "annotations" / "en" / "annotations.json").write_text(
        json.dumps({"annotations": {"identity": {}, "annotations": annotations}}, ensure_ascii=False), "utf-8"
    )
    for folder, version in ((datasource, "16.0.0"), (cldr, "48.2.0")):
        (folder / "package.json").write_text(json.dumps({"version": version}), encoding="utf-8")
        (folder / "LICENSE").write_text(f"licence of {folder.name}\n", encoding="utf-8")
    return datasource, cldr


def test_the_build_script_names_the_npm_install_when_a_package_is_missing(script, tmp_path, capsys):
    with pytest.raises(SystemExit):
        script.main(["--emoji-datasource", str(tmp_path / "missing")])
    assert "npm install emoji-datasource-google@16.0.0 cldr-annotations-full@48.2.0" in capsys.readouterr().err


def test_the_shipped_world_and_its_training_dataset_hold_every_picture_with_its_plain_name():
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


def test_a_tenth_of_the_single_tone_variants_is_held_out_keeping_every_tone_and_emoji():
    emoji = load_emoji()
    held, train = [emoji[i] for i in split_indices("heldout")], [emoji[i] for i in split_indices("train")]
    assert tuple(e.unified for e in held) == HELD_OUT and len(HELD_OUT) == 162 and len(train) + 162 == len(emoji)
    single = sum(len(e.tones) == 1 for e in emoji)
    assert all(len(e.tones) == 1 for e in held) and abs(len(held) / single - 0.1) < 0.005
    for e in held:  # its emoji keeps its default picture and four tones in training
        assert len([t for t in train if t.base == e.base and len(t.tones) <= 1]) == 5
    for tone in TONES:  # every tone stays in training, on most emoji
        assert sum(1 for t in train if t.tones == (tone,)) > 250
    assert set(VALIDATION_PROMPTS[:6]) <= {e.name for e in train}  # the validation grid: 6 trained, 2 held out
    assert set(VALIDATION_PROMPTS[6:]) <= {e.name for e in held}
    index = split_indices("heldout")[0]  # a tone group is the emoji's five single-tone variants, in order
    assert index in tone_group(index) and [emoji[i].tones for i in tone_group(index)] == [(tone,) for tone in TONES]
    assert tone_group(0) == ()  # grinning face: no tones


def test_the_documented_build_commands_run_on_the_npm_layout(script, tmp_path, monkeypatch):
    install, *builds = block("docs/emoji.md", "The pictures and their names").strip().splitlines()
    assert install.startswith("npm install emoji-datasource-google@16.0.0 cldr-annotations-full@48.2.0")
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
    sources = world["sources"]
    assert sources["emoji-datasource-google"]["version"] == "16.0.0"
    annotations = cldr / "annotations" / "en" / "annotations.json"
    assert sources["cldr-annotations-full"]["annotations/en/annotations.json sha256"] == (
        hashlib.sha256(annotations.read_bytes()).hexdigest()
    )
    assert {path.name for path in out.iterdir()} == {
        "world.json", "emoji-32.png", "NOTICE", "LICENSE-emoji-datasource", "LICENSE-cldr", "LICENSE-noto-emoji",
    }  # fmt: skip
