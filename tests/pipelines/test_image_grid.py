"""Captioned image grids: layout, crisp scaling, white gaps between cells, and bad input."""

import numpy as np
import pytest
from PIL import Image

from diffusers_lmlp.image_grid import make_image_grid


def tile(colour: tuple[int, int, int]) -> Image.Image:  # 4×4, top-left pixel black: shows nearest-neighbour scaling
    pixels = np.full((4, 4, 3), colour, np.uint8)
    pixels[0, 0] = 0
    return Image.fromarray(pixels)


def test_grid_places_images_crisply_with_white_gaps_and_captions_under_them():
    colours = [(200, 0, 0), (0, 200, 0), (0, 0, 200)]
    grid = np.asarray(make_image_grid([tile(c) for c in colours], columns=2, cell=8, gap=2))
    assert grid.shape == (2 * 8 + 2, 2 * 8 + 2, 3)  # 2 rows and 2 columns of 8 px cells, one 2 px gap each way
    for i, colour in enumerate(colours):
        y, x = (i // 2) * 10, (i % 2) * 10
        cell = grid[y : y + 8, x : x + 8]
        assert (cell[:2, :2] == 0).all()  # the black pixel, scaled ×2 with no blending
        assert (cell[2:, 2:] == colour).all()
    assert (grid[:, 8:10] == 255).all() and (grid[8:10, :] == 255).all()  # the gaps
    assert (grid[10:, 10:] == 255).all()  # the empty last cell
    grid = np.asarray(make_image_grid([tile((200, 0, 0))] * 2, captions=["red one", "a much longer caption"], cell=64))
    assert grid.shape[1] == 2 * 64 + 6
    ink = (grid[64:] < 128).any(axis=-1)  # dark pixels in the caption rows
    assert ink.shape[0] >= 12 and ink[:, :64].any() and ink[:, 70:].any()  # under the first image and the second
    with pytest.raises(ValueError, match="at least one image"):
        make_image_grid([])
    with pytest.raises(ValueError, match="Got 1 captions for 2 images"):
        make_image_grid([tile((0, 0, 0))] * 2, captions=["one"])
