"""Training as library code: reading the data (`data`) and the on-disk feature store (`features`), used by
examples/train_text_to_image.py (which still holds the training loop and the checkpoints)."""

from .data import DATA_LAYOUTS, captions_of, load_coco2014, load_training_data, preprocess_image
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
    "load_coco2014",
    "load_training_data",
    "open_feature_store",
    "preprocess_image",
]
