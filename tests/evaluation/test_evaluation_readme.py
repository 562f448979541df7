"""The documented evaluation commands run offline (shapes; COCO-2014 with stand-ins), and FID during training."""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from coco_fixture import CLIP_REPO, write_coco2014, write_hub_cache
from documents import blocks
from processes import run_bounded, warnings_in
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_train_text_to_image import ENV, free_port, make_workspace, train, train_args

from diffusers_lmlp.allocator import MALLOC_VARIABLES
from diffusers_lmlp.evaluation import FIDStatistics
from diffusers_lmlp.evaluation.__main__ import parse_args
from diffusers_lmlp.evaluation.captions import draw_captions
from diffusers_lmlp.tiny import build_tiny_pipeline
from diffusers_lmlp.training.arguments import parse_args as parse_training_args


ROOT = Path(__file__).resolve().parents[2]
STAND_INS = {"PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "stand_ins"), ENV.get("PYTHONPATH", "")])}
COMMANDS, README_COMMANDS = (
    [line for line in "\n".join(blocks(page, "bash")).splitlines() if "-m diffusers_lmlp.evaluation" in line]
    for page in ("docs/evaluation.md", "README.md")
)
# The README's 30k images and 50 steps, shortened: the options are the README's, these only come after them.
SHORT = ["--num_images", "4", "--num_inference_steps", "2", "--batch_size", "2", "--no_progress"]


def as_argv(command: str) -> list[str]:  # on this Python, 2 CPU processes, a free port
    argv = shlex.split(command)
    if argv[:2] == ["accelerate", "launch"]:
        argv[argv.index("--num_processes") + 1] = "2"
        argv[argv.index("examples/accelerate.yaml")] = str(ROOT / "examples" / "accelerate.yaml")  # cwd: coco's
        return [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", str(free_port()), *argv[2:]]
    assert argv[0] == "python", command
    return [sys.executable, *argv[1:]]


def test_readme_has_the_evaluation_commands():
    assert COMMANDS[0] == "python -m diffusers_lmlp.evaluation --pipeline shapes", COMMANDS
    assert len(COMMANDS) == 3 and all("--captions coco2014" in command for command in COMMANDS[1:])
    assert README_COMMANDS == COMMANDS[:1]  # docs/evaluation.md's shapes one, which the next test runs


@pytest.mark.slow
def test_the_shapes_command_runs_offline_with_the_documented_defaults(tmp_path):
    # The shapes command with 12 of its 1,000 images (one batch); its defaults read from its own argument parsing.
    argv = as_argv(COMMANDS[0])
    defaults = parse_args(argv[3:])  # after `python -m diffusers_lmlp.evaluation`
    assert defaults.num_inference_steps == 50 and len(draw_captions(defaults.captions, defaults.num_images, 0)) == 1000
    # Offline, with glibc's malloc as it starts, and the suite's thread share if any.
    env = {name: value for name, value in os.environ.items() if name not in (*MALLOC_VARIABLES, "GLIBC_TUNABLES")}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    result = run_bounded([*argv, "--num_images", "12"], env=env, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    # On the CPU, glibc keeps freed buffers: without it, every pass page-faults its activations back in.
    assert "CPU memory: glibc keeps up to 1 GiB of freed buffers for reuse" in result.stderr
    report = json.loads((tmp_path / "evaluation" / "report.json").read_text())
    assert report["num_images"] == 12 and report["captions"] == "shapes" and report["seed"] == 0
    assert report["num_processes"] == 1 and "clip_score" not in report  # no CLIP on the shapes world unless asked
    sampler = dict(scheduler="DPMSolverMultistepScheduler", num_inference_steps=50, guidance_scale=2.0, batch_size=50)
    assert report["sampler"] == {**sampler, "dtype": "float32", "resolution": 32}
    # FID and its real-vs-real floor, both measured (on 12 images the floor is too noisy to rank them).
    assert min(report["fid"], report["fid_floor"]) > 0 and report["shapes"]["colour"] > 0.8
    (line,) = result.stdout.strip().splitlines()  # a one-line summary
    assert line.startswith(f"{report['model']}: 12 images, 50 steps, guidance 2.0: FID {report['fid']:.2f} vs shapes")
    assert f"real-vs-real floor {report['fid_floor']:.2f}" in line and "colour+position" in line
    assert line.endswith("report: evaluation/report.json") and (tmp_path / "evaluation" / "grid.png").is_file()


@pytest.fixture(scope="module")
def coco(tmp_path_factory) -> SimpleNamespace:
    """`coco2014/`, `lmlp-coco-f2/`, a pytorch-fid statistics file of the val images and CLIP in an HF cache."""
    root = tmp_path_factory.mktemp("coco-eval")
    write_coco2014(root / "coco2014", num_train=1, num_val=6)
    build_tiny_pipeline().save_pretrained(root / "lmlp-coco-f2")
    cache = write_hub_cache(root / "hf")
    env = {**ENV, **STAND_INS, "HF_HOME": str(root / "hf"), "HF_HUB_CACHE": str(cache), "ACCELERATE_USE_CPU": "1"}
    statistics = """
from diffusers_lmlp.evaluation import FIDStatistics, InceptionFeatures, Processes, reference_statistics
s = reference_statistics("coco2014/val2014", InceptionFeatures(), 16, processes=Processes(), cache_dir="stats-cache")
FIDStatistics(s.mu, s.sigma).save("fid_stats_mscoco256_val.npz")
"""
    result = subprocess.run([sys.executable, "-c", statistics], cwd=root, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    return SimpleNamespace(root=root, env=env)


def run_readme(coco, index: int) -> dict:
    result = run_bounded([*as_argv(COMMANDS[index]), *SHORT], env=coco.env, timeout=300, cwd=coco.root)
    assert result.returncode == 0, result.stderr[-3000:]
    assert not warnings_in(result.stderr), warnings_in(result.stderr)
    output = Path(shlex.split(COMMANDS[index])[-1])
    assert result.stdout.strip().endswith(f"report: {output / 'report.json'}")
    return json.loads((coco.root / output / "report.json").read_text())


@pytest.mark.slow
def test_coco_fid_and_clip_score_against_the_published_statistics(coco):
    report = run_readme(coco, 1)
    assert report["num_processes"] == 2 and report["num_images"] == 4 and report["captions"] == "coco2014"
    assert report["fid_reference"] == "fid_stats_mscoco256_val.npz" and report["fid_reference_images"] is None
    assert report["fid_extractor"].startswith("inception-v3-compat (torch-fidelity") and report["fid"] > 0
    assert report["clip_model"] == CLIP_REPO and 0 <= report["clip_score"] <= 100
    coco.published = report


@pytest.mark.slow
def test_coco_fid_against_the_val_images_themselves_equals_the_published_statistics(coco):
    report = run_readme(coco, 2)
    assert report["fid_reference"] == "coco2014/val2014" and report["fid_reference_images"] == 6
    cached = list((coco.root / "hf" / "diffusers_lmlp" / "fid_stats").glob("val2014-16px-*.npz"))
    assert len(cached) == 1 and FIDStatistics.load(cached[0]).extractor == report["fid_extractor"]
    # The same images and the same reference images: the same FID and CLIP score as against the .npz.
    published = getattr(coco, "published", None) or run_readme(coco, 1)
    assert report["fid"] == pytest.approx(published["fid"], rel=1e-6)
    assert report["clip_score"] == pytest.approx(published["clip_score"], rel=1e-9)


@pytest.mark.slow
def test_fid_during_training_is_logged_at_every_validation(tmp_path):
    (tmp_path / "captions.txt").write_text("a red circle\na blue square\n", encoding="utf-8")
    workspace = tmp_path / "work"
    make_workspace(workspace)
    result = train(
        workspace, "fid", "--max_train_steps", "2", "--validation_steps", "1", "--validation_inference_steps", "2",
        "--validation_fid_images", "4", "--validation_fid_captions", str(tmp_path / "captions.txt"),
        "--validation_fid_reference", str(workspace / "data"), "--report_to", "tensorboard", env={**ENV, **STAND_INS},
    )  # fmt: skip
    assert "FID" in result.stderr
    fids = EventAccumulator(str(workspace / "fid" / "logs" / "lmlp-text-to-image")).Reload().Scalars("fid")
    assert [event.step for event in fids] == [1, 2] and all(event.value > 0 for event in fids)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--validation_fid_images", "4"], "needs --validation_fid_captions and --validation_fid_reference"),
        (["--validation_fid_images", "-1"], "argument --validation_fid_images: must be >= 0 (0: no FID"),
    ],
)
def test_fid_during_training_on_your_data_needs_captions_and_a_reference(tmp_path, extra, message, capsys):
    with pytest.raises(SystemExit, match="2"):
        parse_training_args([*train_args(tmp_path, "bad"), "--max_train_steps", "1", *extra])
    assert message in capsys.readouterr().err
