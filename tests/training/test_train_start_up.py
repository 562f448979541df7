"""What the trainer settles at start-up, before any data is read: the options a user gives are explained and
checked, nothing is chosen silently, and nothing of an earlier run is lost. The trainer runs in this process."""

import logging
import types
from pathlib import Path

import huggingface_hub
import pytest
import torch
from diffusers.optimization import SchedulerType
from test_train_text_to_image import load_script, make_workspace
from test_train_validation import parser_error, tiny_args

from diffusers_lmlp import FAMILIES, LMLPTransformer2DModel
from diffusers_lmlp.training import arguments, components, trainer


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    return make_workspace(tmp_path_factory.mktemp("start-up"))


@pytest.fixture(scope="module")
def script():
    return load_script()


def test_every_option_has_help_and_the_scheduler_lists_diffusers_choices(script, capsys):
    parser = script.build_parser()
    assert [a.option_strings[0] for a in parser._actions if a.option_strings and not a.help] == []
    assert set(arguments.LR_SCHEDULERS) == {kind.value for kind in SchedulerType}
    with pytest.raises(SystemExit):
        script.parse_args(["--help"])
    text = capsys.readouterr().out
    assert "{linear,cosine,cosine_with_restarts,polynomial,constant,constant_with_warmup,piecewise_constant}" in text
    assert "block families" in text and "no effect on CPU" in " ".join(text.split())  # --allow_tf32


@pytest.mark.parametrize(
    "text, problem",
    [
        ('{"hidden_size": 64, "num_layer": 4}', ": unknown config key 'num_layer'; the accepted keys of "
                                                "LMLPTransformer2DModel are channel_mlp"),
        ("{", " is not valid JSON"),
        ("[1, 2]", " must hold a JSON object of config values, got list"),
        ("lmlp", " is a --model_type lmlp config (its _class_name)"),  # a saved config, and --model_type uvit
    ],
)  # fmt: skip
def test_a_model_config_file_that_does_not_fit_is_refused(script, tmp_path, capsys, text, problem):
    config = tmp_path / "config.json"
    if text == "lmlp":
        LMLPTransformer2DModel(hidden_size=32, num_layers=2).save_config(tmp_path)
    else:
        config.write_text(text)
    extra = ["--model_type", "uvit"] if text == "lmlp" else []
    message = parser_error(script, ["--output_dir", "x", "--model_config", str(config), *extra], capsys)
    assert f"--model_config {config}{problem}" in message and "Traceback" not in message


def test_a_saved_backbone_config_builds_its_own_family(script, tmp_path):
    # A backbone's config.json, as save_pretrained writes it (with _class_name and _diffusers_version).
    model = FAMILIES["moe_mlp"].model_class(hidden_size=32, num_layers=2, num_experts=2, num_heads=2, sample_size=8)
    model.save_config(tmp_path)
    args = script.parse_args(["--output_dir", "x", "--model_config", str(tmp_path / "config.json")])
    assert args.model_type == "moe_mlp"
    built = components.build_model(args)
    assert type(built).__name__ == "MoEMLPModel" and built.config.num_experts == 2 and built.config.hidden_size == 32


@pytest.mark.parametrize(
    "offline, token, message",
    [
        (True, ["--hub_token", "hf_x"], "--push_to_hub uploads at the end of training, but HF_HUB_OFFLINE=1 forbids"),
        (True, ["--hub_token", "hf_x"], "python -m diffusers_lmlp.hub push x <user>/<name>"),
        (False, [], "No Hugging Face token"),
        (False, ["--hub_token", "   "], "The token given with --hub_token is blank: pass the token itself"),
        (False, ["--hub_token", "hf_abc\n"], "The token given with --hub_token has spaces or a line break around it"),
    ],
)
def test_push_to_hub_that_cannot_upload_is_refused_at_start_up(script, monkeypatch, capsys, offline, token, message):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", offline)
    monkeypatch.setattr("diffusers_lmlp.hub.upload.get_token", lambda: None)
    error = parser_error(script, ["--output_dir", "x", "--push_to_hub", *token], capsys)
    assert message in error and "hf_abc" not in error


def test_validation_steps_on_data_without_prompts_is_refused(script, workspace, capsys):
    message = parser_error(script, tiny_args(workspace, Path("x"), "--validation_steps", "2"), capsys)
    assert "--validation_steps 2 samples validation prompts, and your data has none: pass --validation_prompts" in (
        message
    )
    script.parse_args(tiny_args(workspace, Path("x"), "--validation_steps", "2", "--validation_prompts", "a dog"))


def test_a_run_without_validation_prompts_says_so(script, workspace, tmp_path, caplog, monkeypatch):
    # As `accelerate launch` starts its one process: its OMP_NUM_THREADS=1 is not the user's, so the run takes every
    # core (1 here, so as not to slow the suite's other worker).
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "NO")
    monkeypatch.setattr("diffusers_lmlp.threads.available_cores", lambda: 1)
    monkeypatch.setattr("diffusers_lmlp.threads.launcher_environment", lambda: {})
    num_threads = torch.get_num_threads()
    with caplog.at_level(logging.INFO):
        script.main(tiny_args(workspace, tmp_path / "out"))
    torch.set_num_threads(num_threads)
    assert "no validation during training and no sample grid at the end" in caplog.text
    assert "training on the CPU: 1 thread(s) (every core; --num_threads N to change)" in caplog.text


@pytest.mark.parametrize("earlier", ["finished", "checkpoints"])
def test_an_output_dir_holding_a_run_is_refused_unless_resumed_or_overwritten(
    script, workspace, tmp_path, capsys, earlier
):
    out = tmp_path / "out"
    argv = tiny_args(workspace, out, "--checkpointing_steps", "1")
    script.main(argv)
    if earlier == "checkpoints":
        (out / "training_summary.json").unlink()
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    message = parser_error(script, argv, capsys)
    held = "a finished run (training_summary.json)" if earlier == "finished" else "the checkpoints of an earlier run"
    assert f"--output_dir {out} already holds {held}" in message
    assert "--resume_from_checkpoint latest" in message and "--overwrite_output_dir" in message
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == before  # nothing was touched
    assert "--overwrite_output_dir trains anew, --resume_from_checkpoint continues a run" in parser_error(
        script, [*argv, "--overwrite_output_dir", "--resume_from_checkpoint", "latest"], capsys
    )
    script.main([*argv, "--overwrite_output_dir"])
    assert (out / "training_summary.json").is_file()


@pytest.mark.parametrize(
    "option, from_preset, device, expected",
    [
        ("fp16", True, "cpu", "float32: the coco-f2 preset's fp16 needs a GPU"),
        ("fp16", True, "cuda", "fp16"),
        ("fp16", False, "cpu", "fp16 mixed precision needs a GPU, and this run is on the CPU"),
        (None, False, "cpu", "fp16 mixed precision needs a GPU"),  # `accelerate launch --mixed_precision fp16`
    ],
)
def test_fp16_on_a_cpu_trains_in_float32_from_the_preset_and_is_refused_when_asked(
    option, from_preset, device, expected
):
    accelerator = types.SimpleNamespace(mixed_precision="fp16", device=torch.device(device))
    args = types.SimpleNamespace(mixed_precision=option, mixed_precision_from_preset=from_preset,
                                 preset="coco-f2" if from_preset else None)  # fmt: skip
    if from_preset:
        assert trainer.effective_precision(accelerator, args).startswith(expected)
    else:
        with pytest.raises(SystemExit, match=expected):
            trainer.effective_precision(accelerator, args)
