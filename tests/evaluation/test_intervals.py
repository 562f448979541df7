"""The bootstrap intervals of the shapes scorer's accuracies: resampling captions, not images."""

import numpy as np
import pytest

from diffusers_lmlp.evaluation.intervals import bootstrap_intervals, correctness_columns
from diffusers_lmlp.shapes.scorer import accuracies


def test_columns_match_the_scorer_accuracies_all_right_gives_a_point_interval_and_bad_arguments_are_named():
    flags = np.array([[1, 1, 1, 1], [1, 0, 1, np.nan], [0, 1, 1, 0], [1, 1, 1, np.nan]])
    results = [{k: bool(v) for k, v in zip(("colour", "shape", "position", "size"), row) if not np.isnan(v)}
               for row in flags]  # fmt: skip
    columns = correctness_columns(flags)
    assert {name: float(np.nanmean(column)) for name, column in columns.items()} == accuracies(results)
    # All right: a point interval, with unstated sizes left out.
    flags = np.ones((12, 4))
    flags[:, 3] = np.nan
    intervals = bootstrap_intervals(flags, [str(i % 3) for i in range(12)])
    assert "size" not in intervals and intervals["all"] == [1.0, 1.0]
    with pytest.raises(ValueError, match="one caption per row"):
        bootstrap_intervals(np.ones((3, 4)), ["a", "b"])
    with pytest.raises(ValueError, match="strictly between 0 and 1"):
        bootstrap_intervals(np.ones((2, 4)), ["a", "b"], confidence=1.0)


def test_intervals_contain_the_accuracy_are_reproducible_and_widen_for_a_caption_failing_on_every_seed():
    captions = [f"caption {i // 4}" for i in range(128)]  # 32 captions × 4 seeds
    flags = (np.random.default_rng(0).random((128, 4)) < [0.95, 0.6, 0.9, 0.8]).astype(float)
    intervals = bootstrap_intervals(flags, captions, seed=3)
    for name, column in correctness_columns(flags).items():
        assert intervals[name][0] <= column.mean() <= intervals[name][1]
    assert intervals == bootstrap_intervals(flags, captions, seed=3)
    # The same 16 failures out of 128 images: spread over 16 captions, or all on the 4 seeds of 4 captions.
    spread, clustered = np.ones((128, 4)), np.ones((128, 4))
    spread[np.arange(16) * 8, 1] = 0  # one seed of every other caption
    clustered[:16, 1] = 0  # every seed of the first 4 captions
    widths = [np.diff(bootstrap_intervals(f, captions)["shape"]).item() for f in (spread, clustered)]
    assert widths[1] > 1.5 * widths[0]
