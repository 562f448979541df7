"""The numbers behind the L-MLP paper's Fig. 6 claims, read off a min-max normalised matrix (rows = outputs), each
about 1 (periodicity 0) for noise (`noise_band`) and `None` where undefined; and the MoE-MLP routers' load balance."""

import functools
import math
from collections.abc import Callable

import torch

from .regions import TokenRegions


NOISE_DRAWS = 200  # the i.i.d. Gaussian matrices `noise_band` draws


def normalise(matrix: torch.Tensor) -> torch.Tensor:
    """(w − min) / (max − min) in float64, as the reference figure script does; all zeros for a constant matrix."""
    matrix = matrix.detach().double()
    low, high = matrix.min(), matrix.max()
    if high == low:
        return torch.zeros_like(matrix)
    return (matrix - low) / (high - low)


def _ratio(numerator: torch.Tensor, denominator: torch.Tensor) -> float | None:
    return None if denominator == 0 else float(numerator / denominator)


def diagonal_ratio(normalised: torch.Tensor) -> float | None:
    """The mean on the diagonal over the mean off it: above 1 when tokens keep more of themselves."""
    on = torch.eye(normalised.shape[0], dtype=torch.bool)
    return _ratio(normalised[on].mean(), normalised[~on].mean())


@functools.cache
def grid_distance(regions: TokenRegions) -> torch.Tensor:
    """The (N, N) L1 distances |Δrow| + |Δcol| on the patch grid between image tokens (cached per layout)."""
    positions = torch.tensor([divmod(patch, regions.grid_size) for patch in range(regions.num_patches)])  # (N, 2)
    return (positions[:, None, :] - positions[None, :, :]).abs().sum(-1)  # (N, N)


def locality(normalised: torch.Tensor, regions: TokenRegions) -> float | None:
    """The mean between image patches at grid distance 1 over the mean at distance ≥ g: above 1 when neighbours
    interact more (the paper's "spatial property")."""
    if regions.grid_size < 2:
        return None
    image = slice(regions.image.start, regions.image.stop)
    block = normalised[image, image]  # (N, N): image outputs × image inputs
    distance = grid_distance(regions)
    return _ratio(block[distance == 1].mean(), block[distance >= regions.grid_size].mean())


def periodicity(normalised: torch.Tensor, regions: TokenRegions) -> float | None:
    """ρ(g) − mean(ρ(1), …, ρ(g − 1)), ρ(k) the Pearson correlation of the matrix with itself shifted by k along both
    image axes (pooled over both (N, L) sides): how much more it repeats one patch row away (the paper's "repeated
    patterns") than at shorter shifts (mere smoothness); None where undefined."""
    g = regions.grid_size
    if g < 2:
        return None
    image = slice(regions.image.start, regions.image.stop)
    sides = (normalised[image, :], normalised[:, image].T)  # 2 × (N, L): image rows, then image columns
    correlations = []
    for lag in range(1, g + 1):
        shifted = [torch.cat([side[part].flatten() for side in sides]) for part in (slice(-lag), slice(lag, None))]
        correlations.append(float(torch.corrcoef(torch.stack(shifted))[0, 1]))
    *shorter, row_lag = correlations
    return None if not all(math.isfinite(c) for c in correlations) else row_lag - sum(shorter) / len(shorter)


def token_mixing_measures(matrix: torch.Tensor, regions: TokenRegions) -> dict[str, float | None]:
    """`diagonal`, `locality` and `periodicity` of a raw L × L token-mixing matrix, normalised first."""
    m = normalise(matrix)
    return {"diagonal": diagonal_ratio(m), "locality": locality(m, regions), "periodicity": periodicity(m, regions)}


def channel_mixing_measures(matrix: torch.Tensor) -> dict[str, float | None]:
    """The `diagonal` of a D × D channel-mixing matrix (a right hemisphere): channels have no grid."""
    return {"diagonal": diagonal_ratio(normalise(matrix))}


def noise_band(measures: Callable[[torch.Tensor], dict], size: int, draws: int = NOISE_DRAWS) -> dict[str, list]:
    """Measure name → [2.5th, 97.5th percentile] of `measures` over `draws` seeded i.i.d. Gaussian size × size
    matrices: a trained matrix's measure outside its band is structure, not chance."""
    generator = torch.Generator().manual_seed(0)
    values = [measures(torch.randn(size, size, generator=generator)) for _ in range(draws)]
    quantiles = torch.tensor([0.025, 0.975]).double()  # float32 values, as the documented bands were computed
    drawn = {name: [value[name] for value in values] for name in values[0]}
    return {
        name: [None, None] if None in d else torch.quantile(torch.tensor(d, dtype=torch.float64), quantiles).tolist()
        for name, d in drawn.items()
    }


def mean_abs(matrix: torch.Tensor) -> float:
    """The mean |w| of raw weights: the scale normalisation hides."""
    return float(matrix.detach().double().abs().mean())


def balance_statistics(router_probs: torch.Tensor) -> dict[str, float | list[float]]:
    """How evenly one router uses its experts over (S, E) gate probabilities: mean `usage`, `top1` shares, `cv`
    (σ/μ of usage, 0 when balanced) and `entropy` of usage over log E (1 when balanced)."""
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
