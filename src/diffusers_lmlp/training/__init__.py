"""Training as library code; the command is `diffusers_lmlp.train`. `trainer` runs it (its options: `arguments`);
`components`, `data` and `features` make the model and its batches; `step` is one optimizer step; `checkpoints`,
`validation` and `finishing` save, guard, score and end the run. Its main names import lazily.
"""

from ..exports import lazy_exports


_EXPORTS = {
    "TrainingConfig": ".arguments",
    "load_coco2014": ".data",
    "load_training_data": ".data",
    "preprocess_image": ".data",
    "FeatureStore": ".features",
    "encode_text": ".features",
    "extract_features": ".features",
    "feature_store_key": ".features",
    "open_feature_store": ".features",
    "format_run_summary": ".finishing",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
