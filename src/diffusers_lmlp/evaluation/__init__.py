"""Evaluation as the papers measure it: FID, CLIP score and the world scorers' accuracies; `evaluate` from Python,
`python -m diffusers_lmlp.evaluation` from the shell. Names import lazily (`exports.lazy_exports`)."""

from typing import TYPE_CHECKING

from ..exports import lazy_exports

# Imported eagerly so that the package attribute `evaluate` is the function, not its same-named module.
from .evaluate import Processes, evaluate  # noqa: F401


_MODULES = {
    ".captions": ("draw_captions", "read_captions_file"),
    ".clip_score": ("CLIPScorer",),
    ".fid": ("FeatureMoments", "FIDStatistics", "frechet_distance", "InceptionFeatures", "load_extractor",
             "reference_statistics"),
}  # fmt: skip
_EXPORTS = {name: module for module, names in _MODULES.items() for name in names}
__all__ = sorted([*_EXPORTS, "Processes", "evaluate"])
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from .captions import draw_captions, read_captions_file  # noqa: F401
    from .clip_score import CLIPScorer  # noqa: F401
    from .fid import (  # noqa: F401
        FeatureMoments,
        FIDStatistics,
        InceptionFeatures,
        frechet_distance,
        load_extractor,
        reference_statistics,
    )
