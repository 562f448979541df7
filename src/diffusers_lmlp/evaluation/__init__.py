"""Evaluation the way the papers measure: FID against reference statistics (the standard Inception network, the
shapes world's feature network, or any module), CLIP score, and the shapes scorer's accuracies; from Python with
`evaluate`, or from the command line with `python -m diffusers_lmlp.evaluation`."""

from .captions import draw_captions, read_captions_file
from .clip_score import CLIPScorer
from .evaluate import Processes, evaluate
from .extractors import InceptionFeatures, load_extractor
from .fid import FeatureMoments, FIDStatistics, frechet_distance
from .reference import reference_statistics
from .shapes_features import ShapesFeatureNetwork, pretrained_shapes_features


__all__ = [
    "CLIPScorer",
    "FIDStatistics",
    "FeatureMoments",
    "InceptionFeatures",
    "Processes",
    "ShapesFeatureNetwork",
    "draw_captions",
    "evaluate",
    "frechet_distance",
    "load_extractor",
    "pretrained_shapes_features",
    "read_captions_file",
    "reference_statistics",
]
