"""Every example of the README and docs/ runs as written on a CPU, offline, Hub ids replaced by local stand-ins."""

import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch
from documents import PAGES, ROOT, blocks, text
from PIL import Image
from space_server import emoji_pipeline, load_app, one_cpu_thread, serve, shapes_lora, shapes_pipeline

from diffusers_lmlp.hub import stage_pipeline
from diffusers_lmlp.hub.__main__ import main as hub_main
from diffusers_lmlp.shapes.pretrained import PIPELINE_PATH
from diffusers_lmlp.worlds import WORLDS


PYTHON_BLOCKS = [code for page in PAGES for code in blocks(page, "python")]
BASH_BLOCKS = [code for page in PAGES for code in blocks(page, "bash")]
DEVELOPMENT = next(block for block in BASH_BLOCKS if "ruff check" in block)  # the README's "Development" commands


def stand_ins(space_url: str, lora: Path, with_code: Path) -> dict[str, str]:
    """What each placeholder becomes: the shipped shapes pipeline, a `hub push --with-code` folder, a LoRA, an app."""
    return {
        '"<user>/<lmlp-repo>"': repr(str(PIPELINE_PATH)),
        '"<user>/<lmlp-repo-with-code>"': repr(str(with_code)),
        '"<user>/<lmlp-lora>"': repr(str(lora)),
        '"http://127.0.0.1:7860/"': repr(space_url),
    }


@pytest.mark.slow
def test_every_python_example_runs_in_order_on_cpu(tmp_path, monkeypatch):
    assert len(PYTHON_BLOCKS) >= 9
    monkeypatch.chdir(tmp_path)
    namespace, lora = {}, shapes_lora(tmp_path / "lora")
    with_code = stage_pipeline(PIPELINE_PATH, "alice/lmlp-shapes", tmp_path / "with-code", with_code=True).folder
    served = {"emoji": emoji_pipeline(), "shapes": shapes_pipeline()}  # as `python app.py` serves them
    with one_cpu_thread(), serve(load_app().build_demo(served, queue_size=8)) as url:
        for index, block in enumerate(PYTHON_BLOCKS):
            for placeholder, local in stand_ins(url, lora, with_code).items():
                block = block.replace(placeholder, local)
            leftover = [line for line in block.splitlines() if "<user>" in line.split("#", 1)[0]]
            assert not leftover, f"give these a local stand-in in stand_ins: {leftover}"
            exec(compile(block, f"python block {index} of {' + '.join(PAGES)}", "exec"), namespace)

    image = Image.open("red_circle.png")
    assert image.size == (32, 32) and np.asarray(image, dtype=np.float64).std() > 5
    assert namespace["pipe"].device.type == "cpu"
    assert len(namespace["images"]) == 4 and all(Path(item["image"]).is_file() for item in namespace["images"])
    assert Image.open(namespace["images"][0]["image"]).size == (32, 32) and namespace["seed"] == 0
    # Quantizing: every Linear of the pipeline's transformer is torch's int8 one, and the float pipeline is untouched.
    int8, float_transformer = namespace["int8_pipe"].transformer, namespace["pipe"].transformer
    assert not any(type(module) is torch.nn.Linear for module in int8.modules())
    assert any(type(module) is torch.nn.Linear for module in float_transformer.modules())
    assert namespace["eps"].shape == (2, 4, 32, 32) and namespace["loss"].ndim == 0
    # LoRA: every Linear of every block carries an adapter (none skipped), and the adapter file is written.
    model = namespace["model"]
    adapted = [name for name, module in model.stack.named_modules() if hasattr(module, "lora_A")]
    linears = [name for name, module in model.stack.named_modules() if isinstance(module, torch.nn.Linear)]
    bare = [name for name in linears if "lora_" not in name and not name.endswith(".base_layer")]
    assert len(adapted) == 5 * 9 and bare == []  # 9 blocks × 5 Linear layers
    assert namespace["trainable"] == sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    written = ["tiny-lmlp/model_index.json", "ul-mlp-f2-deep/diffusion_pytorch_model.safetensors"]
    assert all(Path(path).is_file() for path in [*written, "shapes-lora/pytorch_lora_weights.safetensors"])
    # Loading a LoRA into the pipeline: it changes the images, and unloading it gives the base model's.
    adapted, base = (np.asarray(namespace[name], dtype=np.float64) for name in ("adapted", "base"))
    assert np.abs(adapted - base).max() > 0
    fresh = shapes_pipeline()(namespace["prompt"], generator=torch.Generator().manual_seed(0))
    assert np.abs(base - np.asarray(fresh.images[0], dtype=np.float64)).max() <= 1  # fused and unfused: rounding


@pytest.mark.slow
def test_hub_dry_run_commands_run_as_written(tmp_path, monkeypatch):
    """docs/hub.md's dry runs on the shipped pipelines; every push shown is one of them without `--dry-run ...`."""
    shutil.copytree(PIPELINE_PATH, tmp_path / "lmlp-shapes")
    shutil.copytree(WORLDS["emoji"].pipeline_path, tmp_path / "lmlp-emoji")
    lines = [line.split("#", 1)[0].strip() for block in BASH_BLOCKS for line in block.splitlines()]
    hub_lines = [line for line in lines if line.startswith("python -m diffusers_lmlp.hub")]
    commands = [line for line in hub_lines if "--dry-run" in line]
    pushes = {re.sub(r" --dry-run --output-dir \S+$", "", command) for command in commands}
    assert len(commands) == 4 and set(hub_lines) - set(commands) == pushes, hub_lines
    monkeypatch.chdir(tmp_path)
    for command in commands:  # in this process: `python -m diffusers_lmlp.hub` runs this main
        argv = shlex.split(command.replace("<user>", "alice"))
        assert argv[:3] == ["python", "-m", "diffusers_lmlp.hub"]
        hub_main(argv[3:])
    written = ["lmlp-shapes-upload/model_index.json", "lmlp-shapes-code-upload/pipeline_lmlp.py"]
    written += ["lmlp-demo-upload/app.py", "lmlp-emoji-code-upload/transformer/diffusion_pytorch_model.safetensors"]
    assert all((tmp_path / path).is_file() for path in written)


def test_development_command_lints_clean():
    for command in re.findall(r"ruff [^&\n]+", DEVELOPMENT):  # ruff finds nothing to fix
        argv = [sys.executable, "-m", *shlex.split(command)]
        result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
        assert result.returncode == 0, f"{command}\n{result.stdout}{result.stderr}"


@pytest.mark.slow
def test_development_single_process_command_runs_one_test_file_without_workers():
    """The README's "Development" line for a debugger: `-n 0` runs the selected tests in one process; they pass."""
    [command] = [line for line in DEVELOPMENT.splitlines() if line.startswith("python -m pytest -n 0")]
    argv = [sys.executable, *shlex.split(command)[1:], "-p", "no:cacheprovider"]
    result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:]
    assert re.search(r"\b\d+ passed\b", result.stdout) and "workers" not in result.stdout  # xdist says "N workers"


def test_the_suite_runs_in_one_worker_per_core_each_with_its_share_of_threads(request):
    # pyproject's addopts (the README's `python -m pytest -q`), and conftest's thread share, inherited by commands.
    addopts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["addopts"]
    assert "-n auto" in addopts and "--dist worksteal" in addopts
    share = request.config.thread_share
    if share is None:  # `-n 0`, or a count the user chose: torch's own
        pytest.skip("this run has no pytest-xdist workers, or OMP_NUM_THREADS sets the threads")
    assert share == max(1, len(os.sched_getaffinity(0)) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    assert torch.get_num_threads() == share
    started = [sys.executable, "-c", "import torch; print(torch.get_num_threads())"]
    assert subprocess.run(started, capture_output=True, text=True, check=True).stdout.strip() == str(share)


@pytest.mark.parametrize("marker", ["<!-- main-command -->", "<!-- test-command -->"])
def test_readme_commands_pin_torch_first(marker):
    block = text("README.md").split(marker, 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    assert block.index("pip install torch==2.13.0") < block.index("pip install -e")
