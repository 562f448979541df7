"""scripts/lowest_requirements.py pins exactly setup.py's floors, which CI installs to test the lowest versions."""

import subprocess

import pytest
from benchmark_scripts import load_benchmark
from documents import ROOT


lowest = load_benchmark("lowest_requirements", "scripts")
SETUP = lowest.requirement_literals((ROOT / "setup.py").read_text(encoding="utf-8"))


def test_every_floor_of_setup_py_is_pinned_except_torch_and_each_requirement_listed_once():
    install_requires, extras = SETUP
    pins = lowest.lowest_constraints(install_requires + extras["train"])
    floors = [req for req in install_requires + extras["train"] if ">=" in req and not req.startswith("torch")]
    assert pins == [req.replace(">=", "==") for req in floors]
    assert "huggingface_hub==1.23" in pins and "transformers==5.0" in pins and "peft==0.20" in pins
    # Unfloored requirements are left alone, repeated ones listed once.
    assert lowest.lowest_constraints(["tqdm", "torch>=2.5", "peft>=0.17", "peft>=0.20", "ruff"]) == ["peft==0.17"]
    listed = lowest.dependencies(["torch>=2.5", "peft>=0.20", "tqdm", "peft>=0.20", "torchvision"])
    assert listed == ["peft>=0.20", "tqdm", "torchvision"]


def test_requirements_are_setup_pys_own_without_torch_and_an_unknown_extra_is_refused(capsys):
    # What the lowest-versions venv installs before the package: setup.py's requirements, as written, torch apart.
    with pytest.raises(SystemExit, match=r"unknown extra\(s\) \['gpu'\]; setup.py defines"):
        lowest.main(["gpu"])
    lowest.main(["--requirements", "train"])
    install_requires, extras = SETUP
    printed = capsys.readouterr().out.split()
    assert printed == [req for req in install_requires + extras["train"] if not req.startswith("torch")]
    assert "tqdm" in printed and "peft>=0.20" in printed  # unfloored ones too; the constraints pin the floors


def test_the_script_refuses_an_unknown_step():
    script = ROOT / "scripts" / "test_lowest_versions.sh"
    result = subprocess.run(["bash", script, "tests"], capture_output=True, text=True)
    assert result.returncode == 2 and result.stdout == ""  # refused before its venv is touched
    assert "usage: bash scripts/test_lowest_versions.sh [deps|test]; got 'tests'" in result.stderr
