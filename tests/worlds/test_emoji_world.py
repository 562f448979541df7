"""The emoji world: `scripts/build_emoji_world.py` on npm-layout stand-ins, and the shipped world."""

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from benchmark_scripts import load_benchmark
from PIL import Image

from diffusers_lmlp.emoji import HELD_OUT, load_emoji, load_images, make_dataset, split_indices, tone_group
from diffusers_lmlp.emoji.world import VALIDATION_PROMPTS, WORLD_PATH


ROOT = Path(__file__).resolve().parents[2]
TONES = ("1F3FB", "1F3FC", "1F3FD", "1F3FE", "1F3FF")
TONE_WORDS = (
    "light skin tone",
    "medium-light skin tone",
    "medium skin tone",
    "medium-dark skin tone",
    "dark skin tone",
)


@pytest.fixture(scope="module")
def script():
    return load_benchmark("build_emoji_world", "scripts")


def png(path: Path, rgba: tuple[int, int, int, int]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGBA", (64, 64), rgba).save(path)


def npm_stand_ins(root: Path) -> tuple[Path, Path]:
    """The two npm packages' layout with an apple and two hands (five tones each), out of sort order."""
    datasource, cldr = root / "emoji-datasource-google", root / "cldr-annotations-full"

    def entry(unified, name, order, category, subcategory, tones=False):
        record = {
            "name": name, "unified": unified, "image": f"{unified.lower()}.png", "sort_order": order,
            "category": category, "subcategory": subcategory, "has_img_google": True,
        }  # fmt: skip
        png(datasource / "img" / "google" / "64" / record["image"], (200, 30, 30, 128))
        if tones:
            record["skin_variations"] = {}
            for i, tone in enumerate(TONES):
                variant = f"{unified}-{tone}"
                record["skin_variations"][tone] = {"unified": variant, "image": f"{variant.lower()}.png"}
                png(datasource / "img" / "google" / "64" / f"{variant.lower()}.png", (40 * i, 90, 90, 255))
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


def test_the_build_script_writes_the_world_from_the_npm_layout(script, tmp_path):
    datasource, cldr = npm_stand_ins(tmp_path / "node_modules")
    out = tmp_path / "world"
    script.main(["--emoji-datasource", str(datasource), "--cldr-annotations", str(cldr), "--output-dir", str(out)])
    world = json.loads((out / "world.json").read_text(encoding="utf-8"))
    names = [record["name"] for record in world["emoji"]]
    # emoji.json's sort order, each emoji then its variants; the plain name is the lowercased name, a colon and tone.
    assert names[:3] == ["red apple", "waving hand sign", "waving hand sign: light skin tone"]
    assert names[-1] == "victory hand: dark skin tone" and len(names) == 13
    apple = world["emoji"][0]
    assert apple["captions"][0] == "red apple" and "red apple emoji" in apple["captions"]
    assert "a red apple, fruit" in apple["captions"] and "food and drink: red apple" in apple["captions"]
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
    assert (
        sources["cldr-annotations-full"]["annotations/en/annotations.json sha256"]
        == hashlib.sha256((cldr / "annotations" / "en" / "annotations.json").read_bytes()).hexdigest()
    )
    assert {path.name for path in out.iterdir()} == {
        "world.json", "emoji-32.png", "NOTICE", "LICENSE-emoji-datasource", "LICENSE-cldr", "LICENSE-noto-emoji",
    }  # fmt: skip


def test_the_build_script_names_the_npm_install_when_a_package_is_missing(script, tmp_path, capsys):
    with pytest.raises(SystemExit):
        script.main(["--emoji-datasource", str(tmp_path / "missing")])
    assert "npm install emoji-datasource-google@16.0.0 cldr-annotations-full@48.2.0" in capsys.readouterr().err


def test_the_shipped_world_holds_every_picture_with_its_plain_name():
    emoji, images = load_emoji(), load_images()
    assert len(emoji) == 3786 and images.shape == (3786, 32, 32, 3)
    assert sum(not e.tones for e in emoji) == 1911
    names = {e.name for e in emoji}
    assert {"extraterrestrial alien", "surfer: dark skin tone", "red apple"} <= names
    assert all(e.captions[0] == e.name and len(e.captions) >= 4 for e in emoji)
    assert (images[:, 0, 0] == 255).all(axis=-1).mean() > 0.9  # composited on white
    size = sum(path.stat().st_size for path in WORLD_PATH.iterdir())
    assert size <= 6_000_000


def test_a_tenth_of_the_single_tone_variants_is_held_out_keeping_every_tone_and_emoji():
    emoji = load_emoji()
    single = [e for e in emoji if len(e.tones) == 1]
    held = [e for e in emoji if e.held_out]
    assert tuple(e.unified for e in held) == HELD_OUT and len(HELD_OUT) == 162
    assert abs(len(held) / len(single) - 0.1) < 0.005 and all(len(e.tones) == 1 for e in held)
    train = [emoji[i] for i in split_indices("train")]
    assert len(train) + len(held) == len(emoji)
    for e in held:  # its emoji keeps its default picture and four tones in training
        kept = [t for t in train if t.base == e.base and len(t.tones) <= 1]
        assert len(kept) == 5
    for tone in TONES:  # every tone stays in training, on most emoji
        assert sum(1 for t in train if t.tones == (tone,)) > 250
    assert "surfer: dark skin tone" in {e.name for e in emoji if e.unified == "1F3C4-1F3FF"}


def test_a_tone_group_is_the_emojis_five_single_tone_variants_in_order():
    index = split_indices("heldout")[0]
    group = tone_group(index)
    assert index in group and [load_emoji()[i].tones for i in group] == [(tone,) for tone in TONES]
    assert tone_group(0) == ()  # grinning face: no tones


def test_the_validation_prompts_are_six_training_names_then_two_held_out():
    emoji = load_emoji()
    held = {emoji[i].name for i in split_indices("heldout")}
    train = {emoji[i].name for i in split_indices("train")}
    assert set(VALIDATION_PROMPTS[:6]) <= train and set(VALIDATION_PROMPTS[6:]) <= held


def test_the_training_dataset_has_every_phrasing_of_each_training_picture():
    dataset = make_dataset("train")
    assert len(dataset) == 3786 - 162
    row, first = dataset[0], load_emoji()[split_indices("train")[0]]
    assert row["text"] == list(first.captions) and row["image"].size == (32, 32)
    with pytest.raises(ValueError, match="choose one of"):
        make_dataset("test")


def test_the_documented_build_commands_run_on_the_npm_layout(script, tmp_path, monkeypatch):
    from documents import blocks, section

    [block] = blocks(section("docs/emoji.md", "The pictures and their names"), "bash")
    install, *builds = block.strip().splitlines()
    assert install.startswith("npm install emoji-datasource-google@16.0.0 cldr-annotations-full@48.2.0")
    npm_stand_ins(tmp_path / "node_modules")  # what that install leaves in ./node_modules
    monkeypatch.chdir(tmp_path)
    shipped = tmp_path / "shipped"  # the first command writes into the package: here, into a copy's place
    for command in builds:
        argv = command.split("#")[0].split()
        assert argv[:2] == ["python", "scripts/build_emoji_world.py"]
        extra = [] if "--output-dir" in argv else ["--output-dir", str(shipped)]
        script.main([*argv[2:], *extra])
    assert (shipped / "emoji-32.png").is_file()
    assert Image.open(tmp_path / "emoji-world-64" / "emoji-64.png").size == (64 * 64, 64)
    assert load_images(tmp_path / "emoji-world-64").shape == (13, 64, 64, 3)
