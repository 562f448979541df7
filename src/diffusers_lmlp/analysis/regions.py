"""The token regions of a backbone's sequence, from its config: [time (1) | text (T) | image patches (N = g²)], the
patches row-major. The reference figure script draws its divider a token early; here the regions begin at 1, 1 + T."""

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class TokenRegions:
    """Where the time, text (`text_seq_len`) and image tokens (a `grid_size` × `grid_size` grid) lie."""

    text_seq_len: int
    grid_size: int

    @classmethod
    def from_config(cls, config: Mapping) -> "TokenRegions":
        """The regions of a backbone with this config (`model.config` or a config.json's contents)."""
        return cls(text_seq_len=config["text_seq_len"], grid_size=config["sample_size"] // config["patch_size"])

    @property
    def num_patches(self) -> int:
        return self.grid_size**2

    @property
    def seq_len(self) -> int:
        return 1 + self.text_seq_len + self.num_patches

    @property
    def text(self) -> range:
        return range(1, 1 + self.text_seq_len)

    @property
    def image(self) -> range:
        return range(1 + self.text_seq_len, self.seq_len)

    @property
    def boundaries(self) -> tuple[int, int]:
        """Where the text and the image regions begin (the figures' red lines)."""
        return (self.text.start, self.image.start)

    def describe(self) -> str:
        """The layout in words: "L = 27: 1 time + 10 text + 16 image tokens (4 × 4 patches)"."""
        g = self.grid_size
        tokens = f"1 time + {self.text_seq_len} text + {self.num_patches} image tokens ({g} × {g} patches)"
        return f"L = {self.seq_len}: {tokens}"

    def to_json(self) -> dict:
        """The layout for a report: L, each region as [start, stop) and the grid side."""
        text, image = [self.text.start, self.text.stop], [self.image.start, self.image.stop]
        return {"seq_len": self.seq_len, "time": [0, 1], "text": text, "image": image, "patch_grid": self.grid_size}
