"""The package's public names: exported lazily, and recorded under the package's own name.

`import diffusers_lmlp` (and every command's `--help`) must not pay for diffusers, transformers and accelerate: a
package `__init__` lists its public names with the module that defines each, and `lazy_exports` imports that module
the first time the name is read (PEP 562), as diffusers' and transformers' own `__init__`s do.

`public` pins a class's `__module__` to `diffusers_lmlp`: `save_pretrained` writes a component's module into
`model_index.json`, and diffusers resolves ["diffusers_lmlp", "<Class>"] as an attribute of this package, so the
entry stays valid however the modules are arranged.
"""

import importlib
import pkgutil
import sys
from collections.abc import Callable, Mapping
from typing import TypeVar


PACKAGE = "diffusers_lmlp"

T = TypeVar("T", bound=type)


def public(cls: T) -> T:
    """Record `cls` as `diffusers_lmlp.<name>` (class decorator); the package exports it under that name.

    Args:
        cls (`type`): A public class of the package.
    """
    cls.__module__ = PACKAGE
    return cls


def lazy_exports(package: str, exports: Mapping[str, str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """A package's module-level `__getattr__` and `__dir__` that import each public name on first use.

    A public name that is also a submodule's name cannot be lazy (importing the submodule sets the package's
    attribute to the module): import it in the package's `__init__` instead.

    Args:
        package (`str`): The package's `__name__`.
        exports (`Mapping[str, str]`): Public name -> the module that defines it, relative to `package`
            (".pipelines") or absolute ("diffusers").
    """

    submodules = {module.name for module in pkgutil.iter_modules(sys.modules[package].__path__)}
    if submodules & set(exports):
        # Importing a submodule sets the package's attribute of its name to the module, over a lazy name.
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
