"""What the package's commands share before any heavy import: how they name themselves in their usage lines."""

import sys
from pathlib import Path


def program_name(console_script: str, module: str, argv0: str | None = None) -> str:
    """How the user ran a command, for its usage line: the console script by its name, `python -m <module>` for the
    module form, else the script's file name (a checkout's `examples/train_text_to_image.py`).

    Args:
        console_script (`str`): The command's console script, as setup.py installs it ("diffusers-lmlp-hub").
        module (`str`): The module that `python -m` runs ("diffusers_lmlp.hub").
        argv0 (`str`, *optional*): The path the process was started with; `sys.argv[0]` by default.
    """
    path = Path(sys.argv[0] if argv0 is None else argv0)
    if path.name.removesuffix(".exe") == console_script:
        return console_script
    # `python -m` starts a package's `__main__.py`, or a module's own file (`.../diffusers_lmlp/train.py`).
    parts = module.split(".")
    started = path.parts
    package_main = started[-len(parts) - 1 :] == (*parts, "__main__.py")
    module_file = started[-len(parts) :] == (*parts[:-1], f"{parts[-1]}.py")
    if path.name in ("", "-c", "-m") or package_main or module_file:
        return f"python -m {module}"
    return path.name
