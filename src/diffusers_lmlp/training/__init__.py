"""Training as library code; the command is `diffusers_lmlp.train`. `trainer` runs it (its options: `arguments`);
`components`, `data` and `features` make the model and its batches; `step` is one optimizer step; `checkpoints`,
`validation` and `finishing` save, guard, score and end the run. Its names import lazily.
"""

from typing import TYPE_CHECKING

from ..exports import lazy_exports


_EXPORTS = {
    "CHECKPOINT_PATTERN": ".arguments",
    "TrainingConfig": ".arguments",
    "checkpoint_step": ".arguments",
    "exclusive_output_dir": ".checkpoints",
    "list_checkpoints": ".arguments",
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
    "encode_text": ".features",
    "extract_features": ".features",
    "feature_store_key": ".features",
    "open_feature_store": ".features",
    "format_run_summary": ".finishing",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from ..evaluation.captions import captions_of  # noqa: F401
    from .arguments import CHECKPOINT_PATTERN, TrainingConfig, checkpoint_step, list_checkpoints  # noqa: F401
    from .checkpoints import (  # noqa: F401
        exclusive_output_dir,
        register_checkpoint_hooks,
        save_checkpoint,
        saved_train_seconds,
        warn_about_later_checkpoints,
    )
    from .data import DATA_LAYOUTS, load_coco2014, load_training_data, preprocess_image  # noqa: F401
    from .features import (  # noqa: F401
        TEXT_DTYPES,
        FeatureStore,
        encode_text,
        extract_features,
        feature_store_key,
        open_feature_store,
    )
    from .finishing import format_run_summary  # noqa: F401
