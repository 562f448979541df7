"""Print pip constraints that pin every floor in setup.py (`name>=X` -> `name==X`), for the lowest-versions test.

    python scripts/lowest_requirements.py [EXTRA ...] > lowest.txt
    pip install -c lowest.txt -e ".[EXTRA]"

setup.py is read, not run: its `install_requires` list and `extras` dict literals are parsed. torch is left out
(install your build first, as the README says), and so is any requirement without a floor.

With `--requirements`, it prints instead every requirement of the package and the extras, as setup.py writes them
(torch again left out), so that the dependencies install before the package itself:

    pip install -c lowest.txt -r <(python scripts/lowest_requirements.py --requirements EXTRA ...)
"""

import ast
import re
import sys
from pathlib import Path


SETUP = Path(__file__).resolve().parents[1] / "setup.py"
FLOOR = re.compile(r"^([A-Za-z0-9_.\-]+)>=([0-9][A-Za-z0-9.]*)$")
NAME = re.compile(r"[A-Za-z0-9_.\-]+")


def requirement_literals(source: str) -> tuple[list[str], dict[str, list[str]]]:
    """`install_requires` and `extras` as written in setup.py.

    Args:
        source (`str`): The text of setup.py.
    """
    found = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in ("install_requires", "extras"):
                found[node.targets[0].id] = ast.literal_eval(node.value)
    return found["install_requires"], found["extras"]


def lowest_constraints(requirements: list[str]) -> list[str]:
    """`name==floor` for each `name>=floor`, torch excepted, in the order given, each name once.

    Args:
        requirements (`list[str]`): Requirement strings from setup.py.
    """
    pins = {}
    for requirement in requirements:
        match = FLOOR.match(requirement.replace(" ", ""))
        if match and match.group(1) != "torch":
            pins.setdefault(match.group(1), f"{match.group(1)}=={match.group(2)}")
    return list(pins.values())


def dependencies(requirements: list[str]) -> list[str]:
    """The requirements as written, torch excepted, each once in the order given.

    Args:
        requirements (`list[str]`): Requirement strings from setup.py.
    """
    return [req for req in dict.fromkeys(requirements) if NAME.match(req).group(0) != "torch"]


def main(argv: list[str]) -> None:
    as_requirements = "--requirements" in argv
    extra_names = [arg for arg in argv if arg != "--requirements"]
    install_requires, extras = requirement_literals(SETUP.read_text(encoding="utf-8"))
    unknown = sorted(set(extra_names) - set(extras))
    if unknown:
        sys.exit(f"unknown extra(s) {unknown}; setup.py defines {sorted(extras)}")
    requirements = install_requires + [req for name in extra_names for req in extras[name]]
    print("\n".join(dependencies(requirements) if as_requirements else lowest_constraints(requirements)))


if __name__ == "__main__":
    main(sys.argv[1:])
