"""The former homes of the trainer's names. The trainer lived in `diffusers_lmlp.train`, then in three large modules
of this package (`trainer`, `arguments`, `features`), and now in rooms of one concept each. A module that names left
keeps answering for them, with a `FutureWarning` that says where each one lives now, until `REMOVED_IN`.

This module imports nothing heavy: `diffusers_lmlp.train --help` reads it.
"""

import importlib
import inspect
from collections.abc import Callable

from ..deprecation import deprecate


# The version of diffusers-lmlp that removes the former paths.
REMOVED_IN = "0.2.0"


def moved_names(old: str, homes: tuple[str, ...]) -> Callable[[str], object]:
    """The module-level `__getattr__` (PEP 562) of module `old`, whose names now live in the modules `homes`.

    A name is looked up in each home in turn, among the names that home holds (a home's own former names are not
    followed); the warning names the module that defines a function or class, else the home that holds the value.

    Args:
        old (`str`): The former module, e.g. `"diffusers_lmlp.training.trainer"`.
        homes (`tuple[str, ...]`): The modules its names moved to, e.g. `("diffusers_lmlp.training.batches",)`.
    """

    def __getattr__(name: str) -> object:
        if not name.startswith("_"):  # Python's own lookups (`__path__`, ...) import nothing
            for home in homes:
                names = vars(importlib.import_module(home))
                if name in names:
                    value = names[name]
                    where = value.__module__ if inspect.isclass(value) or inspect.isfunction(value) else home
                    deprecate(f"`{old}.{name}`", REMOVED_IN, f"Import it from `{where}`.", stacklevel=3)
                    return value
        raise AttributeError(f"module {old!r} has no attribute {name!r}")

    return __getattr__
