"""What the package promises about itself: its licence, that the documented commands' outputs stay out of git, and
that a wheel install (no checkout) has the commands and the demo Space."""

import os
import re
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[2]
SPACE_FILES = ["README.md", "app.py", "requirements.txt"]


def test_the_apache_license_that_setup_py_and_the_cards_name_is_there():
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
    assert re.search(r'license="Apache-2.0"', (ROOT / "setup.py").read_text(encoding="utf-8"))


@pytest.mark.parametrize(
    "output",
    [
        "lmlp-shapes/model_index.json",  # the main command
        "lmlp-shapes-upload/README.md",  # hub push --dry-run --output-dir lmlp-shapes-upload
        "lmlp-demo-upload/app.py",  # hub push-space --dry-run --output-dir lmlp-demo-upload
        "tiny-lmlp/model_index.json",  # README examples
        "ul-mlp-f2-deep/config.json",
        "ablation-shapes/results.md",  # benchmarks/ablation_shapes.py --output_dir ablation-shapes
        "scorer-agreement/results.json",  # benchmarks/scorer_agreement.py
        "shapes-lora/pytorch_lora_weights.safetensors",
        "lmlp-shapes-lora/pytorch_lora_weights.safetensors",  # the trainer's --preset shapes-lora
        "red_circle.png",
        ".venv-lowest/lowest.txt",  # scripts/test_lowest_versions.sh
    ],
)
def test_documented_outputs_are_ignored_by_git(output):
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    result = subprocess.run(["git", "check-ignore", "-q", output], cwd=ROOT)
    assert result.returncode == 0, f"{output} would show up in `git status`: add it to .gitignore"


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory) -> Path:
    """A venv with the package installed from a wheel of the files git would commit, and this environment's
    dependencies (not this checkout's src/) visible through a .pth file."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"
    listing = ["git", "ls-files", "--cached", "--others", "--exclude-standard"]
    tracked = subprocess.run(listing, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for name in tracked.splitlines():
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", root, source], check=True)
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    purelib = subprocess.run(
        [venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    Path(purelib, "test-dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    (wheel,) = root.glob("diffusers_lmlp-*.whl")
    subprocess.run([*pip, "--python", venv / "bin" / "python", "install", "--no-deps", wheel], check=True)
    return venv


def run_installed(venv: Path, program: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    """Run `venv/bin/<program> *args`, offline, without this checkout on the path; `env` adds variables."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": "", **env}
    command = [venv / "bin" / program, *args]
    return subprocess.run(command, cwd=venv, env=env, capture_output=True, text=True, timeout=300)


# Run by the installed interpreter: where the package is, and every console script resolves to a function.
ENTRY_POINTS = """
import importlib.metadata, diffusers_lmlp
print(diffusers_lmlp.__file__)
for entry in importlib.metadata.entry_points(group="console_scripts"):
    if entry.value.startswith("diffusers_lmlp"):
        print(entry.name, callable(entry.load()))
"""


@pytest.mark.slow
def test_the_wheel_installs_the_package_and_its_commands(wheel_venv):
    found = run_installed(wheel_venv, "python", "-c", ENTRY_POINTS)
    assert found.returncode == 0, found.stderr[-2000:]
    where, *commands = found.stdout.splitlines()
    assert Path(where).is_relative_to(wheel_venv)  # the installed copy, not this checkout's src/
    assert sorted(commands) == [f"diffusers-lmlp-{name} True" for name in ("analysis", "evaluate", "hub", "train")]
    assert all((wheel_venv / "bin" / f"diffusers-lmlp-{name}").is_file() for name in ("analysis", "evaluate"))
    trainer = run_installed(wheel_venv, "diffusers-lmlp-train", "--help")
    assert trainer.returncode == 0 and "--lora_rank" in trainer.stdout, trainer.stderr[-2000:]
    # The console script's usage names it, not the module form.
    hub = run_installed(wheel_venv, "diffusers-lmlp-hub", "--help")
    assert hub.returncode == 0 and hub.stdout.startswith("usage: diffusers-lmlp-hub [-h]"), hub.stderr[-2000:]
    # The module form, and the installed demo's app stopped by a bad setting before it loads anything.
    module = run_installed(wheel_venv, "python", "-m", "diffusers_lmlp.train", "--help")
    assert module.returncode == 0 and "--preset" in module.stdout, module.stderr[-2000:]
    app = run_installed(wheel_venv, "python", str(installed_space(wheel_venv) / "app.py"), LMLP_QUEUE_SIZE="0")
    assert app.returncode == 1 and "error: LMLP_QUEUE_SIZE must be a whole number of at least 1" in app.stderr


def installed_space(venv: Path) -> Path:
    """Where the wheel puts the demo Space (setup.py maps spaces/lmlp-demo/ there)."""
    (folder,) = venv.glob("lib/python*/site-packages/diffusers_lmlp/space/lmlp_demo")
    return folder


@pytest.mark.slow
def test_the_wheel_carries_the_space_folder_and_stages_it(wheel_venv, tmp_path):
    space = installed_space(wheel_venv)
    assert sorted(p.name for p in space.iterdir() if p.name != "__pycache__") == SPACE_FILES
    for name in SPACE_FILES:  # byte for byte
        assert (space / name).read_bytes() == (ROOT / "spaces" / "lmlp-demo" / name).read_bytes()

    out = tmp_path / "space"
    push = ["push-space", "owner/space", "--model", "owner/model", "--dry-run", "--output-dir", str(out)]
    staged = run_installed(wheel_venv, "diffusers-lmlp-hub", *push)
    assert staged.returncode == 0, staged.stderr[-2000:]
    assert f"The folder that would be uploaded to the Space owner/space: {out}\n" in staged.stdout
    # The demo's three files, and the installed package's source, none of its data.
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert [name for name in files if not name.startswith("diffusers_lmlp/")] == SPACE_FILES
    package = space.parents[1]
    source = sorted(f"diffusers_lmlp/{p.relative_to(package).as_posix()}" for p in package.rglob("*.py"))
    assert [name for name in files if name.startswith("diffusers_lmlp/")] == [
        n for n in source if "lmlp_demo" not in n
    ]
    for name in ("app.py", "requirements.txt"):
        assert (out / name).read_bytes() == (ROOT / "spaces" / "lmlp-demo" / name).read_bytes()
    assert "models:\n- owner/model\n" in (out / "README.md").read_text(encoding="utf-8")
