"""Drawing for the analysis commands, with Pillow only: viridis heat maps (as the reference figure script) with red
lines at the token-region boundaries, in a labelled grid with a colour bar.

Each matrix entry is enlarged by a whole factor without smoothing, so single entries (a diagonal) stay visible.
"""

import math

import numpy as np
from PIL import Image, ImageDraw, ImageFont


# matplotlib's viridis at 0, 0.1, …, 1; colours in between are interpolated linearly.
VIRIDIS = np.array(
    [
        (68, 1, 84), (72, 36, 117), (65, 68, 135), (53, 95, 141), (42, 120, 142), (33, 145, 140),
        (34, 168, 132), (68, 191, 112), (122, 209, 81), (189, 223, 38), (253, 231, 37),
    ],
    dtype=np.float64,
)  # fmt: skip
RED = (230, 25, 25)
# A map smaller than this many pixels is enlarged by the smallest whole factor that reaches it.
PANEL_PIXELS = 256
FONT_SIZE = 13
GAP = 10
COLOUR_BAR_WIDTH, COLOUR_BAR_HEIGHT = 14, 100


def font() -> ImageFont.ImageFont:
    """The figures' font: Pillow's own, at `FONT_SIZE`."""
    return ImageFont.load_default(size=FONT_SIZE)


def drawable(text: str) -> str:
    """`text` as the figures' font can draw it: Pillow's own font has no ×, so it becomes x."""
    return text.replace("×", "x")


def colour(values: np.ndarray) -> np.ndarray:
    """(..., 3) uint8 viridis colours of values in [0, 1] (others are clipped)."""
    position = np.clip(values, 0.0, 1.0) * (len(VIRIDIS) - 1)
    low = np.minimum(np.floor(position).astype(int), len(VIRIDIS) - 2)
    fraction = (position - low)[..., None]
    return np.round(VIRIDIS[low] * (1 - fraction) + VIRIDIS[low + 1] * fraction).astype(np.uint8)


def heat_map(values: np.ndarray, boundaries: tuple[int, ...] = (), cell: tuple[int, int] | None = None) -> Image.Image:
    """A (rows, columns) matrix in [0, 1] as an image, with a red line before each of `boundaries`' rows and
    columns; `cell` is an entry's (height, width), by default the square that makes the map `PANEL_PIXELS` wide."""
    if cell is None:
        side = math.ceil(PANEL_PIXELS / max(values.shape))
        cell = (side, side)
    pixels = np.repeat(np.repeat(colour(values), cell[0], axis=0), cell[1], axis=1)  # (rows·h, columns·w, 3)
    image = Image.fromarray(pixels)
    draw = ImageDraw.Draw(image)
    width = max(1, min(cell) // 5)
    for boundary in boundaries:
        x, y = boundary * cell[1], boundary * cell[0]
        draw.line([(x, 0), (x, image.height)], fill=RED, width=width)
        draw.line([(0, y), (image.width, y)], fill=RED, width=width)
    return image


def grid_figure(
    title: str,
    notes: list[str],
    column_titles: list[str],
    row_titles: list[str],
    panels: list[list[Image.Image]],
) -> Image.Image:
    """`panels[row][column]` in a labelled grid under a title and notes, with a 0-to-1 colour bar on the right."""
    title, notes = drawable(title), [drawable(note) for note in notes]
    column_titles, row_titles = [drawable(t) for t in column_titles], [drawable(t) for t in row_titles]
    text = font()
    line = FONT_SIZE + 6
    cell_width = max(panel.width for row in panels for panel in row)
    cell_height = max(panel.height for row in panels for panel in row)
    label_width = int(max(text.getlength(row_title) for row_title in row_titles)) + 2 * GAP
    top = GAP + line * (2 + len(notes))  # the title, the notes, the column titles
    bar_left = label_width + len(column_titles) * (cell_width + GAP)
    notes_width = max(text.getlength(line_text) for line_text in [title, *notes])
    width = int(max(bar_left + COLOUR_BAR_WIDTH + 4 + text.getlength("1") + GAP, notes_width + 2 * GAP))
    height = top + len(row_titles) * (cell_height + GAP)
    figure = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(figure)
    for index, line_text in enumerate([title, *notes]):
        draw.text((GAP, GAP + index * line), line_text, fill="black", font=text)
    for column, column_title in enumerate(column_titles):
        x = label_width + column * (cell_width + GAP) + (cell_width - text.getlength(column_title)) / 2
        draw.text((x, top - line), column_title, fill="black", font=text)
    for row, (row_title, row_panels) in enumerate(zip(row_titles, panels)):
        y = top + row * (cell_height + GAP)
        draw.text((GAP, y + (cell_height - FONT_SIZE) / 2), row_title, fill="black", font=text)
        for column, panel in enumerate(row_panels):
            x = label_width + column * (cell_width + GAP)
            figure.paste(panel, (x + (cell_width - panel.width) // 2, y + (cell_height - panel.height) // 2))
    # The colour bar spans the first panel, and at least COLOUR_BAR_HEIGHT pixels where the panels are that tall.
    bar_height = min(height - top - GAP, max(cell_height, COLOUR_BAR_HEIGHT))
    gradient = np.linspace(1.0, 0.0, bar_height)[:, None].repeat(COLOUR_BAR_WIDTH, axis=1)  # (bar_height, width)
    figure.paste(Image.fromarray(colour(gradient)), (bar_left, top))
    draw.text((bar_left + COLOUR_BAR_WIDTH + 4, top), "1", fill="black", font=text)
    draw.text((bar_left + COLOUR_BAR_WIDTH + 4, top + bar_height - FONT_SIZE - 2), "0", fill="black", font=text)
    return figure
