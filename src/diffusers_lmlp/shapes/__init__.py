"""The shapes world: the procedural, captioned image world that is the embedded default for training, the demo
and the tests (no downloads needed). Its names import lazily (`diffusers_lmlp.exports.lazy_exports`)."""

from typing import TYPE_CHECKING

from ..exports import lazy_exports


_MODULES = {
    ".features": ("ShapesFeatureNetwork", "pretrained_shapes_features"),
    ".pretrained": ("pretrained_shapes_pipeline",),
    ".scorer": ("parse_caption", "score_image", "score_images"),
    ".text": ("shapes_components", "shapes_text_encoder", "shapes_tokenizer"),
    ".world": ("ShapeSpec", "all_specs", "describe", "held_out_specs", "make_dataset", "phrasings", "render",
               "train_specs", "write_imagefolder"),
}  # fmt: skip
_EXPORTS = {name: module for module, names in _MODULES.items() for name in names}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from .features import ShapesFeatureNetwork, pretrained_shapes_features  # noqa: F401
    from .pretrained import pretrained_shapes_pipeline  # noqa: F401
    from .scorer import parse_caption, score_image, score_images  # noqa: F401
    from .text import shapes_components, shapes_text_encoder, shapes_tokenizer  # noqa: F401
    from .world import (  # noqa: F401
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
