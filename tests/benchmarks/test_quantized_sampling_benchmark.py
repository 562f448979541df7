"""The sampling benchmarks' short runs: quantized_sampling.py's precisions, space_sampling.py's eager and frozen."""

import pytest
from benchmark_scripts import load_benchmark

from diffusers_lmlp.cpu import this_cpu


@pytest.mark.slow
def test_a_short_run_measures_every_precision_in_one_window(capsys):
    argv = "--models F2 --batch_size 1 --repeats 1 --num_captions 2 --num_inference_steps 2"
    backbones, shapes = load_benchmark("quantized_sampling").main(argv.split())
    precisions = ["fp32", "bf16", "int8"] if this_cpu().native_bf16 else ["fp32", "int8"]
    assert [(row["model"], row["precision"]) for row in backbones] == [
        (model, precision) for model in ("U-ViT-S/2", "F2") for precision in precisions
    ]
    for row in backbones:  # int8's and bf16's error: rounding, not a layer left out or garbage
        assert row["ms"] > 0 and (row["model"] != "U-ViT-S/2" or row["vs_baseline"] == 1), row
        fp32 = row["vs_fp32"] == 1 and row["error"] == 0
        assert fp32 if row["precision"] == "fp32" else 0 < row["error"] < 0.1, row
    assert [row["precision"] for row in shapes] == ["fp32", "int8"]
    assert all(row["seconds"] > 0 and 0 <= row["scores"]["all"] <= 1 for row in shapes)
    out = capsys.readouterr().out
    assert out.startswith("CPU: ") and out.count("| F2 | ") == len(precisions)
    assert "The shipped shapes pipeline, 2 held-out captions, 2 steps" in out


@pytest.mark.slow
def test_a_short_run_times_the_apps_request_eager_and_frozen(capsys):
    argv = ["--precisions", "fp32", "--num_images", "1", "--num_inference_steps", "2", "--rounds", "1"]
    [row] = load_benchmark("space_sampling").main(argv)
    assert row["precision"] == "fp32" and row["eager"] > 0 and row["frozen"] > 0 and row["compile"] > 0
    assert row["difference"] <= 1  # float32: the same pixels, to the rounding of the fused GEMMs
    out = capsys.readouterr().out
    assert "The Space's request (1 image(s), 2 steps, guidance 2) on the shipped shapes model, median of 1" in out
    assert "CPU: " in out and out.count("\n| fp32 | ") == 1
