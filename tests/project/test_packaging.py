"""The package's licence, the documented outputs kept out of git, and a wheel install's commands and demo Space."""

import os
import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from documents import ROOT


SPACE_FILES, DEMO = ["README.md", "app.py", "requirements.txt"], ROOT / "spaces" / "lmlp-demo"


def test_the_apache_license_that_setup_py_and_the_cards_name_is_there():
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
    assert 'license="Apache-2.0"' in (ROOT / "setup.py").read_text(encoding="utf-8")


# What the documented commands write in the working directory (examples, the main command, hub, benchmarks, ...).
OUTPUTS = ["lmlp-shapes/model_index.json", "lmlp-shapes-upload/README.md", "lmlp-demo-upload/app.py",
           "tiny-lmlp/model_index.json", "ul-mlp-f2-deep/config.json", "ablation-shapes/results.md",
           "scorer-agreement/results.json", "shapes-lora/pytorch_lora_weights.safetensors", "red_circle.png",
           "lmlp-shapes-lora/pytorch_lora_weights.safetensors", ".venv-lowest/lowest.txt"]  # fmt: skip


def test_documented_outputs_are_ignored_by_git():
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    result = subprocess.run(["git", "check-ignore", "-nv", *OUTPUTS], cwd=ROOT, capture_output=True, text=True)
    shown = [line.split("\t")[1] for line in result.stdout.splitlines() if line.startswith("::")]
    assert shown == [], "these would show up in `git status`: add them to .gitignore"


# Run by the installed interpreter: where the package is, and every console script resolves to a function.
ENTRY_POINTS = """
import importlib.metadata, diffusers_lmlp
print(diffusers_lmlp.__file__)
for entry in importlib.metadata.entry_points(group="console_scripts"):
    if entry.value.startswith("diffusers_lmlp"):
        print(entry.name, callable(entry.load()))
"""


@pytest.mark.slow
def test_the_wheel_installs_the_package_and_its_commands(tmp_path):  # and the demo Space
    # A venv with a wheel of the files git would commit, and this environment's dependencies through a .pth file.
    source, listing = tmp_path / "source", ["git", "ls-files", "--cached", "--others", "--exclude-standard"]
    tracked = subprocess.run(listing, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for name in tracked.splitlines():
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", tmp_path, source], check=True)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    purelib = sysconfig.get_paths(vars={"base": str(venv), "platbase": str(venv)})["purelib"]  # the same Python's
    Path(purelib, "test-dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    (wheel,) = tmp_path.glob("diffusers_lmlp-*.whl")
    subprocess.run([*pip, "--python", venv / "bin" / "python", "install", "--no-deps", wheel], check=True)

    def run_installed(program: str, *args: str, code: int = 0, **env: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": "", **env}  # offline, outside the checkout
        command = [venv / "bin" / program, *args]
        run = subprocess.run(command, cwd=venv, env=env, capture_output=True, text=True, timeout=300)
        assert run.returncode == code, run.stderr[-2000:]
        return run

    where, *commands = run_installed("python", "-c", ENTRY_POINTS).stdout.splitlines()
    assert Path(where).is_relative_to(venv)  # the installed copy, not this checkout's src/
    assert sorted(commands) == [f"diffusers-lmlp-{name} True" for name in ("analysis", "evaluate", "hub", "train")]
    assert all((venv / "bin" / f"diffusers-lmlp-{name}").is_file() for name in ("analysis", "evaluate"))
    assert "--lora_rank" in run_installed("diffusers-lmlp-train", "--help").stdout
    # The hub's usage names the console script, not the module form.
    assert run_installed("diffusers-lmlp-hub", "--help").stdout.startswith("usage: diffusers-lmlp-hub [-h]")
    assert "--preset" in run_installed("python", "-m", "diffusers_lmlp.train", "--help").stdout
    # The demo Space where setup.py puts spaces/lmlp-demo/, byte for byte; its app stops on a bad setting at once.
    (space,) = venv.glob("lib/python*/site-packages/diffusers_lmlp/space/lmlp_demo")
    assert sorted(p.name for p in space.iterdir() if p.name != "__pycache__") == SPACE_FILES
    assert all((space / name).read_bytes() == (DEMO / name).read_bytes() for name in SPACE_FILES)
    app = run_installed("python", str(space / "app.py"), code=1, LMLP_QUEUE_SIZE="0")
    assert "error: LMLP_QUEUE_SIZE must be a whole number of at least 1" in app.stderr
    # Staged for a Space: the demo's three files, and the installed package's source, none of its data.
    out = tmp_path / "space"
    push = ["push-space", "owner/space", "--model", "owner/model", "--dry-run", "--output-dir", str(out)]
    staged = run_installed("diffusers-lmlp-hub", *push).stdout
    assert f"The folder that would be uploaded to the Space owner/space: {out}\n" in staged
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert [name for name in files if not name.startswith("diffusers_lmlp/")] == SPACE_FILES
    package = space.parents[1]
    source = sorted(f"diffusers_lmlp/{p.relative_to(package).as_posix()}" for p in package.rglob("*.py"))
    packaged = [name for name in files if name.startswith("diffusers_lmlp/")]
    assert packaged == [name for name in source if "lmlp_demo" not in name]
    for name in ("app.py", "requirements.txt"):
        assert (out / name).read_bytes() == (DEMO / name).read_bytes()
    assert "models:\n- owner/model\n" in (out / "README.md").read_text(encoding="utf-8")
