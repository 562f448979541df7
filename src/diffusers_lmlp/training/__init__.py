"""Training as library code: reading the data (`data`), the on-disk feature store (`features`), checkpoints
(`checkpoints`), durable writes (`durable`), progress bars that behave in log files (`progress`) and the end-of-run
summary (`report`), used by the trainer `diffusers_lmlp.train` (which holds the arguments and the training loop).

Its names import lazily (`diffusers_lmlp.exports.lazy_exports`).
"""

from typing import TYPE_CHECKING

from ..exports import lazy_exports


_EXPORTS = {
    "CHECKPOINT_PATTERN": ".checkpoints",
    "checkpoint_step": ".checkpoints",
    "exclusive_output_dir": ".checkpoints",
    "list_checkpoints": ".checkpoints",
    "register_checkpoint_hooks": ".checkpoints",
    "save_checkpoint": ".checkpoints",
    "saved_train_seconds": ".checkpoints",
    "warn_about_later_checkpoints": ".checkpoints",
    "DATA_LAYOUTS": ".data",
    "captions_of": ".data",
    "load_coco2014": ".data",
    "load_training_data": ".data",
    "preprocess_image": ".data",
    "fsync_tree": ".durable",
    "TEXT_DTYPES": ".features",
    "FeatureStore": ".features",
    "encode_text": ".features",
    "extract_features": ".features",
    "feature_store_key": ".features",
    "open_feature_store": ".features",
    "LineProgress": ".progress",
    "is_terminal": ".progress",
    "progress_bar": ".progress",
    "format_run_summary": ".report",
}
__all__ = [
    "CHECKPOINT_PATTERN",
    "DATA_LAYOUTS",
    "FeatureStore",
    "LineProgress",
    "TEXT_DTYPES",
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
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from .checkpoints import (
        CHECKPOINT_PATTERN,
        checkpoint_step,
        exclusive_output_dir,
        list_checkpoints,
        register_checkpoint_hooks,
        save_checkpoint,
        saved_train_seconds,
        warn_about_later_checkpoints,
    )  # noqa: F401
    from .data import DATA_LAYOUTS, captions_of, load_coco2014, load_training_data, preprocess_image  # noqa: F401
    from .durable import fsync_tree  # noqa: F401
    from .features import (
        TEXT_DTYPES,
        FeatureStore,
        encode_text,
        extract_features,
        feature_store_key,
        open_feature_store,
    )  # noqa: F401
    from .progress import LineProgress, is_terminal, progress_bar  # noqa: F401
    from .report import format_run_summary  # noqa: F401
