"""Training as library code, one concept per module. The trainer's command is `diffusers_lmlp.train`; its rooms:

- `arguments`: the option table and the presets; `argument_checks`: the start-up checks of a command.
- `trainer`: the run, from the accelerator's set-up to the finished pipeline, and its loop of steps.
- `components`: the backbone and the frozen tokenizer, text encoder and VAE, and their compatibility checks.
- `data`: reading the training data (COCO-2014, the Hub, the shapes world; `imagefolder`: an imagefolder and the
  checks of its metadata; `captions`: what a caption is).
- `features`: the on-disk feature store's format and its reading; `feature_extraction`: extracting and writing one.
- `batches`: each step's batch, read ahead by `DataLoader` workers from the feature store or the images.
- `step`: one optimizer step (the loss, accumulation, clipping, the EMA update).
- `checkpoints` (and `checkpoint_folders`): where a checkpoint is written, kept and resumed from.
- `divergence`: what a run does when its loss, gradients or weights stop being finite.
- `validation`: the samples and scores during training, and the final evaluation on the shapes world.
- `finishing`: the end of a run: the saved pipeline or adapter, its card and summary, the push, leaving together.
- `lora`, `precision`, `compilation`, `sources`: LoRA adapters, mixed precision, `torch.compile`, where the frozen
  components load from; the end-of-run `report`.

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
