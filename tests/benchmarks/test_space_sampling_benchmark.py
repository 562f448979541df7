"""benchmarks/space_sampling.py: a short run times the Space's request eager and frozen."""

import pytest
from benchmark_scripts import load_benchmark


@pytest.mark.slow
def test_a_short_run_times_the_apps_request_eager_and_frozen(capsys):
    argv = ["--precisions", "fp32", "--num_images", "1", "--num_inference_steps", "2", "--rounds", "1"]
    [row] = load_benchmark("space_sampling").main(argv)
    assert row["precision"] == "fp32" and row["eager"] > 0 and row["frozen"] > 0 and row["compile"] > 0
    assert row["difference"] <= 1  # float32: the same pixels, to the rounding of the fused GEMMs
    out = capsys.readouterr().out
    assert "The Space's request (1 image(s), 2 steps, guidance 2) on the shipped shapes model, median of 1" in out
    assert "CPU: " in out and out.count("\n| fp32 | ") == 1
