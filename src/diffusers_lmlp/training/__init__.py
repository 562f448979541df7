"""Training as library code, run by `trainer` (the command: `diffusers_lmlp.train`); its main names import lazily."""

from ..exports import lazy_exports


_EXPORTS = {
    "TrainingConfig": ".arguments",
    "format_run_summary": ".finishing",
    **dict.fromkeys(["load_coco2014", "load_training_data", "preprocess_image"], ".data"),
    **dict.fromkeys(["FeatureStore", "encode_text", "extract_features", "open_feature_store"], ".features"),
    "feature_store_key": ".features",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
