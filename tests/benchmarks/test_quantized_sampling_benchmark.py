"""benchmarks/quantized_sampling.py: a short run of fp32, bf16 (where native) and int8 in one window."""

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
    for row in backbones:
        assert row["ms"] > 0
        if row["model"] == "U-ViT-S/2":
            assert row["vs_baseline"] == 1
        if row["precision"] == "fp32":
            assert row["vs_fp32"] == 1 and row["error"] == 0
        else:  # rounding, not a layer left out or garbage
            assert 0 < row["error"] < 0.1, row
    assert [row["precision"] for row in shapes] == ["fp32", "int8"]
    assert all(row["seconds"] > 0 and 0 <= row["scores"]["all"] <= 1 for row in shapes)
    out = capsys.readouterr().out
    assert out.startswith("CPU: ") and out.count("| F2 | ") == len(precisions)
    assert "The shipped shapes pipeline, 2 held-out captions, 2 steps" in out
