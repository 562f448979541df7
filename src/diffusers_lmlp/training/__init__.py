"""Training as library code: reading the data (`data`), the on-disk feature store (`features`), durable writes
(`durable`), progress bars that behave in log files (`progress`) and the end-of-run summary (`report`), used by
examples/train_text_to_image.py (which still holds the training loop and the checkpoints)."""

from .data import DATA_LAYOUTS, captions_of, load_coco2014, load_training_data, preprocess_image
from .durable import fsync_tree
from .features import (
    TEXT_DTYPES,
    FeatureStore,
    encode_text,
    extract_features,
    feature_store_key,
    open_feature_store,
)
from .progress import LineProgress, is_terminal, progress_bar
from .report import format_run_summary


__all__ = [
    "DATA_LAYOUTS",
    "TEXT_DTYPES",
    "FeatureStore",
    "LineProgress",
    "captions_of",
    "encode_text",
    "extract_features",
    "feature_store_key",
    "format_run_summary",
    "fsync_tree",
    "is_terminal",
    "load_coco2014",
    "load_training_data",
    "open_feature_store",
    "preprocess_image",
    "progress_bar",
]
