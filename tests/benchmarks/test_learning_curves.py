"""`logs/scores.jsonl` across new and resumed runs, and how `benchmarks/learning_curves.py` reads a run."""

import json
from pathlib import Path

import pytest
from benchmark_scripts import load_benchmark

from diffusers_lmlp.training.validation import keep_scores_until


def write_scores(path: Path, steps: list[int]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    scores = [{"shape": step / 1000, "all": step / 2000} for step in steps]
    records = [{"step": step, "minutes": step / 600, "train": s, "held-out": s} for step, s in zip(steps, scores)]
    path.write_text("".join(json.dumps(record) + "\n" for record in records))


def test_a_new_run_starts_its_scores_anew_and_a_resumed_one_keeps_those_up_to_its_step(tmp_path):
    scores = tmp_path / "logs" / "scores.jsonl"
    keep_scores_until(scores, 0)
    assert not scores.exists()  # no file yet: nothing to do
    write_scores(scores, [100, 200, 300])
    keep_scores_until(scores, 200)  # resumed from checkpoint-200: step 300 is trained again
    assert [json.loads(line)["step"] for line in scores.read_text().splitlines()] == [100, 200]
    keep_scores_until(scores, 0)  # --overwrite_output_dir: a new run
    assert scores.read_text() == ""


def test_a_run_is_read_as_its_validations_then_its_final_evaluation_and_one_without_scores_is_refused(tmp_path):
    curves, run = load_benchmark("learning_curves"), tmp_path / "run"
    write_scores(run / "logs" / "scores.jsonl", [100, 200])
    final = {"shape": 0.9, "all": 0.8}
    summary = {"steps": 200, "train_seconds": 150.0, "scores": {"train": final, "held-out": final}}
    (run / "training_summary.json").write_text(json.dumps(summary))
    points = curves.read_run(run)
    assert [p["step"] for p in points] == [100, 200]  # the final evaluation replaces the last validation's point
    assert points[-1]["held-out"] == final and points[-1]["minutes"] == 2.5
    with pytest.raises(SystemExit, match="has no logs/scores.jsonl and no finished training_summary.json"):
        curves.read_run(tmp_path / "empty")
