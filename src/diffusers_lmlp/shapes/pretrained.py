"""The trained shapes pipeline that ships in the package: a real model that loads offline."""

from pathlib import Path
from typing import TYPE_CHECKING


if TYPE_CHECKING:
    from ..pipelines import LMLPPipeline


PIPELINE_PATH = Path(__file__).resolve().parent / "assets" / "pipeline"


def pretrained_shapes_pipeline(**kwargs) -> "LMLPPipeline":
    """Load the `shapes-S` UL-MLP pipeline trained by `accelerate launch examples/train_text_to_image.py`.

    It generates 32×32 images of the shapes world from captions such as "a large blue square at the center"; its
    model card (`assets/pipeline/README.md`) has the training run and the scorer's figures.

    Args:
        **kwargs: Passed to `LMLPPipeline.from_pretrained` (e.g. `dtype`).
    """
    from ..pipelines import LMLPPipeline

    return LMLPPipeline.from_pretrained(PIPELINE_PATH, **kwargs)
