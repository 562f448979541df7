"""Renamed public names keep working for one release, with a FutureWarning, and are gone by their version."""

import importlib
import warnings

import pytest
import torch
from packaging.version import Version

import diffusers_lmlp
from diffusers_lmlp import MoEMLPModel
from diffusers_lmlp.tiny import RENAMED_BACKBONES_REMOVED_IN, build_tiny_pipeline


def test_the_old_backbone_name_moe_warns_and_builds_the_moe_mlp_pipeline():
    expected = (
        r"build_tiny_pipeline\(backbone='moe'\) is deprecated and will be removed in diffusers-lmlp 0\.2\.0\. The "
        r"family is now called 'moe_mlp'"
    )
    with pytest.warns(FutureWarning, match=expected):
        old = build_tiny_pipeline("moe")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        new = build_tiny_pipeline("moe_mlp")
    assert type(old.transformer) is MoEMLPModel
    assert old.transformer.config == new.transformer.config
    torch.testing.assert_close(old.transformer.state_dict(), new.transformer.state_dict(), rtol=0, atol=0)


def test_deprecated_names_are_removed_by_their_version():
    assert Version(diffusers_lmlp.__version__) < Version(RENAMED_BACKBONES_REMOVED_IN), (
        f"diffusers-lmlp {diffusers_lmlp.__version__} has reached {RENAMED_BACKBONES_REMOVED_IN}: remove "
        "RENAMED_BACKBONES from diffusers_lmlp/tiny.py."
    )


def test_a_deprecation_past_its_removal_version_fails_so_that_it_is_removed(monkeypatch):
    from diffusers_lmlp.deprecation import deprecate

    with pytest.warns(
        FutureWarning, match=r"^`old_name` is deprecated and will be removed in diffusers-lmlp 0\.2\.0\. "
    ):
        deprecate("`old_name`", "0.2.0", "Use `new_name`.")
    monkeypatch.setattr(diffusers_lmlp, "__version__", "0.2.0")
    with pytest.raises(RuntimeError, match="was to be removed in diffusers-lmlp 0.2.0"):
        deprecate("`old_name`", "0.2.0", "Use `new_name`.")


def test_analytic_complexitys_former_config_keyword_warns_and_counts_the_same():
    from diffusers_lmlp.complexity import analytic_complexity
    from diffusers_lmlp.models.catalog import SHAPES_SMALL

    with pytest.warns(FutureWarning, match=r"^analytic_complexity\(config=\.\.\.\) is deprecated .* 0\.2\.0\. Pass"):
        old = analytic_complexity(config=SHAPES_SMALL, family="lmlp")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        new = analytic_complexity(SHAPES_SMALL, family="lmlp")
    assert old == new and new.params > 0
    with pytest.raises(TypeError, match="got both model and config"):
        analytic_complexity(SHAPES_SMALL, family="lmlp", config=SHAPES_SMALL)


# The trainer's rooms: each name that left `training.trainer`, `.arguments`, `.features` or `.data`, by its new module.
MOVED_TRAINING_NAMES = {
    "trainer": {
        "components": (
            "routes",
            "build_model",
            "build_new_model",
            "load_components",
            "loading_from",
            "check_compatible",
            "vae_latent_size",
        ),
        "batches": ("step_generator", "build_feature_store", "BatchReader", "StepBatches", "BatchSource"),
        "validation": (
            "SCORES_FILE",
            "generate",
            "build_pipeline",
            "default_validation_prompts",
            "final_evaluation",
            "evaluate_splits",
            "score_summary",
            "ema_weights",
            "validate",
            "keep_scores_until",
            "log_scores",
        ),
        "divergence": ("diverged_message", "require_finite_weights"),
        "finishing": (
            "TEARDOWN_TIMEOUT_SECONDS",
            "SECRET_ARGUMENTS",
            "public_args",
            "ranks_in_sync",
            "finish",
            "leave_finished_process",
        ),
    },
    "arguments": {
        "argument_checks": (
            "SKELETON_FIELDS",
            "model_class_of",
            "validate_args",
            "earlier_run",
            "validate_lora_args",
            "resolve_model_type",
            "parse_overrides",
            "accepted_keys",
            "check_config_values",
            "read_model_config_file",
            "value_fits",
            "check_component_sources",
            "is_local",
            "require_files",
        ),
    },
    "features": {
        "feature_extraction": (
            "write_json",
            "encode_text",
            "ShardWriter",
            "ShardBatches",
            "extract_features",
            "refuse_non_finite",
            "image_file",
            "caption_counts",
            "open_shard",
            "write_manifest",
            "open_feature_store",
            "log_stores_of_other_formats",
        ),
    },
    "data": {
        "imagefolder": (
            "CSV_MISSING_VALUES",
            "imagefolder_split",
            "split_of",
            "no_metadata_message",
            "check_metadata_file",
            "row_problem",
            "caption_kind_problem",
            "is_file",
            "missing_caption_column_message",
            "metadata_rows",
        ),
    },
}


@pytest.mark.parametrize(
    ("old", "name", "new"),
    [
        (old, name, new)
        for old, rooms in MOVED_TRAINING_NAMES.items()
        for new, names in rooms.items()
        for name in names
    ],
)
def test_a_training_name_that_moved_warns_at_its_old_path_and_is_the_same_object(old, name, new):
    old_module = importlib.import_module(f"diffusers_lmlp.training.{old}")
    new_module = importlib.import_module(f"diffusers_lmlp.training.{new}")
    expected = (
        rf"^`diffusers_lmlp\.training\.{old}\.{name}` is deprecated and will be removed in diffusers-lmlp 0\.2\.0\. "
        rf"Import it from `diffusers_lmlp\.training\.{new}`\.$"
    )
    with pytest.warns(FutureWarning, match=expected):
        assert getattr(old_module, name) is getattr(new_module, name)


def test_the_names_that_stayed_in_the_trainers_modules_import_without_a_warning():
    from diffusers_lmlp.training import arguments, data, features, trainer

    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        assert callable(trainer.train) and callable(trainer.run_training) and callable(arguments.parse_args)
        assert arguments.PRESETS and features.FeatureStore and features.TEXT_DTYPES
        assert callable(data.load_training_data) and callable(data.load_imagefolder) and callable(data.captions_of)
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        trainer.no_such_name  # noqa: B018
