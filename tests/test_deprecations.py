"""Renamed public names keep working for one release, with a FutureWarning, and are gone by their version."""

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
