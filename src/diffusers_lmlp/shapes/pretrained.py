"""The trained shapes pipeline that ships in the package: a real model that loads offline."""

from pathlib import Path


PIPELINE_PATH = Path(__file__).resolve().parent / "assets" / "pipeline"


def pretrained_shapes_pipeline(**kwargs):
    """Load the shipped `shapes-S` UL-MLP pipeline offline: 32×32 images from captions such as "a large blue square
    at the center" (`assets/pipeline/README.md`); `kwargs` go to `LMLPPipeline.from_pretrained` (e.g. `dtype`)."""
    from ..pipelines import LMLPPipeline

    return LMLPPipeline.from_pretrained(PIPELINE_PATH, **kwargs)
