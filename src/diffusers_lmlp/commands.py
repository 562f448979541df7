"""What the package's commands share before any heavy import: how they name themselves in their usage lines."""

import sys
from pathlib import Path


def program_name(console_script: str, module: str, argv0: str | None = None) -> str:
    """How the user ran a command, for its usage line: the console script's name, `python -m <module>`, or else the
    script's file name; `argv0` defaults to `sys.argv[0]`."""
    path = Path(sys.argv[0] if argv0 is None else argv0)
    if path.name.removesuffix(".exe") == console_script:
        return console_script
    # `python -m` starts a package's `__main__.py` or the module's own file.
    parts = module.split(".")
    started = path.parts
    package_main = started[-len(parts) - 1 :] == (*parts, "__main__.py")
    module_file = started[-len(parts) :] == (*parts[:-1], f"{parts[-1]}.py")
    if path.name in ("", "-c", "-m") or package_main or module_file:
        return f"python -m {module}"
    return path.name
