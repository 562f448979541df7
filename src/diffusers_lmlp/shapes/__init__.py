"""The shapes world: the procedural, captioned image world that is the embedded default for training, the demo
and the tests (no downloads needed)."""

from .pretrained import pretrained_shapes_pipeline
from .scorer import parse_caption, score_image, score_images
from .text import shapes_components, shapes_text_encoder, shapes_tokenizer
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
)


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
