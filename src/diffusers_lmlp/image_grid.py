"""Captioned image grids: what a person looks at after training or sampling."""

import math

from PIL import Image, ImageDraw, ImageFont


def make_image_grid(
    images: list[Image.Image],
    captions: list[str] | None = None,
    columns: int | None = None,
    cell: int = 128,
    gap: int = 6,
) -> Image.Image:
    """Tile images in a near-square grid (or `columns` wide), each scaled to `cell` pixels (nearest neighbour, so
    small images stay crisp) with its caption wrapped beneath; `gap` white pixels keep like backgrounds apart."""
    if not images:
        raise ValueError("make_image_grid needs at least one image.")
    if captions is not None and len(captions) != len(images):
        raise ValueError(f"Got {len(captions)} captions for {len(images)} images; pass one caption per image.")
    columns = columns or math.ceil(math.sqrt(len(images)))
    rows = math.ceil(len(images) / columns)
    font = ImageFont.load_default()
    lines = [_wrap(c, font, cell) for c in captions] if captions else [[] for _ in images]
    text_height = max(len(wrapped) for wrapped in lines) * 12 + (4 if captions else 0)
    step_x, step_y = cell + gap, cell + text_height + gap
    grid = Image.new("RGB", (columns * step_x - gap, rows * step_y - gap), "white")
    draw = ImageDraw.Draw(grid)
    for i, (image, wrapped) in enumerate(zip(images, lines)):
        x, y = (i % columns) * step_x, (i // columns) * step_y
        grid.paste(image.convert("RGB").resize((cell, cell), Image.Resampling.NEAREST), (x, y))
        for j, line in enumerate(wrapped):
            draw.text((x + 2, y + cell + 2 + 12 * j), line, fill="black", font=font)
    return grid


def _wrap(text: str, font: ImageFont.ImageFont, width: int) -> list[str]:
    lines, line = [], ""
    for word in text.split():
        candidate = f"{line} {word}".strip()
        if line and font.getlength(candidate) > width - 4:
            lines.append(line)
            candidate = word
        line = candidate
    return lines + [line] if line else lines
