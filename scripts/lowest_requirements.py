"""Print pip constraints that pin every floor in setup.py (`name>=X` -> `name==X`), for the lowest-versions test.

    python scripts/lowest_requirements.py [EXTRA ...] > lowest.txt
    pip install -c lowest.txt -e ".[EXTRA]"

setup.py is read, not run: its `install_requires` list and `extras` dict literals are parsed. torch is left out
(install your build first, as the README says), and so is any requirement without a floor.
"""

import ast
import re
import sys
from pathlib import Path


SETUP = Path(__file__).resolve().parents[1] / "setup.py"
FLOOR = re.compile(r"^([A-Za-z0-9_.\-]+)>=([0-9][A-Za-z0-9.]*)$")


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


def main(extra_names: list[str]) -> None:
    install_requires, extras = requirement_literals(SETUP.read_text(encoding="utf-8"))
    unknown = sorted(set(extra_names) - set(extras))
    if unknown:
        sys.exit(f"unknown extra(s) {unknown}; setup.py defines {sorted(extras)}")
    requirements = install_requires + [req for name in extra_names for req in extras[name]]
    print("\n".join(lowest_constraints(requirements)))


if __name__ == "__main__":
    main(sys.argv[1:])
