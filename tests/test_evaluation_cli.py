"""`python -m diffusers_lmlp.evaluation` as users run it: offline on the shipped shapes pipeline, as the console
script, and on 2 processes through `accelerate launch`, whose result must equal the 1-process run's."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.processes import run_bounded
from tests.space_server import free_port


ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
ARGS = [
    "--pipeline",
    "shapes",
    "--num_images",
    "20",
    "--num_inference_steps",
    "3",
    "--batch_size",
    "4",
    "--save_images",
]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> tuple[Path, str]:
    output = tmp_path_factory.mktemp("one")
    result = run_bounded(
        [sys.executable, "-m", "diffusers_lmlp.evaluation", *ARGS, "--output_dir", str(output)], env=ENV, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return output, result.stdout


def test_the_shipped_pipeline_is_evaluated_offline_with_a_one_line_summary(one_process):
    output, stdout = one_process
    report = json.loads((output / "report.json").read_text())
    (line,) = stdout.strip().splitlines()
    assert line.startswith(f"{report['model']}: 20 images, 3 steps, guidance 2.0: FID {report['fid']:.2f} vs shapes")
    assert f"real-vs-real floor {report['fid_floor']:.2f}" in line and "colour+position" in line
    assert line.endswith(f"report: {output / 'report.json'}")
    assert report["captions"] == "shapes" and report["seed"] == 0 and report["num_processes"] == 1
    assert report["sampler"] == {
        "scheduler": "DPMSolverMultistepScheduler",
        "num_inference_steps": 3,
        "guidance_scale": 2.0,
        "batch_size": 4,
        "dtype": "float32",
        "resolution": 32,
    }
    assert "clip_score" not in report  # no CLIP on the shapes world unless asked
    assert Image.open(output / "grid.png").width > 0
    assert len(list((output / "images").glob("*.png"))) == 20


def test_two_processes_give_the_one_process_result(one_process, tmp_path):
    output, _ = one_process
    launch = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--main_process_port", str(free_port()), "-m", "diffusers_lmlp.evaluation", *ARGS, "--output_dir",
        str(tmp_path), "--no_progress",
    ]  # fmt: skip
    result = run_bounded(launch, env={**ENV, "ACCELERATE_USE_CPU": "1"}, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(result.stdout.strip().splitlines()) == 1  # the main process prints the summary
    one, two = (json.loads((folder / "report.json").read_text()) for folder in (output, tmp_path))
    assert two["num_processes"] == 2
    # float32 features from processes with other thread counts: equal to float tolerance, not bit for bit
    for key in ("fid", "fid_floor"):
        assert two[key] == pytest.approx(one[key], rel=1e-4)
    assert two["shapes"] == one["shapes"]
    for i in range(20):
        a, b = (np.asarray(Image.open(folder / "images" / f"{i:06d}.png"), np.int16) for folder in (output, tmp_path))
        assert np.abs(a - b).max() <= 1, i
    assert (output / "images" / "metadata.jsonl").read_text() == (tmp_path / "images" / "metadata.jsonl").read_text()


def test_the_console_script_is_installed():
    command = shutil.which("diffusers-lmlp-evaluate", path=str(Path(sys.executable).parent))
    assert command is not None, "pip install the package: it declares the diffusers-lmlp-evaluate console script"
    result = subprocess.run([command, "--help"], capture_output=True, text=True, env=ENV, timeout=120)
    assert result.returncode == 0 and "--fid_reference" in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--pipeline", "some/repo"], "--captions is required"),
        (["--pipeline", "shapes", "--num_images", "0"], "--num_images must be positive"),
        (["--pipeline", "shapes", "--captions", "missing.txt"], "error: --captions missing.txt: no such file"),
        (["--pipeline", "shapes", "--fid_reference", "missing.npz"], "error: FID reference missing.npz: no such file"),
    ],
)
def test_bad_arguments_are_named(args, message, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "diffusers_lmlp.evaluation", *args, "--output_dir", str(tmp_path)],
        capture_output=True, text=True, env=ENV, cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert result.returncode != 0 and message in result.stderr, result.stderr[-2000:]
    assert not (tmp_path / "report.json").exists()
