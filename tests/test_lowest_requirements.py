"""scripts/lowest_requirements.py pins exactly setup.py's floors, which CI installs to test the lowest versions."""

import importlib.util
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("lowest_requirements", ROOT / "scripts" / "lowest_requirements.py")
lowest = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lowest)


def test_every_floor_of_setup_py_is_pinned_except_torch():
    install_requires, extras = lowest.requirement_literals((ROOT / "setup.py").read_text(encoding="utf-8"))
    pins = lowest.lowest_constraints(install_requires + extras["train"])
    floors = [req for req in install_requires + extras["train"] if ">=" in req and not req.startswith("torch")]
    assert pins == [req.replace(">=", "==") for req in floors]
    assert "huggingface_hub==1.23" in pins and "transformers==5.0" in pins and "peft==0.20" in pins


def test_unfloored_and_repeated_requirements_are_left_alone():
    assert lowest.lowest_constraints(["tqdm", "torch>=2.5", "peft>=0.17", "peft>=0.20", "ruff"]) == ["peft==0.17"]


def test_unknown_extra_is_refused(capsys):
    with pytest.raises(SystemExit, match=r"unknown extra\(s\) \['gpu'\]; setup.py defines"):
        lowest.main(["gpu"])
