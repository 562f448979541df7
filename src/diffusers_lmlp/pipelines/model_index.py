"""`model_index.json` of a folder pushed with `--with-code`, read as naming the package's classes.

Such a folder names each code file's class as `[file stem, Class]` (`"_class_name": ["pipeline_lmlp",
"LMLPPipeline"]`); diffusers would run the file. Where the package exports `Class`, the entry is this package's class
instead: `["diffusers_lmlp", Class]`, and `_class_name` the bare class name. `LMLPPipeline.from_pretrained` loads a
with-code folder this way, and `hub.remote_code` (the push) uses the same mapping.

This module is part of the remote code too (the pipeline's file inlines it), where it runs as a module of
`diffusers_modules` and the package may be missing: so the package's name is written out, never taken from
`__name__`, and the package is looked up among the loaded modules, never imported.
"""

import sys
from typing import Any


PACKAGE = "diffusers_lmlp"
# Libraries diffusers loads components from itself; entries naming them are never code of ours.
LOADABLE_LIBRARIES = ("diffusers", "transformers")


def package_model_index(model_index: dict[str, Any]) -> dict[str, Any]:
    """`model_index.json` in the package's own form: entries of a with-code folder (`[file stem, Class]`) naming a
    class the package exports become `["diffusers_lmlp", Class]`, and `_class_name` the bare class name.

    A class counts as exported when the loaded package has it as an attribute (`getattr`, so that names the package
    exports lazily count too); without the package loaded, no entry changes.

    Args:
        model_index (`dict[str, Any]`): The folder's `model_index.json`.

    Returns:
        `dict[str, Any]`: A new dict; equal to `model_index` for a folder without code.
    """
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
