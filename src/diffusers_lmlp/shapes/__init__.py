"""The shapes world: the procedural, captioned image world that is the embedded default for training, the demo
and the tests (no downloads needed).

Its names import lazily (`diffusers_lmlp.exports.lazy_exports`).
"""

from typing import TYPE_CHECKING

from ..exports import lazy_exports


_EXPORTS = {
    "pretrained_shapes_pipeline": ".pretrained",
    "parse_caption": ".scorer",
    "score_image": ".scorer",
    "score_images": ".scorer",
    "shapes_components": ".text",
    "shapes_text_encoder": ".text",
    "shapes_tokenizer": ".text",
    "ShapeSpec": ".world",
    "all_specs": ".world",
    "describe": ".world",
    "held_out_specs": ".world",
    "make_dataset": ".world",
    "phrasings": ".world",
    "render": ".world",
    "train_specs": ".world",
    "write_imagefolder": ".world",
}
__all__ = [
    "ShapeSpec",
    "all_specs",
    "describe",
    "held_out_specs",
    "make_dataset",
    "parse_caption",
    "phrasings",
    "pretrained_shapes_pipeline",
    "render",
    "score_image",
    "score_images",
    "shapes_components",
    "shapes_text_encoder",
    "shapes_tokenizer",
    "train_specs",
    "write_imagefolder",
]
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from .pretrained import pretrained_shapes_pipeline  # noqa: F401
    from .scorer import parse_caption, score_image, score_images  # noqa: F401
    from .text import shapes_components, shapes_text_encoder, shapes_tokenizer  # noqa: F401
    from .world import (
        ShapeSpec,
        all_specs,
        describe,
        held_out_specs,
        make_dataset,
        phrasings,
        render,
        train_specs,
        write_imagefolder,
    )  # noqa: F401
