"""`python -m diffusers_lmlp.evaluation`: offline, as a console script, on 2 processes, interrupted and resumed."""

import importlib
import json
import os
import re
import signal
import sys
from pathlib import Path

import huggingface_hub
import numpy as np
import pytest
import torch
from diffusers import DDIMScheduler
from PIL import Image
from processes import run_bounded
from space_server import free_port
from test_evaluation import without_seconds

from diffusers_lmlp import LMLPPipeline, threads
from diffusers_lmlp.evaluation.__main__ import build_parser, main
from diffusers_lmlp.evaluation.resume import ProgressStore
from diffusers_lmlp.shapes import pretrained_shapes_pipeline


ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
ARGS = "--pipeline shapes --num_images 16 --num_inference_steps 3 --batch_size 4 --save_images --num_threads 1".split()
SMALL = "--pipeline shapes --num_images 6 --num_inference_steps 2 --batch_size 2 --save_images --no_progress".split()
SMALL += ["--num_threads", "1"]


def test_the_console_script_names_itself_and_every_option_has_help(monkeypatch, capsys):
    # That the wheel installs the script: test_packaging.py::test_the_wheel_installs_the_package_and_its_commands.
    monkeypatch.setattr(sys, "argv", [str(Path(sys.executable).parent / "diffusers-lmlp-evaluate")])
    with pytest.raises(SystemExit, match="0"):
        build_parser().parse_args(["--help"])
    usage = capsys.readouterr().out
    assert usage.startswith("usage: diffusers-lmlp-evaluate [-h] --pipeline PIPELINE") and "--fid_reference" in usage
    assert not [action.option_strings for action in build_parser()._actions if not (action.help or "").strip()]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--pipeline", "some/repo"], "--captions is required"),
        (["--pipeline", "shapes", "--num_images", "0"], "--num_images must be positive"),
        (["--pipeline", "shapes", "--captions", "missing.txt"], "error: --captions missing.txt: no such file"),
        (["--pipeline", "shapes", "--fid_reference", "missing.npz"], "error: FID reference missing.npz: no such file"),
        (["--pipeline", "shapes", "--fid_reference", "x.npz", "--fid_extractor", "inception"], "pip install torch-fi"),
        # A path to no folder is refused at parsing, not tried as a Hub id.
        *((["--pipeline", path], f"error: --pipeline {re.escape(path)}: no such folder$")
          for path in ["./lmlp-coco", "../runs/lmlp", "/no/such/pipeline", "runs/coco/final", "~/lmlp", "a..b"]),
        (["--pipeline", "model_index.json"], "index.json: not a folder; pass a pipeline folder or a Hub repo id$"),
        (["--pipeline", "some-user/absent-repo", "--captions", "shapes"],
         "^error: --pipeline some-user/absent-repo: .*offline.*`hf download some-user/absent-repo`"),
        (["--pipeline", "ddim", "--captions", "shapes"], "^error: DDIMScheduler has clip_sample=True.*clip_sample=F"),
    ],
)  # fmt: skip
def test_bad_arguments_are_named_before_any_work(args, message, tmp_path, monkeypatch, capsys, torch_threads):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.npz").touch()
    (tmp_path / "model_index.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "torch_fidelity", None)  # Inception FID without torch-fidelity
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    if "ddim" in args:
        pipe = pretrained_shapes_pipeline()
        pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config, clip_sample=True)
        pipe.save_pretrained(tmp_path / "ddim")
        evaluation = importlib.import_module("diffusers_lmlp.evaluation.evaluate")  # the package exports the function
        monkeypatch.setattr(evaluation, "evaluate", lambda *args, **kwargs: pytest.fail("evaluate() was called"))
    with pytest.raises(SystemExit) as failed:
        main([*args, "--output_dir", str(tmp_path / "out"), "--num_threads", "1"])
    said = [line for line in capsys.readouterr().err.splitlines() if "error" in line] + [str(failed.value.code)]
    assert failed.value.code != 0 and any(re.search(message, line) for line in said), said
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("num_threads", "omp_num_threads", "accelerate", "one_cpu_process", "expected"),
    [
        (None, None, False, True, 3),  # every core (3 here)
        (None, "1", False, True, 1),  # the user's OMP_NUM_THREADS
        (None, "1", True, True, 3),  # accelerate launch's own OMP_NUM_THREADS=1 is not the user's
        (None, "2", "2", True, 2),  # but one the user gave the launcher is
        (2, "1", False, True, 2),  # --num_threads wins
        (None, None, False, False, None),  # several processes, or a GPU, keep their launcher's setting
        (2, None, False, False, 2),  # unless told
    ],
)
def test_one_cpu_process_runs_on_every_core_unless_the_user_set_a_count(
    num_threads, omp_num_threads, accelerate, one_cpu_process, expected, monkeypatch, torch_threads
):
    monkeypatch.setattr(threads, "available_cores", lambda: 3)
    launcher = {"OMP_NUM_THREADS": accelerate} if isinstance(accelerate, str) else {}
    monkeypatch.setattr(threads, "launcher_environment", lambda: launcher)
    for name, value in (("OMP_NUM_THREADS", omp_num_threads), ("ACCELERATE_DYNAMO_BACKEND", accelerate and "NO")):
        monkeypatch.delenv(name, raising=False)
        if value:
            monkeypatch.setenv(name, value)
    torch.set_num_threads(4)
    threads.set_threads(num_threads, "evaluation", one_cpu_process)
    assert torch.get_num_threads() == (4 if expected is None else expected)


@pytest.mark.slow
def test_sigterm_keeps_a_partial_report_and_the_same_command_finishes_as_an_uninterrupted_run(
    tmp_path, monkeypatch, capsys, torch_threads
):
    main([*SMALL, "--output_dir", str(tmp_path / "straight")])
    straight = json.loads((tmp_path / "straight" / "report.json").read_text())
    output, calls, call, results = tmp_path / "run", [], LMLPPipeline.__call__, ProgressStore.results

    def terminated_at_the_third_batch(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # a scheduler ends the job
        return call(self, *args, **kwargs)

    def terminated_again(self):
        os.kill(os.getpid(), signal.SIGTERM)  # schedulers repeat it; `accelerate launch` forwards it once more
        yield from results(self)

    monkeypatch.setattr(LMLPPipeline, "__call__", terminated_at_the_third_batch)
    monkeypatch.setattr(ProgressStore, "results", terminated_again)
    capsys.readouterr()
    fallback = signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM's default would end pytest itself
    sigint_before = signal.getsignal(signal.SIGINT)  # KeyboardInterrupt, or ignored under `nohup`
    try:
        with pytest.raises(SystemExit) as stopped:
            main([*SMALL, "--output_dir", str(output)])
    finally:
        signal.signal(signal.SIGTERM, fallback)
    assert stopped.value.code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGINT) is sigint_before  # the command's handlers are gone
    partial = json.loads((output / "report.partial.json").read_text())
    assert partial["partial"] is True and partial["num_images_done"] == 4 and partial["num_images"] == 6
    assert partial["captions"] == "shapes" and 0 <= partial["shapes"]["colour"] <= 1
    assert not (output / "report.json").exists()
    kept, partial_report = output / "progress", output / "report.partial.json"
    said = f"The finished batches are kept in {kept} and reported on in {partial_report}; run the same command again"
    assert capsys.readouterr().err.strip().endswith(f"Interrupted after 4 of 6 images. {said} to continue.")
    calls.clear()
    main([*SMALL, "--output_dir", str(output)])
    assert len(calls) == 1  # the third batch only
    assert without_seconds(json.loads((output / "report.json").read_text())) == without_seconds(straight)
    assert sorted(path.name for path in output.iterdir()) == ["grid.png", "images", "report.json"]
    metadata = [folder / "images" / "metadata.jsonl" for folder in (output, tmp_path / "straight")]
    assert metadata[0].read_text() == metadata[1].read_text()
    assert capsys.readouterr().out.strip().endswith(f"report: {output / 'report.json'}")


# Ctrl-C in an `accelerate launch`'s terminal once each process sampled a batch: SIGINT to the launcher, and on to all.
CTRL_C_AT_THE_SECOND_BATCH = """
import os, signal, sys, time
from pathlib import Path
from diffusers_lmlp import LMLPPipeline
from diffusers_lmlp.evaluation.__main__ import main
call, calls = LMLPPipeline.__call__, []
second = Path(sys.argv[sys.argv.index("--output_dir") + 1]) / "progress" / "batch-000001.safetensors"
def interrupted(self, *args, **kwargs):
    calls.append(1)
    if len(calls) == 2 and os.environ["RANK"] == "0":
        deadline = time.monotonic() + 120
        while not second.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getppid(), signal.SIGINT)
    return call(self, *args, **kwargs)
LMLPPipeline.__call__ = interrupted
main()
"""


@pytest.mark.slow
def test_two_processes_stopped_by_ctrl_c_and_run_again_give_the_one_process_result(tmp_path, torch_threads):
    (tmp_path / "ctrl_c.py").write_text(CTRL_C_AT_THE_SECOND_BATCH)
    output, one = tmp_path / "out", tmp_path / "one"
    args = [*ARGS, "--output_dir", str(output), "--no_progress"]
    main([*ARGS, "--output_dir", str(one), "--no_progress"])

    def launch(*command: str):
        argv = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
        argv += ["--main_process_port", str(free_port()), *command]
        return run_bounded(argv, env={**ENV, "ACCELERATE_USE_CPU": "1"}, timeout=300)

    interrupted = launch(str(tmp_path / "ctrl_c.py"), *args)
    assert interrupted.returncode != 0 and "run the same command again to continue" in interrupted.stderr
    batch_files = sorted((output / "progress").glob("batch-*.safetensors"))
    # Process p samples batches p, p + 2, ...; a batch stopped between its images and its batch file is sampled again.
    done = {int(path.stem.removeprefix("batch-")) for path in batch_files}
    images = [path for path in (output / "images").glob("*.png") if int(path.stem) // 4 in done]  # --batch_size 4
    assert len(images) == 4 * len(done)  # a batch counts as done only with its images on disk
    assert 2 <= len(done) < 4 and {0, 1} <= done
    inodes = {path: path.stat().st_ino for path in [*batch_files, *images]}
    partial = json.loads((output / "report.partial.json").read_text())  # reported on by the first process
    assert partial["partial"] is True and 8 <= partial["num_images_done"] <= 4 * len(done)
    resumed = launch("-m", "diffusers_lmlp.evaluation", *args, "--keep_progress")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"Resuming the evaluation kept in {output / 'progress'}" in resumed.stderr
    assert len(resumed.stdout.strip().splitlines()) == 1  # the main process prints the summary
    kept = sorted(path.name for path in (output / "progress").iterdir())  # --keep_progress keeps the finished run's
    assert kept == [".evaluation.lock", *(f"batch-{k:06d}.safetensors" for k in range(4)), "settings.json"]
    assert all(path.stat().st_ino == inode for path, inode in inodes.items())  # read, not sampled and written again
    assert not (output / "report.partial.json").exists()
    first, second = (json.loads((folder / "report.json").read_text()) for folder in (one, output))
    assert second["num_processes"] == 2 and second["shapes"] == first["shapes"]
    for key in ("fid", "fid_floor"):  # float32 features from processes with other thread counts: not bit for bit
        assert second[key] == pytest.approx(first[key], rel=1e-4)
    for i in range(16):
        a, b = (np.asarray(Image.open(f / "images" / f"{i:06d}.png"), np.int16) for f in (one, output))
        assert np.abs(a - b).max() <= 1, i
    assert (one / "images" / "metadata.jsonl").read_text() == (output / "images" / "metadata.jsonl").read_text()
