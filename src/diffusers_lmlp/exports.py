"""The package's public names: exported lazily, and recorded under the package's own name.

`lazy_exports` imports a name's module when it is first read (PEP 562), so `import diffusers_lmlp` and every `--help`
skip diffusers, transformers and accelerate. `public` pins a class's `__module__` to `diffusers_lmlp`, so the
["diffusers_lmlp", "<Class>"] entry that `save_pretrained` writes to `model_index.json` survives any module move.
"""

import importlib
import pkgutil
import sys
from collections.abc import Callable, Mapping
from typing import TypeVar


PACKAGE = "diffusers_lmlp"

T = TypeVar("T", bound=type)


def public(cls: T) -> T:
    """Record `cls` as `diffusers_lmlp.<name>` (class decorator); the package exports it under that name."""
    cls.__module__ = PACKAGE
    return cls


def lazy_exports(package: str, exports: Mapping[str, str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """A package's module-level `__getattr__` and `__dir__` that import each name of `exports` (name -> module,
    relative or absolute) on first use. A name that is also a submodule's cannot be lazy: import it eagerly."""

    submodules = {module.name for module in pkgutil.iter_modules(sys.modules[package].__path__)}
    if submodules & set(exports):
        raise RuntimeError(
            f"{package}: import {sorted(submodules & set(exports))} eagerly; each names a submodule too"
        )

    def __getattr__(name: str) -> object:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name], package), name)
        setattr(sys.modules[package], name, value)  # later reads skip this function
        return value

    def __dir__() -> list[str]:
        return sorted({*exports, *vars(importlib.import_module(package))})

    return __getattr__, __dir__
