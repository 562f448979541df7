"""benchmarks/ablation_shapes.py: width matching, the shared budget, the table, resuming, and a smoke run."""

import dataclasses
import json
import subprocess
import sys

import pytest
from benchmark_scripts import ENV, load_benchmark
from documents import ROOT
from PIL import Image

from diffusers_lmlp.models.catalog import SHAPES_SMALL
from diffusers_lmlp.models.families import FAMILIES, named_configs


PARAMS_TOLERANCE = 0.10  # of shapes-S's 860,386: U-ViT's width is a multiple of its 8 heads (D = 88: +7.1%)
ablation = load_benchmark("ablation_shapes")
TARGET = ablation.reference_params()


@pytest.fixture(scope="module")
def entries():
    return [ablation.plan_entry(name, TARGET) for name in ablation.default_entries()]


def fake_run(folder, steps: int, held_out_shape: float = 0.5) -> None:
    """Write a shapes preset's `training_summary.json` with made-up scores into `folder`."""
    scores = dict(colour=0.9, shape=held_out_shape, position=0.8, size=0.7) | {"colour+position": 0.45, "all": 0.25}
    splits = ("train", "held-out")
    summary = {
        "steps": steps, "train_seconds": 2.0 * steps, "scores": dict.fromkeys(splits, scores),
        "score_intervals": {split: {k: [v - 0.1, v + 0.1] for k, v in scores.items()} for split in splits},
        "shapes_fid": {split: {"fid": 12.345, "fid_floor": 0.7, "num_images": 128} for split in splits},
    }  # fmt: skip
    folder.mkdir(exist_ok=True)
    (folder / "training_summary.json").write_text(json.dumps(summary))


def test_the_reference_is_the_shipped_shapes_model_and_the_entries_every_family_and_table_1s():
    entries = ablation.default_entries()
    assert TARGET == 860_386 and entries[: len(FAMILIES)] == list(FAMILIES)
    assert entries[len(FAMILIES) :] == [name for name in ("A1", "A2", "A3", "F2", "2E1H") if name in named_configs()]
    assert {"uvit", "paramixer", "symmixer", "lmlp"} <= set(entries)
    assert ablation.budget_steps({"a": 0.001}, 1.0) == 1  # at least one step


@pytest.mark.slow
def test_every_entry_matches_the_parameter_count_at_the_closest_width_it_accepts(entries):
    for entry in entries:
        assert entry.error is None, f"{entry.name}: {entry.error}"
        assert abs(entry.params - TARGET) <= PARAMS_TOLERANCE * TARGET, (entry.name, entry.params)
        width = entry.config["hidden_size"]
        assert sum(p.numel() for p in ablation.build_on_meta(entry.family, entry.config).parameters()) == entry.params
        for neighbour in (width - 1, width + 1):  # no accepted width nearby comes closer
            try:
                other = ablation.build_on_meta(entry.family, {**entry.config, "hidden_size": neighbour})
            except ValueError:
                continue
            assert abs(sum(p.numel() for p in other.parameters()) - TARGET) >= abs(entry.params - TARGET), entry.name


def test_entries_take_the_shapes_skeleton_and_keep_their_block_options(entries):
    named, skeleton = named_configs(), {k: v for k, v in SHAPES_SMALL.items() if k != "hidden_size"}
    for entry in entries:
        assert {k: entry.config[k] for k in skeleton} == skeleton, entry.name
        options = named[entry.name][1] if entry.name in named else {}
        own = {k: v for k, v in options.items() if k not in SHAPES_SMALL}
        assert {k: entry.config[k] for k in own} == own, entry.name
    a1 = next(entry for entry in entries if entry.name == "A1")
    assert a1.config["mlp_ratio"] is None and a1.config["long_skip"] is None and a1.config["lateral_mlp_ratio"] == 2.0


def test_a_config_no_width_can_build_is_a_failed_entry_not_a_crash(monkeypatch):
    monkeypatch.setattr(ablation, "WIDTHS", range(1, 3))
    entry = ablation.plan_entry("uvit", TARGET)
    assert entry.params is None and entry.error.startswith("ValueError: no width in 1..2 builds a U-ViT here: ")
    assert "hidden_size" in entry.error  # the model's own reason


def test_every_entry_trains_the_steps_the_slowest_trains_in_the_budget(tmp_path, monkeypatch):
    speeds, runs = {"lmlp": 4.0, "A1": 0.5}, []
    monkeypatch.setattr(ablation, "measure_speed", lambda entry, batch_size, device: speeds[entry.name])
    monkeypatch.setattr(ablation, "run_training", lambda entry, steps, output_dir, extra: runs.append(steps))
    ablation.main(["--models", "lmlp", "A1", "--minutes_per_model", "0.5", "--output_dir", str(tmp_path)])
    assert runs == [15, 15]  # floor(30 s × 0.5 steps/s), for both
    assert json.loads((tmp_path / "plan.json").read_text()) == {"steps": 15, "train_batch_size": 64}


def test_training_command_gives_the_full_config_and_sparse_checkpoints(entries, tmp_path):
    entry = next(entry for entry in entries if entry.name == "A3")
    command = ablation.training_command(entry, 100, tmp_path, ["--seed", "1"])
    overrides = command[command.index("--model_overrides") + 1 : command.index("--max_train_steps")]
    assert dict(pair.split("=", 1) for pair in overrides) == {k: json.dumps(v) for k, v in entry.config.items()}
    options = ("--model_type", "--max_train_steps", "--checkpointing_steps", "--validation_steps", "--output_dir")
    values = [command[command.index(option) + 1] for option in options]
    assert values == ["gmlp", "100", "25", "101", str(tmp_path / "A3")]  # validation 101: only the final samples
    assert entry.family.name == "gmlp" and command[-2:] == ["--seed", "1"]


def split_cells(line: str) -> list[str]:
    cells = line.strip().removeprefix("|").removesuffix("|").replace("\\|", "\0").split("|")
    return [cell.strip().replace("\0", "\\|") for cell in cells]


def test_table_has_a_row_per_entry_with_scores_intervals_and_failures(entries, tmp_path):
    fake_run(tmp_path, 20)
    done = dataclasses.replace(entries[0], result=ablation.read_result(tmp_path))
    failed = dataclasses.replace(entries[1], error="exit status 1: error: a | b")
    unplanned = ablation.Entry("broken", entries[0].family, error="ValueError: x")
    table = ablation.format_table([done, failed, unplanned, entries[2]], TARGET, 20, 64)
    first, _, header, rule, *rows = table.splitlines()
    assert first.startswith("20 steps at batch 64 per entry; width D matched to shapes-S's 860,386 parameters")
    assert "128 held-out images" in first
    assert split_cells(header) == list(ablation.TABLE_HEADER) and rule == "|" + "---|" * len(ablation.TABLE_HEADER)
    done, failed, unplanned, untrained = (dict(zip(ablation.TABLE_HEADER, split_cells(r), strict=True)) for r in rows)
    assert list(done.values()) == [
        "lmlp", "UL-MLP", "96", "860,386", "+0.0%", "23.3", "0.50", "45% (35–55)", "50% (40–60)", "25% (15–35)",
        "12.35", "",
    ]  # fmt: skip
    assert failed["held-out shape"] == "—" and failed["notes"] == "failed: exit status 1: error: a \\| b"
    assert unplanned["params"] == "—" and unplanned["notes"] == "failed: ValueError: x"
    assert untrained["params"] != "—" and untrained["shapes-FID"] == "—" and untrained["notes"] == "not trained yet"


def test_a_restart_skips_finished_entries_and_keeps_their_budget(tmp_path, monkeypatch):
    (tmp_path / "plan.json").write_text(json.dumps({"steps": 7, "train_batch_size": 64}))
    fake_run(tmp_path / "lmlp", 7, held_out_shape=0.75)
    runs, fail = [], lambda entry: setattr(entry, "error", "exit status 1: boom")
    monkeypatch.setattr(ablation, "measure_speed", lambda entry, batch_size, device: 1.0)
    monkeypatch.setattr(ablation, "run_training", lambda entry, *a: fail(entry) or runs.append((entry.name, *a)))
    argv = ["--models", "lmlp", "F2", "--output_dir", str(tmp_path), "--", "--seed", "3"]
    ablation.main(argv)
    assert runs == [("F2", 7, tmp_path, ["--seed", "3"])]  # lmlp is read back, F2 gets the first run's steps
    lmlp, f2 = json.loads((tmp_path / "results.json").read_text())["entries"]
    assert lmlp["entry"] == "lmlp" and lmlp["scores"]["shape"] == 0.75 and lmlp["error"] is None
    assert f2["entry"] == "F2" and f2["error"] == "exit status 1: boom" and "scores" not in f2
    assert "| 75% (65–85) |" in (tmp_path / "results.md").read_text()
    with pytest.raises(SystemExit, match="holds runs of 7 steps"):
        ablation.main([*argv[:5], "--steps", "8"])


@pytest.mark.slow
def test_an_entry_trains_scores_and_resumes_end_to_end_beside_a_finished_one(tmp_path, capsys):
    # docs/ablation.md's command, shortened: lmlp trains for real beside A3, already trained (a made-up run).
    fake_run(tmp_path / "A3", 2)
    Image.new("RGB", (160, 96), "white").save(tmp_path / "A3" / "samples.png")
    command = [
        sys.executable, str(ROOT / "benchmarks" / "ablation_shapes.py"), "--models", "lmlp", "A3", "--steps", "2",
        "--output_dir", str(tmp_path), "--", "--validation_inference_steps", "2",
        "--final_evaluation_inference_steps", "2", "--max_train_samples", "128",
    ]  # fmt: skip
    result = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "resuming: A3 already trained" in result.stdout and "2 steps at batch 64 for every entry" in result.stdout
    results = json.loads((tmp_path / "results.json").read_text())
    assert [(e["entry"], e["error"], e["steps"]) for e in results["entries"]] == [("lmlp", None, 2), ("A3", None, 2)]
    lmlp = results["entries"][0]
    assert 0 <= lmlp["scores"]["colour+position"] <= 1 and lmlp["shapes_fid"] > 0 and lmlp["train_seconds"] > 0
    table = (tmp_path / "results.md").read_text()
    assert "| lmlp | UL-MLP | 96 | 860,386 | +0.0% |" in table and "| A3 | gMLP |" in table
    grid = Image.open(tmp_path / "grids" / "lmlp.png")
    assert grid.size[0] > 100 and (tmp_path / "grids" / "A3.png").is_file()
    assert Image.open(tmp_path / "ablation.png").size[0] > 400
    sheet = Image.open(tmp_path / "samples.png")  # both entries' grids at half size, side by side, labelled
    assert sheet.size[0] >= 2 * (grid.size[0] // 2) and sheet.size[1] > grid.size[1] // 2
    ablation.main(command[2:])  # the same command again, in this process: it trains nothing
    again = capsys.readouterr().out
    assert "already trained" in again and "training lmlp" not in again
    assert (tmp_path / "results.md").read_text() == table
