"""Every benchmark script takes the commands the docs write for it, and refuses bad arguments naming the fix."""

import functools

import pytest
from benchmark_scripts import assert_refused, check_the_commands_parse, documented_commands, load_benchmark


script = functools.cache(load_benchmark)
COUNTS = {"quantized_sampling": "--batch_size --repeats --num_captions", "space_sampling": "--rounds --num_images"}


# How many commands the docs give each script (gpu_check's --device defaults to cuda).
DOCUMENTED = {"ablation_shapes": 1, "gpu_check": 2, "profile_passes": 3, "roofline": 2, "scorer_agreement": 1,
              "space_sampling": 2, "speed_vs_uvit": 5, "trainer_overhead": 1}  # fmt: skip


@pytest.mark.parametrize("name, count", DOCUMENTED.items())
def test_every_documented_command_is_one_the_script_takes(name, count, capsys):
    commands = documented_commands(name)
    assert len(commands) == count, commands
    check_the_commands_parse(script(name).parse_args, commands, capsys, cuda_by_default=name == "gpu_check")


@pytest.mark.parametrize(
    "name, argv, message",
    [
        ("ablation_shapes", ["--models", "lmlp", "nope"], "--models nope: not a block family (lmlp, "),
        ("ablation_shapes", ["--models", "lmlp", "--", "--max_train_steps=5"], "after -- is set by the ablation"),
        ("learning_curves", ["a", "b", "--labels", "one"], "--labels names 1 runs, but 2 are given"),
        ("profile_passes", ["--models", "F3"], "unknown named configs ['F3']"),
        ("profile_passes", ["--steps", "0"], "argument --steps: must be >= 1"),
        ("profile_passes", ["--mode", "frozen"], "--mode frozen compiles for inference only: add --passes sampling"),
        ("roofline", ["--models", "F9"], "unknown named configs ['F9']"),
        ("scorer_agreement", ["--guidance_scale", "nan"], "--guidance_scale must be a finite number, not nan"),
        ("scorer_agreement", ["--guidance_scale", "inf"], "--guidance_scale must be a finite number, not inf"),
        ("quantized_sampling", ["--models", "F3"], "unknown model(s) ['F3']"),
        *[
            (name, [o, "0"], f"argument {o}: must be >= 1, got 0")
            for name, options in COUNTS.items()
            for o in [*options.split(), "--num_inference_steps"]
        ],
        ("speed_vs_uvit", ["--models", "F3"], "unknown named configs ['F3']"),
        ("speed_vs_uvit", ["--batch_size", "0"], "argument --batch_size: must be >= 1"),
        ("trainer_overhead", ["--max_train_steps", "100", "--skip", "100"], "leaves no timed window"),
    ],
)
def test_bad_arguments_are_refused_naming_the_fix(name, argv, message, capsys):
    assert_refused(script(name).parse_args, argv, message, capsys)


def test_the_scripts_arguments_read_as_documented():
    assert script("profile_passes").parse_args(["--mode", "frozen", "--passes", "sampling"]).mode == "frozen"
    # The baseline is always measured, then the reference, first, once.
    assert script("quantized_sampling").parse_args(["--models", "F2-deep"]).models == ["U-ViT-S/2", "F2-deep"]
    speed = script("speed_vs_uvit")
    models = speed.parse_args(["--models", "4E2H", "F2-deep", speed.BASELINE]).models
    assert models == [speed.BASELINE, "F2-deep", "4E2H"]
    args, rest = script("trainer_overhead").parse_args(["--every", "25", "--train_batch_size", "32"])
    assert args.every == 25 and rest == ["--train_batch_size", "32"]  # the trainer's own options pass through
