"""The trained shapes pipeline that ships in the package: a real model that loads offline."""

from pathlib import Path
from typing import TYPE_CHECKING


if TYPE_CHECKING:
    from ..pipelines import LMLPPipeline


PIPELINE_PATH = Path(__file__).resolve().parent / "assets" / "pipeline"


def pretrained_shapes_pipeline(**kwargs) -> "LMLPPipeline":
    """Load the shipped `shapes-S` UL-MLP pipeline (trained by `examples/train_text_to_image.py`), offline: 32×32
    shapes-world images from captions such as "a large blue square at the center" (`assets/pipeline/README.md`).

    Args:
        **kwargs: Passed to `LMLPPipeline.from_pretrained` (e.g. `dtype`).
    """
    from ..pipelines import LMLPPipeline

    return LMLPPipeline.from_pretrained(PIPELINE_PATH, **kwargs)
