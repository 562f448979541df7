"""Confidence intervals of a world scorer's accuracies, by a bootstrap over captions, each with all its images: a
model that cannot draw a held-out combination fails on all its seeds, so they are not independent."""

import numpy as np


def correctness_columns(flags: np.ndarray) -> dict[str, np.ndarray]:
    """(N,) correctness columns per attribute, "colour+position" and "all" (every stated attribute right), from
    (N, 4) colour/shape/position/size verdicts of 1.0 / 0.0, NaN where the caption does not state one."""
    colour, shape, position, size = flags.T
    stated = ~np.isnan(flags)
    columns = {"colour": colour, "shape": shape, "position": position, "size": size}
    columns["colour+position"] = colour * position
    columns["all"] = np.where(stated, flags, 1.0).prod(axis=1)
    return columns


def bootstrap_intervals(
    flags: np.ndarray,
    captions: list[str],
    confidence: float = 0.95,
    num_resamples: int = 2000,
    seed: int = 0,
    columns: dict[str, np.ndarray] | None = None,
) -> dict[str, list[float]]:
    """`[low, high]` percentile interval of each accuracy column (`correctness_columns(flags)` unless `columns` is
    given), resampling captions with all their images; a column no caption states is left out."""
    if len(captions) != len(flags):
        raise ValueError(f"Pass one caption per row of flags (got {len(flags)} rows and {len(captions)} captions).")
    if not 0 < confidence < 1:
        raise ValueError(f"The confidence must lie strictly between 0 and 1; got {confidence}.")
    groups, group_of = np.unique(np.asarray(captions), return_inverse=True)
    rng = np.random.default_rng(seed)
    # How often each caption is drawn in each resample: (R, G).
    weights = rng.multinomial(len(groups), np.full(len(groups), 1 / len(groups)), size=num_resamples)
    tail = (1 - confidence) / 2 * 100
    intervals = {}
    for name, column in (correctness_columns(flags) if columns is None else columns).items():
        stated = ~np.isnan(column)
        if not stated.any():
            continue
        right = np.bincount(group_of[stated], weights=column[stated], minlength=len(groups))  # (G,)
        counted = np.bincount(group_of[stated], minlength=len(groups)).astype(float)  # (G,)
        means = (weights @ right) / np.maximum(weights @ counted, 1)  # (R,)
        intervals[name] = [float(np.percentile(means, tail)), float(np.percentile(means, 100 - tail))]
    return intervals
