"""Training as library code: reading the data (`data`), the on-disk feature store (`features`) and durable writes
(`durable`), used by examples/train_text_to_image.py (which still holds the training loop and the checkpoints)."""

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


__all__ = [
    "DATA_LAYOUTS",
    "TEXT_DTYPES",
    "FeatureStore",
    "captions_of",
    "encode_text",
    "extract_features",
    "feature_store_key",
    "fsync_tree",
    "load_coco2014",
    "load_training_data",
    "open_feature_store",
    "preprocess_image",
]
