"""Training as library code, one concept per module; the command is `diffusers_lmlp.train`.

`trainer` runs it (options: `arguments`, `argument_checks`); `components`, `data`, `features` and `batches` make the
model and its batches; `step` is one optimizer step; `checkpoints`, `divergence`, `validation`, `finishing` and
`report` save, guard, score and end the run. Its names import lazily (`diffusers_lmlp.exports.lazy_exports`).
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
    "captions_of": "..evaluation.captions",
    "load_coco2014": ".data",
    "load_training_data": ".data",
    "preprocess_image": ".data",
    "TEXT_DTYPES": ".features",
    "FeatureStore": ".features",
    "encode_text": ".feature_extraction",
    "extract_features": ".feature_extraction",
    "feature_store_key": ".features",
    "open_feature_store": ".feature_extraction",
    "format_run_summary": ".report",
}
__all__ = [
    "CHECKPOINT_PATTERN",
    "DATA_LAYOUTS",
    "FeatureStore",
    "TEXT_DTYPES",
    "captions_of",
    "checkpoint_step",
    "encode_text",
    "exclusive_output_dir",
    "extract_features",
    "feature_store_key",
    "format_run_summary",
    "list_checkpoints",
    "load_coco2014",
    "load_training_data",
    "open_feature_store",
    "preprocess_image",
    "register_checkpoint_hooks",
    "save_checkpoint",
    "saved_train_seconds",
    "warn_about_later_checkpoints",
]
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from ..evaluation.captions import captions_of  # noqa: F401
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
    from .data import DATA_LAYOUTS, load_coco2014, load_training_data, preprocess_image  # noqa: F401
    from .feature_extraction import encode_text, extract_features, open_feature_store  # noqa: F401
    from .features import TEXT_DTYPES, FeatureStore, feature_store_key  # noqa: F401
    from .report import format_run_summary  # noqa: F401
