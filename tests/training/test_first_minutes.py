"""A user's first minutes: the README's main command, quiet on a fresh machine, its progress in a log, its summary."""

import io
import json
import os
import shlex
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from benchmark_scripts import load_benchmark
from PIL import Image
from processes import run_bounded
from tqdm.std import tqdm as plain_tqdm

from diffusers_lmlp import progress as progress_module
from diffusers_lmlp.progress import LineProgress, progress_bar
from diffusers_lmlp.shapes.pretrained import PIPELINE_PATH
from diffusers_lmlp.training import format_run_summary
from diffusers_lmlp.training.finishing import format_duration


ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
MAIN_COMMAND = README.split("<!-- main-command -->", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
MAIN_COMMAND = MAIN_COMMAND.strip().split(" && ")[-1]  # what runs after the install
# The start of the warning `accelerate launch` prints when it falls back to defaults (accelerate/commands/launch.py).
ACCELERATE_WARNING = "were not passed to `accelerate launch` and had defaults used instead"


@pytest.mark.parametrize(
    "total, initial, step, n, lines, last",
    [
        (5000, 0, 0.125, 5000, range(250, 5001, 250),  # a line at every 5%, the last one at the final step
         "steps: 100% 5000/5000, 10:25 elapsed, ETA 00:00, 8.00it/s, loss=0.0002, lr=1.00e-03"),
        (1_000_000, 0, 30.0, 30, range(2, 31, 2), "ETA 8333:"),  # a slow run still writes a line every minute
        (2600, 1300, 0.03125, 1300, range(1430, 2601, 130),  # resumed: counts from its step, its speed from now
         "steps: 100% 2600/2600, 00:40 elapsed, ETA 00:00, 32.00it/s"),
        (1000, 0, 0.125, 124, [50, 100, 124], "steps:  12% 124/1000, 00:15 elapsed"),  # stopped: where it got to, once
    ]
)  # fmt: skip
def test_a_log_file_gets_plain_lines_every_five_percent_or_minute(monkeypatch, total, initial, step, n, lines, last):
    clock = SimpleNamespace(now=1000.0)  # `time.monotonic`, moved only by the test
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: clock.now)
    log = io.StringIO()  # not a terminal, as a file or a pipe
    bar = progress_bar(total, "steps", initial=initial, file=log)
    assert isinstance(bar, LineProgress)
    for i in range(n):  # updates
        clock.now += step  # seconds, exact in binary, as are the sums
        if total == 5000:
            bar.set_postfix(loss=f"{1 / (i + 1):.4f}", lr="1.00e-03", refresh=False)
        bar.update(1)
    bar.close()
    bar.close()
    text = log.getvalue()
    counts = [int(line.split("/", 1)[0].rsplit(" ", 1)[1]) for line in text.splitlines()]  # "1300" of "1300/2600"
    assert "\r" not in text and text.endswith("\n") and counts == list(lines) and last in text.splitlines()[-1]


def test_a_terminal_keeps_tqdms_bar_and_other_processes_show_nothing(monkeypatch):
    terminal, log = io.StringIO(), io.StringIO()
    monkeypatch.setattr(terminal, "isatty", lambda: True)
    for file, disable in ((terminal, False), (log, True)):
        bar = progress_bar(100, "steps", file=file, disable=disable)
        assert isinstance(bar, plain_tqdm)
        bar.update(100)
        bar.close()
    assert "\r" in terminal.getvalue() and "100/100" in terminal.getvalue() and log.getvalue() == ""


@pytest.mark.parametrize(
    "seconds, text", [(42.34, "42.3 s"), (505.0, "8 min 25 s"), (3599.6, "1 h 00 min"), (93_784, "26 h 03 min")]
)
def test_durations_read_as_a_person_says_them(seconds, text):
    assert format_duration(seconds) == text


SHAPES_SUMMARY = {
    "num_processes": 1, "ranks_in_sync": True, "steps": 2600, "train_seconds": 504.7,
    "scores": {
        "train": {"colour": 1.0, "shape": 0.42, "colour+position": 0.96, "all": 0.4},
        "held-out": {"colour": 0.96, "shape": 0.42, "colour+position": 0.94},
    },
    "score_intervals": {"train": {"colour": [1.0, 1.0], "shape": [0.334, 0.506]}, "held-out": {"shape": [0.34, 0.5]}},
    "images_per_caption": {"train": 3, "held-out": 4},
    "shapes_fid": {"train": {"fid": 6.8731, "fid_floor": 0.1107, "num_images": 96},
                   "held-out": {"fid": 7.0012, "fid_floor": 0.1189, "num_images": 128}},
    "evaluation_sampler": {"scheduler": "DPMSolverMultistepScheduler", "num_inference_steps": 50, "guidance_scale": 2},
}  # fmt: skip


def test_the_summary_says_where_everything_is_the_scores_and_how_to_load_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = Path("lmlp-shapes")
    for name in ("validation/step-0000650.png", "validation/step-0001300.png", "logs/run/events.out.tfevents.1"):
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(b"")
    folders = dict(validation_dir=out / "validation", logging_dir=out / "logs")
    text = format_run_summary(SHAPES_SUMMARY, out, sample_grid=out / "samples.png", **folders)
    # A metric without an interval shows the score alone; one a split lacks is not there ("all" of held-out).
    assert text == (
        "Trained 2,600 steps in 8 min 25 s on 1 process.\n"
        "  pipeline    lmlp-shapes\n"
        "  samples     lmlp-shapes/samples.png\n"
        "  validation  lmlp-shapes/validation (2 grids)\n"
        "  logs        lmlp-shapes/logs (tensorboard --logdir lmlp-shapes/logs)\n"
        "  summary     lmlp-shapes/training_summary.json\n"
        "\n"
        "Scores (95% intervals over captions; 50 DPMSolverMultistepScheduler steps, guidance 2):\n"
        "                   train               held-out\n"
        "  images           96 (3 per caption)  128 (4 per caption)\n"
        "  colour           100% (100-100%)     96%\n"
        "  shape            42% (33-51%)        42% (34-50%)\n"
        "  colour+position  96%                 94%\n"
        "  all              40%                 -\n"
        "  shapes-FID       6.87 (floor 0.11)   7.00 (floor 0.12)\n"
        "\n"
        "Load it in Python:\n"
        '  from diffusers_lmlp import LMLPPipeline; pipe = LMLPPipeline.from_pretrained("lmlp-shapes")'
    )


def test_the_summary_of_a_run_without_scores_or_grids_warns_of_unsynced_processes():
    summary = {"num_processes": 8, "ranks_in_sync": False, "steps": 1_000_000, "train_seconds": 300_000.0}
    text = format_run_summary(summary, PIPELINE_PATH, hub_url="https://huggingface.co/alice/lmlp/commit/abc")
    lines = text.splitlines()
    assert lines[0] == "Trained 1,000,000 steps in 83 h 20 min on 8 processes."
    assert lines[1].startswith("WARNING: the processes ended with different weights")
    assert [line.split()[0] for line in lines[2:] if line] == ["pipeline", "summary", "hub", "Load", "from"]
    assert "Scores" not in text and "samples" not in text and lines[-1].endswith(f'from_pretrained("{PIPELINE_PATH}")')


def launch(argv: list[str], tmp_path: Path) -> tuple[list[str], dict]:
    """`argv` run by this environment's `accelerate` as on a fresh machine: no `accelerate config`, no ACCELERATE_*."""
    assert argv[:2] == ["accelerate", "launch"], argv
    env = {name: value for name, value in os.environ.items() if not name.startswith("ACCELERATE_")}
    env.update(HF_HOME=str(tmp_path / "fresh-hf-home"), HF_HUB_OFFLINE="1")
    return [str(Path(sys.executable).with_name("accelerate")), *argv[1:]], env


@pytest.mark.slow
def test_readme_main_command_is_quiet_logs_plain_progress_and_ends_with_the_summary(tmp_path, capsys):
    assert MAIN_COMMAND.startswith("accelerate launch ") and MAIN_COMMAND.endswith("examples/train_text_to_image.py")
    out = tmp_path / "shapes"
    argv, env = launch(shlex.split(MAIN_COMMAND), tmp_path)
    argv += ["--max_train_steps", "20", "--validation_steps", "10", "--validation_inference_steps", "2",
             "--shapes_num_images", "256", "--final_evaluation_inference_steps", "2", "--output_dir", str(out),
             "--cache_dir", str(tmp_path / "cache")]  # fmt: skip
    log = tmp_path / "train.log"  # from the clone, into a log file as `> train.log 2>&1` writes one
    command = ["bash", "-c", f"{shlex.join(argv)} > {shlex.quote(str(log))} 2>&1"]
    result = run_bounded(command, env=env, timeout=900, cwd=ROOT)
    text = log.read_bytes().decode()  # bytes: reading as text would turn carriage returns into newlines
    assert result.returncode == 0, text[-4000:]
    assert ACCELERATE_WARNING not in text and "accelerate config" not in text
    (tmp_path / "hello.py").write_text("print('hello')\n")  # the control: accelerate warns without the shipped config
    control, env = launch(["accelerate", "launch", str(tmp_path / "hello.py")], tmp_path)
    assert ACCELERATE_WARNING in run_bounded(control, env=env, timeout=300, cwd=ROOT).stderr
    # A log file is not a terminal: plain lines, no carriage returns, at most one per 5% per bar.
    lines, bars = text.strip().splitlines(), ("steps: ", "extracting features", "sampling: ")
    steps, extraction, sampling = ([line for line in lines if line.startswith(bar)] for bar in bars)
    assert "\r" not in text and len(steps) == 20 and "loss=" in steps[-1]
    assert steps[-1].startswith("steps: 100% 20/20, ")
    assert 1 <= len(extraction) <= 21 and "100% 256/256" in extraction[-1]
    # The final evaluation samples both splits (3 seeds of the training captions, 4 of the held-out ones).
    finished = [line.split(",")[0] for line in sampling if line.startswith("sampling: 100% ")]
    assert finished == ["sampling: 100% 96/96", "sampling: 100% 128/128"] and len(sampling) <= 2 * 21, sampling
    assert "evaluation: {" not in text and (out / "logs" / "evaluation.json").is_file()
    # The summary (format_run_summary's, as tested above) is the run's last words; its last line loads the pipeline.
    saved = json.loads((out / "training_summary.json").read_text())
    folders = dict(sample_grid=out / "samples.png", validation_dir=out / "validation", logging_dir=out / "logs")
    assert text.rstrip().endswith(f"\n{format_run_summary(saved, out, **folders)}"), text[-3000:]
    assert "(2 grids)" in text and lines[-1].strip().startswith("from diffusers_lmlp import LMLPPipeline")
    exec(lines[-1].strip(), namespace := {})
    # The VAE's latent scale travels with the pipeline, which samples at 32 px.
    pipe, vae_config = namespace["pipe"], json.loads((out / "vae" / "config.json").read_text())
    assert pipe.native_size == 32 and pipe.vae.config.scaling_factor == pytest.approx(vae_config["scaling_factor"])
    assert saved["steps"] == 20 and set(saved["scores"]) == {"train", "held-out"}
    assert list((out / "logs").rglob("events.out.tfevents.*"))  # tensorboard logging, the default
    # Each validation scored both splits: the learning curves, which the benchmark script plots.
    scores = [json.loads(line) for line in (out / "logs" / "scores.jsonl").read_text().splitlines()]
    assert [record["step"] for record in scores] == [10, 20] and {"train", "held-out"} <= set(scores[0])
    assert 0 < scores[0]["minutes"] < scores[1]["minutes"] <= saved["train_seconds"] / 60
    assert all(0 <= record[split]["shape"] <= 1 for record in scores for split in ("train", "held-out"))
    load_benchmark("learning_curves").main([str(out), "--labels", "tiny", "--output", str(tmp_path / "curves.png")])
    final = saved["scores"]["held-out"]
    assert f"| tiny | 20 | {saved['train_seconds'] / 60:.1f} | {final['shape']:.0%} |" in capsys.readouterr().out
    with Image.open(tmp_path / "curves.png") as image:
        assert image.size[0] > 800 and image.size[1] > 600
