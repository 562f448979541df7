"""`model_index.json` of a `--with-code` folder, read as naming the package's classes; inlined into the remote code
too, where the package may be missing, so it is looked up among the loaded modules, never imported."""

import sys
from typing import Any


PACKAGE = "diffusers_lmlp"
LOADABLE_LIBRARIES = ("diffusers", "transformers")  # entries naming them are never code of ours


def package_model_index(model_index: dict[str, Any]) -> dict[str, Any]:
    """A new `model_index` whose with-code entries (`[file stem, Class]`) naming a class of the loaded package are
    `["diffusers_lmlp", Class]`, and `_class_name` the bare name; unchanged without the package or code."""
    package = sys.modules.get(PACKAGE)

    def ours(entry: Any) -> bool:
        return (
            isinstance(entry, list)
            and len(entry) == 2
            and entry[0] not in (PACKAGE, *LOADABLE_LIBRARIES)
            and isinstance(entry[1], str)
            and isinstance(getattr(package, entry[1], None), type)
        )

    return {
        key: (entry[1] if key == "_class_name" else [PACKAGE, entry[1]]) if ours(entry) else entry
        for key, entry in model_index.items()
    }
