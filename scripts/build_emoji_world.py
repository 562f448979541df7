#!/usr/bin/env python
"""Build the emoji world from the Noto Color Emoji pictures and their Unicode and CLDR names, offline.

    npm install emoji-datasource-google@16.0.0 cldr-annotations-full@48.2.0   # once, into ./node_modules
    python scripts/build_emoji_world.py                       # the shipped 32×32 world, into the package
    python scripts/build_emoji_world.py --size 64 --output-dir emoji-world-64

It reads `emoji.json` and the 64×64 Google (Noto) PNGs of `emoji-datasource-google`, and the English annotations of
`cldr-annotations-full`. Every picture (1,911 emoji and 1,875 skin-tone variants) is composited on white and
box-filtered to `--size`, then written in `emoji.json`'s sort order as one PNG sheet, `--columns` pictures a row.
`world.json` holds, per picture, its `unified` id, its plain name, its phrasings, its category and tones, and whether
it is held out of training; and the versions and sha256 of everything read. The licences and a NOTICE go beside it.
"""

import argparse
import hashlib
import json
import re
import shutil
from pathlib import Path

import numpy as np
from PIL import Image


PACKAGE = Path(__file__).resolve().parents[1] / "src" / "diffusers_lmlp" / "emoji" / "assets" / "world"
# The skin-tone modifiers, in order, as `emoji.json` writes them.
TONES = ("1F3FB", "1F3FC", "1F3FD", "1F3FE", "1F3FF")
# Every HELD_OUT_STRIDE-th emoji with single-tone variants holds one of them out (the tones in turn): a tenth of the
# single-tone variants, each base keeping four tones and its default picture, each tone kept on most bases.
HELD_OUT_STRIDE = 2
NOTICE = """The emoji world of diffusers-lmlp

The pictures are the Noto Color Emoji images (Copyright Google Inc., Apache License 2.0, see LICENSE-noto-emoji),
as the npm package emoji-datasource-google@{datasource} ships them at 64x64 pixels, composited on white and resized
to {size}x{size}. Their names, categories and sort order are that package's emoji.json (Copyright Cal Henderson, MIT
License, see LICENSE-emoji-datasource). Short names, keywords and the skin-tone words are the English annotations
of the Unicode CLDR, npm package cldr-annotations-full@{cldr} (Copyright Unicode, Inc., Unicode License v3, see
LICENSE-cldr). The captions are built from them by scripts/build_emoji_world.py.
"""


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def characters(unified: str) -> str:
    """The emoji's characters from its code points ("1F3C4-1F3FF" -> 🏄🏿)."""
    return "".join(chr(int(point, 16)) for point in unified.split("-"))


def article(phrase: str) -> str:
    return ("an " if phrase[0] in "aeiou" else "a ") + phrase


def phrasings(plain: str, short: str, keywords: list[str], category: str, tone: str | None) -> list[str]:
    """The captions of one picture, the plain name first: as people write them, from its names, keywords, category
    and tone ("a red apple", "red apple emoji", "a red apple, fruit", "food and drink: red apple")."""
    with_tone = (lambda text: f"{text} with {tone}") if tone else (lambda text: text)
    after_tone = (lambda text: f"{text}, {tone}") if tone else (lambda text: text)
    captions = [
        plain if tone is None else f"{plain}: {tone}",
        with_tone(article(short)),
        after_tone(f"{short} emoji"),
        after_tone(f"{category}: {short}"),
        *(after_tone(f"{article(short)}, {keyword}") for keyword in keywords[:2]),
    ]
    return list(dict.fromkeys(captions))


def read_annotations(cldr: Path) -> dict[str, dict]:
    with open(cldr / "annotations" / "en" / "annotations.json", encoding="utf-8") as f:
        return json.load(f)["annotations"]["annotations"]


def annotation(annotations: dict, unified: str) -> dict:
    """The CLDR entry of an emoji (with or without its variation selectors), or an empty one."""
    chars = characters(unified)
    return annotations.get(chars) or annotations.get(chars.replace("\ufe0f", "")) or {}


def picture(path: Path, size: int) -> np.ndarray:
    """An emoji PNG composited on white at its own size, then box-filtered to size×size: (size, size, 3) uint8."""
    image = Image.open(path).convert("RGBA")
    white = Image.new("RGBA", image.size, (255, 255, 255, 255))
    return np.asarray(Image.alpha_composite(white, image).convert("RGB").resize((size, size), Image.BOX))


def build(datasource: Path, cldr: Path, size: int) -> tuple[list[dict], list[np.ndarray], dict]:
    """Every picture's record and image, in `emoji.json`'s sort order (each emoji, then its tone variants), and what
    was read."""
    emoji_file = datasource / "emoji.json"
    emoji = sorted(json.loads(emoji_file.read_text(encoding="utf-8")), key=lambda e: e["sort_order"])
    annotations = read_annotations(cldr)
    tone_words = {tone: annotation(annotations, tone)["tts"][0] for tone in TONES}
    records, images, image_hashes = [], [], hashlib.sha256()
    single_tone_bases = 0
    for entry in emoji:
        names = annotation(annotations, entry["unified"])
        plain = entry["name"].lower()
        short = names.get("tts", [plain])[0].lower()
        keywords = [k.lower() for k in names.get("default", []) if k.lower() not in short.split()]
        category = entry["category"].lower().replace("&", "and")
        variants = [(entry["unified"], entry["image"], ())]
        variants += [
            (v["unified"], v["image"], tuple(key.split("-"))) for key, v in entry.get("skin_variations", {}).items()
        ]
        held_out_tone = None
        if any(len(set(tones)) == 1 for _, _, tones in variants):
            if single_tone_bases % HELD_OUT_STRIDE == 0:
                held_out_tone = TONES[(single_tone_bases // HELD_OUT_STRIDE) % len(TONES)]
            single_tone_bases += 1
        for unified, image, tones in variants:
            words = ", ".join(tone_words[t] for t in dict.fromkeys(tones)) or None
            path = datasource / "img" / "google" / "64" / image
            image_hashes.update(f"{image} {sha256(path)}\n".encode())
            images.append(picture(path, size))
            records.append(
                {
                    "unified": unified,
                    "base": entry["unified"],
                    "name": plain if words is None else f"{plain}: {words}",
                    "captions": phrasings(plain, short, keywords, category, words),
                    "category": entry["category"],
                    "subcategory": entry["subcategory"],
                    "tones": list(dict.fromkeys(tones)),
                    "held_out": len(set(tones)) == 1 and tones[0] == held_out_tone,
                }
            )
    package = lambda folder: json.loads((folder / "package.json").read_text(encoding="utf-8"))["version"]  # noqa: E731
    sources = {
        "emoji-datasource-google": {
            "version": package(datasource),
            "emoji.json sha256": sha256(emoji_file),
            "img/google/64 sha256": image_hashes.hexdigest(),
        },
        "cldr-annotations-full": {
            "version": package(cldr),
            "annotations/en/annotations.json sha256": sha256(cldr / "annotations" / "en" / "annotations.json"),
        },
    }
    return records, images, sources


def write_sheet(images: list[np.ndarray], columns: int, path: Path) -> None:
    """The pictures in rows of `columns`, on white, as one PNG (picture i at row i // columns, column i % columns)."""
    size = images[0].shape[0]
    rows = -(-len(images) // columns)
    sheet = np.full((rows * size, columns * size, 3), 255, np.uint8)
    for i, image in enumerate(images):
        row, column = divmod(i, columns)
        sheet[row * size : (row + 1) * size, column * size : (column + 1) * size] = image
    Image.fromarray(sheet).save(path, optimize=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--emoji-datasource", type=Path, default=Path("node_modules/emoji-datasource-google"))
    parser.add_argument("--cldr-annotations", type=Path, default=Path("node_modules/cldr-annotations-full"))
    parser.add_argument("--size", type=int, choices=(32, 64), default=32)
    parser.add_argument("--columns", type=int, default=64)
    parser.add_argument("--output-dir", type=Path, default=PACKAGE)
    args = parser.parse_args(argv)
    for option, folder, inside in (
        ("--emoji-datasource", args.emoji_datasource, "emoji.json"),
        ("--cldr-annotations", args.cldr_annotations, "annotations/en/annotations.json"),
    ):
        if not (folder / inside).is_file():
            parser.error(
                f"{option} {folder} has no {inside}: run `npm install emoji-datasource-google@16.0.0 "
                f"cldr-annotations-full@48.2.0` here, or pass the folder of the installed npm package"
            )

    records, images, sources = build(args.emoji_datasource, args.cldr_annotations, args.size)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    sheet = f"emoji-{args.size}.png"
    write_sheet(images, args.columns, args.output_dir / sheet)
    world = {"sheet": sheet, "size": args.size, "columns": args.columns, "sources": sources, "emoji": records}
    (args.output_dir / "world.json").write_text(json.dumps(world, ensure_ascii=False, indent=0) + "\n", "utf-8")
    shutil.copyfile(args.emoji_datasource / "LICENSE", args.output_dir / "LICENSE-emoji-datasource")
    shutil.copyfile(args.cldr_annotations / "LICENSE", args.output_dir / "LICENSE-cldr")
    shutil.copyfile(Path(__file__).resolve().parents[1] / "LICENSE", args.output_dir / "LICENSE-noto-emoji")
    versions = {name: source["version"] for name, source in sources.items()}
    notice = NOTICE.format(
        datasource=versions["emoji-datasource-google"], cldr=versions["cldr-annotations-full"], size=args.size
    )
    (args.output_dir / "NOTICE").write_text(notice, encoding="utf-8")
    held_out = sum(record["held_out"] for record in records)
    print(
        f"wrote {args.output_dir}: {len(records):,} pictures at {args.size}×{args.size} "
        f"({sum(not r['tones'] for r in records):,} emoji, {sum(bool(r['tones']) for r in records):,} tone variants), "
        f"{held_out} held out; {re.sub(r'[{}]', '', json.dumps(versions))}"
    )


if __name__ == "__main__":
    main()
