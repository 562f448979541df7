"""The numbers behind the L-MLP paper's Fig. 6 claims, and the MoE-MLP routers' load balance: torch only, no drawing.

Every token-mixing measure reads a matrix as the paper draws it: rows are outputs, columns inputs (`nn.Linear.weight`,
an attention map), normalised to [0, 1] by `normalise`. With n the normalised L × L matrix and the regions of
`TokenRegions` (g × g image patches, row-major):

- **diagonal ratio**: mean(n[i, i]) / mean(n[i, j], i ≠ j). About 1 for i.i.d. noise; above 1 when each token keeps
  more of itself than it takes from the others.
- **locality**: over the image × image block, the mean of n between patches at L1 grid distance 1 (|Δrow| + |Δcol|
  = 1) over the mean between patches at distance ≥ g. About 1 for noise; above 1 when neighbouring patches interact
  more than distant ones (the paper's "diagonal lines ... capture the spatial property of images"), below 1 when
  neighbours get lower (more negative) weights than distant patches: spatial too, with the opposite sign.
- **periodicity**: ρ(g) − mean(ρ(1), …, ρ(g − 1)), where ρ(k) is the Pearson correlation of n with itself shifted by
  k tokens along an image axis: the pairs (n[p, j], n[p + k, j]) for image rows p and p + k and every column j,
  pooled with the pairs (n[i, q], n[i, q + k]) for image columns q and q + k and every row i. A shift by g moves
  every patch one patch row down, so ρ(g) is how much the matrix repeats once per patch row (the paper's "repeated
  patterns 16 times"); subtracting the shorter shifts leaves out what is merely smooth. About 0 for noise and for
  smooth trends; near 1 for a pattern that repeats every patch row and is irregular within a row. A local pattern
  scores above 0 too, since a patch's neighbour in the row below is g tokens away.

A ratio whose denominator is 0 (a constant matrix) and a measure that the grid cannot define (locality and
periodicity need g ≥ 2) are `None`. `noise_band` gives the range each measure takes on structureless matrices of a
model's size, to read a trained model's against. `mean_abs` keeps the scale that normalisation removes (the paper's
"higher weights in the middle layers"), and `balance_statistics` says how evenly an MoE-MLP router uses its experts.
"""

import functools
import math
from collections.abc import Callable

import torch

from .regions import TokenRegions


# The i.i.d. Gaussian matrices `noise_band` draws.
NOISE_DRAWS = 200


def normalise(matrix: torch.Tensor) -> torch.Tensor:
    """Min-max normalisation to [0, 1], as the reference figure script does: (w − min) / (max − min).

    Args:
        matrix (`torch.Tensor`): (M, M) weights or attention probabilities.

    Returns:
        `torch.Tensor`: (M, M) float64 values in [0, 1]; all zeros for a constant matrix.
    """
    matrix = matrix.detach().double()
    low, high = matrix.min(), matrix.max()
    if high == low:
        return torch.zeros_like(matrix)
    return (matrix - low) / (high - low)


def _ratio(numerator: torch.Tensor, denominator: torch.Tensor) -> float | None:
    return None if denominator == 0 else float(numerator / denominator)


def diagonal_ratio(normalised: torch.Tensor) -> float | None:
    """The mean normalised value on the diagonal over the mean off it.

    Args:
        normalised (`torch.Tensor`): (M, M) values in [0, 1] (`normalise`).
    """
    on = torch.eye(normalised.shape[0], dtype=torch.bool)
    return _ratio(normalised[on].mean(), normalised[~on].mean())


@functools.cache
def grid_distance(regions: TokenRegions) -> torch.Tensor:
    """The L1 distance on the patch grid between every two image tokens (computed once per layout).

    Args:
        regions (`TokenRegions`): The token layout.

    Returns:
        `torch.Tensor`: (N, N) integer distances |Δrow| + |Δcol|.
    """
    positions = torch.tensor([regions.patch_position(patch) for patch in range(regions.num_patches)])  # (N, 2)
    return (positions[:, None, :] - positions[None, :, :]).abs().sum(-1)  # (N, N)


def locality(normalised: torch.Tensor, regions: TokenRegions) -> float | None:
    """The mean normalised value between image patches at grid distance 1 over the mean at distance ≥ g.

    Args:
        normalised (`torch.Tensor`): (L, L) values in [0, 1] (`normalise`).
        regions (`TokenRegions`): The token layout; `None` for a grid smaller than 2 × 2.
    """
    if regions.grid_size < 2:
        return None
    image = slice(regions.image.start, regions.image.stop)
    block = normalised[image, image]  # (N, N): image outputs × image inputs
    distance = grid_distance(regions)
    return _ratio(block[distance == 1].mean(), block[distance >= regions.grid_size].mean())


def lag_correlations(normalised: torch.Tensor, regions: TokenRegions, max_lag: int) -> list[float | None]:
    """ρ(1), …, ρ(max_lag): the Pearson correlation of the matrix with itself shifted by k tokens along the image
    axes, over the pairs (n[p, j], n[p + k, j]) of image rows and (n[i, q], n[i, q + k]) of image columns, pooled.

    Both sets of pairs are pairs of rows of an (N, L) matrix k apart (the image rows of n, and its image columns
    transposed), so every lag comes from the sums of those rows and their Gram matrix.

    Args:
        normalised (`torch.Tensor`): (L, L) values in [0, 1] (`normalise`).
        regions (`TokenRegions`): The token layout.
        max_lag (`int`): The longest shift, below N.

    Returns:
        `list`: ρ(k) for k = 1 … max_lag; `None` where either side of the pairs is constant.
    """
    image = slice(regions.image.start, regions.image.stop)
    num_patches, seq_len = regions.num_patches, regions.seq_len
    totals = torch.zeros(max_lag, 5, dtype=torch.float64)  # per lag: Σx, Σy, Σx², Σy², Σxy
    for part in (normalised[image, :], normalised[:, image].T):  # 2 × (N, L)
        sums, squares, gram = part.sum(1), part.square().sum(1), part @ part.T  # (N,), (N,), (N, N)
        for lag in range(1, max_lag + 1):
            first, second = slice(0, num_patches - lag), slice(lag, num_patches)
            totals[lag - 1] += torch.stack(
                [sums[first].sum(), sums[second].sum(), squares[first].sum(), squares[second].sum(),
                 torch.diagonal(gram, lag).sum()]
            )  # fmt: skip
    correlations = []
    for lag, (sx, sy, sxx, syy, sxy) in enumerate(totals, start=1):
        count = 2 * (num_patches - lag) * seq_len
        covariance = sxy - sx * sy / count
        variances = (sxx - sx * sx / count) * (syy - sy * sy / count)
        correlations.append(None if variances <= 0 else float(covariance / variances.sqrt()))
    return correlations


def periodicity(normalised: torch.Tensor, regions: TokenRegions) -> float | None:
    """ρ(g) − mean(ρ(1), …, ρ(g − 1)): how much more the matrix repeats one patch row away than at shorter shifts.

    Args:
        normalised (`torch.Tensor`): (L, L) values in [0, 1] (`normalise`).
        regions (`TokenRegions`): The token layout; `None` for a grid smaller than 2 × 2 or a constant matrix.
    """
    g = regions.grid_size
    if g < 2:
        return None
    *shorter, row_lag = lag_correlations(normalised, regions, g)
    if row_lag is None or None in shorter:
        return None
    return row_lag - sum(shorter) / len(shorter)


def token_mixing_measures(matrix: torch.Tensor, regions: TokenRegions) -> dict[str, float | None]:
    """The measures of an L × L token-mixing matrix (a left hemisphere, an expert, an attention map).

    Args:
        matrix (`torch.Tensor`): (L, L) raw values, rows = outputs, columns = inputs.
        regions (`TokenRegions`): The token layout of its model.

    Returns:
        `dict`: `diagonal`, `locality` and `periodicity` of the normalised matrix.
    """
    normalised = normalise(matrix)
    return {
        "diagonal": diagonal_ratio(normalised),
        "locality": locality(normalised, regions),
        "periodicity": periodicity(normalised, regions),
    }


def channel_mixing_measures(matrix: torch.Tensor) -> dict[str, float | None]:
    """The measure of a D × D channel-mixing matrix (a right hemisphere): channels have no grid, so only the diagonal.

    Args:
        matrix (`torch.Tensor`): (D, D) raw weights, rows = outputs, columns = inputs.

    Returns:
        `dict`: `diagonal` of the normalised matrix.
    """
    return {"diagonal": diagonal_ratio(normalise(matrix))}


def noise_band(measures: Callable[[torch.Tensor], dict], size: int, draws: int = NOISE_DRAWS) -> dict[str, list]:
    """Where measures fall on matrices without any structure: the 2.5th and 97.5th percentiles over `draws` i.i.d.
    Gaussian size × size matrices (seeded, so the same for every run). A trained matrix's measure outside its band is
    structure, not chance; with few tokens the band is wide.

    Args:
        measures (`Callable[[torch.Tensor], dict]`): The measures of one matrix, by name (`token_mixing_measures`
            with the model's regions bound, or the diagonal ratio of a right hemisphere).
        size (`int`): The matrices' side: L for token mixing, D for channel mixing.
        draws (`int`, *optional*, defaults to `NOISE_DRAWS`): How many matrices.

    Returns:
        `dict`: measure name -> [low, high]; `[None, None]` for a measure the layout cannot define.
    """
    generator = torch.Generator().manual_seed(0)
    values = [measures(torch.randn(size, size, generator=generator)) for _ in range(draws)]
    bands = {}
    for name in values[0]:
        drawn = [value[name] for value in values]
        if None in drawn:
            bands[name] = [None, None]
        else:
            bands[name] = torch.quantile(
                torch.tensor(drawn, dtype=torch.float64), torch.tensor([0.025, 0.975]).double()
            ).tolist()
    return bands


def mean_abs(matrix: torch.Tensor) -> float:
    """The mean |w| of raw weights: the scale that normalisation hides, to compare layers ("higher weights in the
    middle layers").

    Args:
        matrix (`torch.Tensor`): (..., M, M) raw weights.
    """
    return float(matrix.detach().double().abs().mean())


def balance_statistics(router_probs: torch.Tensor) -> dict[str, float | list[float]]:
    """How evenly one router (one block and head of an MoE-MLP) uses its experts.

    Args:
        router_probs (`torch.Tensor`): (S, E) gate probabilities of S forward passes (samples × timesteps).

    Returns:
        `dict`: `usage` (E mean gate probabilities, summing to 1), `top1` (the share of passes whose largest gate is
        each expert), `cv` (σ/μ of `usage`: 0 when balanced, √(E − 1) when one expert takes everything; the first
        term of the MoE-MLP paper's balance loss is its square) and `entropy` (the entropy of `usage` over log E: 1
        when balanced, 0 when one expert takes everything; 1 for E = 1).
    """
    probs = router_probs.detach().double()
    num_experts = probs.shape[-1]
    usage = probs.mean(0)  # (E,)
    top1 = torch.bincount(probs.argmax(-1), minlength=num_experts).double() / probs.shape[0]  # (E,)
    entropy = -(usage * usage.clamp_min(1e-300).log()).sum()
    return {
        "usage": usage.tolist(),
        "top1": top1.tolist(),
        "cv": float(usage.std(correction=0) / usage.mean()),
        "entropy": 1.0 if num_experts == 1 else float(entropy / math.log(num_experts)),
    }
