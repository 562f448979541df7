"""`model_index.json` of a folder pushed with `--with-code`, read as naming the package's classes.

Such a folder names each class as `[file stem, Class]`, which diffusers would run. This module is inlined into the
remote code too, where the package may be missing: so the package's name is written out, never taken from
`__name__`, and the package is looked up among the loaded modules, never imported.
"""

import sys
from typing import Any


PACKAGE = "diffusers_lmlp"
# Libraries diffusers loads components from itself; entries naming them are never code of ours.
LOADABLE_LIBRARIES = ("diffusers", "transformers")


def package_model_index(model_index: dict[str, Any]) -> dict[str, Any]:
    """`model_index` in the package's form: with-code entries naming a class the loaded package has (lazily exported
    ones too) become `["diffusers_lmlp", Class]`, and `_class_name` the bare name; a new dict, unchanged without the
    package loaded or for a folder without code."""
    package = sys.modules.get(PACKAGE)

    def ours(entry: Any) -> bool:
        return (
            isinstance(entry, list)
            and len(entry) == 2
            and entry[0] not in (PACKAGE, *LOADABLE_LIBRARIES)
            and isinstance(entry[1], str)
            and isinstance(getattr(package, entry[1], None), type)
        )

    converted = {}
    for key, entry in model_index.items():
        if not ours(entry):
            converted[key] = entry
        else:
            converted[key] = entry[1] if key == "_class_name" else [PACKAGE, entry[1]]
    return converted
