"""benchmarks/space_sampling.py: its documented commands parse; a short run times the Space's request eager and frozen."""

import pytest
from benchmark_scripts import check_the_commands_parse, documented_commands, load_benchmark


@pytest.fixture(scope="module")
def benchmark():
    return load_benchmark("space_sampling")


def test_the_documented_commands_parse(benchmark, capsys):
    commands = documented_commands("space_sampling")
    assert len(commands) == 2
    check_the_commands_parse(benchmark.parse_args, commands, capsys)


@pytest.mark.parametrize("option", ["--rounds", "--num_images", "--num_inference_steps"])
def test_a_count_below_one_is_refused_naming_the_option(benchmark, option, capsys):
    with pytest.raises(SystemExit):
        benchmark.parse_args([option, "0"])
    assert f"argument {option}: must be >= 1, got 0" in capsys.readouterr().err


@pytest.mark.slow
def test_a_short_run_times_the_apps_request_eager_and_frozen(benchmark, capsys):
    argv = ["--precisions", "fp32", "--num_images", "1", "--num_inference_steps", "2", "--rounds", "1"]
    [row] = benchmark.main(argv)
    assert row["precision"] == "fp32" and row["eager"] > 0 and row["frozen"] > 0 and row["compile"] > 0
    assert row["difference"] <= 1  # float32: the same pixels, to the rounding of the fused GEMMs
    out = capsys.readouterr().out
    assert "The Space's request (1 image(s), 2 steps, guidance 2) on the shipped shapes model, median of 1" in out
    assert "CPU: " in out and out.count("\n| fp32 | ") == 1
