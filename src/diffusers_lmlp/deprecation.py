"""Deprecations: a public name that changes keeps working for a release, with a `FutureWarning`, as diffusers'
`deprecate` does for its own names. Past its removal version the old name fails, so that it cannot linger."""

import warnings


def deprecate(old: str, removed_in: str, instead: str, stacklevel: int = 3) -> None:
    """Warn that `old` is deprecated; raise once the package has reached `removed_in`.

    Args:
        old (`str`): What the user wrote, e.g. "`diffusers_lmlp.train.BatchReader`".
        removed_in (`str`): The version of diffusers-lmlp that removes it, e.g. "0.2.0".
        instead (`str`): What to use instead, as a sentence.
        stacklevel (`int`, *optional*, defaults to 3): The frame the warning points at (3: the caller's caller).

    Raises:
        `RuntimeError`: Once the package's version is `removed_in` or later (the deprecation must be removed).
    """
    from packaging.version import Version

    from . import __version__

    if Version(__version__) >= Version(removed_in):
        raise RuntimeError(f"{old} was to be removed in diffusers-lmlp {removed_in}; remove the deprecation.")
    warnings.warn(
        f"{old} is deprecated and will be removed in diffusers-lmlp {removed_in}. {instead}",
        FutureWarning,
        stacklevel=stacklevel,
    )
