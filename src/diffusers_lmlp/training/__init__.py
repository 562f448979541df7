"""Training as library code: reading the data (`data`), the on-disk feature store (`features`), checkpoints
(`checkpoints`), durable writes (`durable`), progress bars that behave in log files (`progress`) and the end-of-run
summary (`report`), used by the trainer `diffusers_lmlp.train` (which holds the arguments and the training loop)."""

from .checkpoints import (
    CHECKPOINT_PATTERN,
    checkpoint_step,
    exclusive_output_dir,
    list_checkpoints,
    register_checkpoint_hooks,
    save_checkpoint,
    saved_train_seconds,
    warn_about_later_checkpoints,
)
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
    "CHECKPOINT_PATTERN",
    "DATA_LAYOUTS",
    "TEXT_DTYPES",
    "FeatureStore",
    "LineProgress",
    "captions_of",
    "checkpoint_step",
    "encode_text",
    "exclusive_output_dir",
    "extract_features",
    "feature_store_key",
    "format_run_summary",
    "fsync_tree",
    "is_terminal",
    "list_checkpoints",
    "load_coco2014",
    "load_training_data",
    "open_feature_store",
    "preprocess_image",
    "progress_bar",
    "register_checkpoint_hooks",
    "save_checkpoint",
    "saved_train_seconds",
    "warn_about_later_checkpoints",
]
