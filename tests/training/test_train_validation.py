"""The trainer refuses bad arguments and bad data at start-up, before any feature extraction, naming the problem; the
options build one config, and nothing of an earlier run is lost. The script runs in this process."""

import dataclasses
import logging
import shutil
import types
from pathlib import Path

import huggingface_hub
import pytest
import torch
from diffusers.optimization import SchedulerType

from diffusers_lmlp import FAMILIES, LMLPTransformer2DModel
from diffusers_lmlp.models.catalog import SHAPES_SMALL
from diffusers_lmlp.training import TrainingConfig, arguments, components, trainer
from diffusers_lmlp.training.arguments import PRESETS, build_parser


def tiny_args(workspace: Path, output: Path, *extra: str, data: Path | None = None) -> list[str]:
    return [
        "--pretrained_model_name_or_path", str(workspace / "tiny"), "--train_data_dir", str(data or workspace / "data"),
        "--resolution", "16", "--train_batch_size", "4", "--report_to", "none", "--output_dir", str(output),
        "--cache_dir", str(output / "cache"), "--lr_warmup_steps", "0", "--max_train_steps", "1", *extra
    ]  # fmt: skip


def parser_error(script, argv: list[str], capsys) -> str:
    """The message of the parser error that `argv` must give."""
    with pytest.raises(SystemExit) as error:
        script.parse_args(argv)
    assert error.value.code == 2
    return capsys.readouterr().err


def start_up_error(script, argv: list[str]) -> str:
    """The message that `main(argv)` must stop with."""
    with pytest.raises(SystemExit) as error:
        script.main(argv)
    assert isinstance(error.value.code, str), error.value.code
    return error.value.code


def test_the_options_build_one_frozen_config_whose_defaults_and_presets_are_its_instances(script, tmp_path, capsys):
    config = script.parse_args(["--output_dir", str(tmp_path / "run"), "--max_train_steps", "7"])
    assert isinstance(config, TrainingConfig) and (config.preset, config.world) == ("shapes", "shapes")
    assert config.max_train_steps == 7 and config.train_batch_size == PRESETS["shapes"].train_batch_size == 64
    assert config.model_overrides == {"pooled_text_projection": True} and config.model_type == "lmlp"
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.seed = 1
    assert dataclasses.replace(config, max_train_steps=100).max_train_steps == 100
    # The command's defaults are the dataclass's, field by field; every option has its field and its help.
    parser, defaults = build_parser(), TrainingConfig()
    options = {action.dest for action in parser._actions if action.dest != "help"}
    assert options <= {field.name for field in dataclasses.fields(TrainingConfig)}
    assert {name: parser.get_default(name) for name in options - {"model_overrides"}} == {
        name: getattr(defaults, name) for name in options - {"model_overrides"}
    }
    assert [a.option_strings[0] for a in parser._actions if a.option_strings and not a.help] == []
    assert set(arguments.LR_SCHEDULERS) == {kind.value for kind in SchedulerType}
    with pytest.raises(SystemExit):
        script.parse_args(["--help"])
    text = capsys.readouterr().out
    assert "{linear,cosine,cosine_with_restarts,polynomial,constant,constant_with_warmup,piecewise_constant}" in text
    assert "block families" in text and "no effect on CPU" in " ".join(text.split())  # --allow_tf32


OVERRIDE_KEYS = "the accepted keys of LMLPTransformer2DModel are channel_mlp, conv_out, hidden_size, in_channels"


@pytest.mark.parametrize(
    "argv, message",
    [
        *[([f"{option}={value}"], f"argument {option}: {message}") for option, value, message in [
            ("--resolution", "0", "must be >= 1, got 0"), ("--max_train_samples", "0", "must be >= 1, got 0"),
            ("--lr_warmup_steps", "-1", "must be >= 0, got -1"), ("--num_threads", "0", "must be >= 1, got 0"),
            ("--validation_inference_steps", "0", "must be >= 1, got 0"), ("--logging_steps", "0", "must be >= 1, got 0"),
            ("--shapes_num_images", "0", "must be >= 1, got 0"), ("--lora_rank", "0", "must be >= 1, got 0"),
            *[("--learning_rate", v, f"must be a finite number > 0, got {float(v)}") for v in ("0", "-1e-4", "nan", "inf")],
            *[(option, v, f"must be a finite number >= 0, got {float(v)}")
              for option in ("--symmetry_breaking_weight", "--load_balance_weight") for v in ("-0.1", "nan")],
            ("--dataloader_num_workers", "-1", "must be >= 0 (0 reads")
        ]],
        (["--model_overrides", "no_such_key=3"], f"--model_overrides no_such_key=3: unknown config key 'no_such_key'; {OVERRIDE_KEYS}"),
        (["--model_overrides", "hidden_size"], "--model_overrides takes KEY=VALUE pairs, got 'hidden_size'; the accepted keys of"),
        (["--model_overrides", "num_experts=2"], "unknown config key 'num_experts'"),  # a MoE-MLP key, on an L-MLP
        (["--model_overrides", "hidden_size=abc"], "--model_overrides hidden_size=abc: hidden_size takes int, got 'abc'"),
        (["--model_overrides", "hidden_size=64.5"], "hidden_size takes int, got '64.5'"),
        (["--model_overrides", "conv_out=1"], "conv_out takes bool, got '1'"),
        (["--model_overrides", "out_channels=four"], "out_channels takes int or null, got 'four'"),
        (["--model_type", "uvit", "--model_config", "F2"], "--model_config F2 is a --model_type lmlp configuration"),
        (["--lora_alpha", "8"], "--lora_alpha configure the LoRA adapter of --lora_rank: add --lora_rank"),
        (["--lora_rank", "4", "--lora_dropout", "1"], "argument --lora_dropout: must be a finite number >= 0 and < 1, got 1.0"),
        (["--lora_rank", "4", "--train_data_dir", "x"], "--lora_rank fine-tunes a trained pipeline"),
        (["--lora_rank", "4", "--use_ema"], "--use_ema does not go with --lora_rank"),
        (["--preset", "shapes", "--lora_rank", "4"], "--use_ema does not go with --lora_rank"),
        (["--no-cache_features", "--cache_text_dtype", "float16"], "--cache_text_dtype is how --cache_features"),
        (["--data_layout", "coco2014"], "--data_layout coco2014 reads --train_data_dir: pass the COCO-2014 folder"),
        (["--preset", "coco-f2"], "--preset coco-f2 needs the COCO images: pass --train_data_dir"),
        (["--train_data_dir", ".", "--shapes_num_images", "100"],
         "--shapes_num_images sizes the shapes world, which this run does not train on: leave it out"),
        (["--train_data_dir", ".", "--validation_steps", "2"],
         "--validation_steps 2 samples validation prompts, and your data has none: pass --validation_prompts")
    ]
)  # fmt: skip
def test_a_bad_option_is_refused_by_the_parser_naming_it(script, capsys, argv, message):
    assert message in parser_error(script, ["--output_dir", "x", *argv], capsys)


def test_a_model_override_the_model_refuses_stops_before_any_data(script, tmp_path):
    argv = ["--output_dir", str(tmp_path / "out"), "--cache_dir", str(tmp_path / "cache")]
    message = start_up_error(script, [*argv, "--model_overrides", "hidden_size=0"])
    assert message.startswith("error: --model_config shapes-S with --model_overrides: ") and "hidden_size" in message
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize(
    "argv, model_class, config",
    [
        (["--model_config", "A2"], "MLPMixerTransformer2DModel", {}),
        (["--model_type", "uvit", "--model_overrides", "num_attention_heads=4"], "UViTTransformer2DModel",
         {"num_attention_heads": 4, **SHAPES_SMALL}),  # another family takes the shapes world's skeleton
        ([], "LMLPTransformer2DModel", {"pooled_text_projection": True, **SHAPES_SMALL}),
        (["--model_type", "moe_mlp"], "MoEMLPModel", {"pooled_text_projection": True, **SHAPES_SMALL}),
        (["--model_overrides", "pooled_text_projection=false"], "LMLPTransformer2DModel",
         {"pooled_text_projection": False}),
        (["--model_overrides", "num_layers=4", "hidden_size=64"], "LMLPTransformer2DModel",  # added to the preset's
         {"num_layers": 4, "hidden_size": 64, "pooled_text_projection": True})
    ]
)  # fmt: skip
def test_the_preset_and_the_options_build_the_family_and_config_asked(script, argv, model_class, config):
    model = components.build_model(script.parse_args(["--output_dir", "x", *argv]))
    assert type(model).__name__ == model_class and {key: model.config[key] for key in config} == config
    if "pooled_text_projection" in config:  # the caption's last text state, added to every image token
        projection = model.embed.pooled_text_proj
        assert projection.in_features == 64 if config["pooled_text_projection"] else projection is None


def test_model_overrides_are_typed_by_the_model_class_and_refused_when_fine_tuning(script, workspace, capsys):
    args = script.parse_args(
        ["--output_dir", "x", "--model_type", "moe_mlp", "--model_config", "shapes-moe-S", "--model_overrides",
         "num_experts=2", "mlp_ratio=2", "out_channels=null", "conv_out=false"]
    )  # fmt: skip
    expected = {"num_experts": 2, "mlp_ratio": 2, "out_channels": None, "conv_out": False}
    assert args.model_overrides == {"pooled_text_projection": True, **expected}  # on top of the shapes preset's
    argv = ["--preset", "shapes", "--pretrained_model_name_or_path", str(workspace / "tiny"), "--output_dir", "x"]
    assert script.parse_args(argv).model_overrides == {}  # a saved model keeps its own
    message = parser_error(script, tiny_args(workspace, Path("x"), "--model_overrides", "num_layers=4"), capsys)
    assert "--model_overrides configures a new model; --pretrained_model_name_or_path fine-tunes a saved one" in message  # fmt: skip


@pytest.mark.parametrize(
    "text, problem",
    [
        ('{"hidden_size": 64, "num_layer": 4}', f": unknown config key 'num_layer'; {OVERRIDE_KEYS}"),
        ("{", " is not valid JSON"),
        ("[1, 2]", " must hold a JSON object of config values, got list"),
        ("lmlp", " is a --model_type lmlp config (its _class_name)"),  # a saved config, and --model_type uvit
    ],
)
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
    model = FAMILIES["moe_mlp"].model_class(hidden_size=32, num_layers=2, num_experts=2, num_heads=2, sample_size=8)
    model.save_config(tmp_path)  # with _class_name and _diffusers_version
    args = script.parse_args(["--output_dir", "x", "--model_config", str(tmp_path / "config.json")])
    built = components.build_model(args)
    assert args.model_type == "moe_mlp" and type(built).__name__ == "MoEMLPModel"
    assert built.config.num_experts == 2 and built.config.hidden_size == 32


@pytest.mark.parametrize(
    "offline, token, message",
    [
        (True, ["--hub_token", "hf_x"], "but HF_HUB_OFFLINE=1 forbids any request to the Hub: unset it, or upload later with `python -m diffusers_lmlp.hub push x <user>/<name>`"),
        (False, [], "No Hugging Face token"),
        (False, ["--hub_token", "   "], "The token given with --hub_token is blank: pass the token itself"),
        (False, ["--hub_token", "hf_abc\n"], "The token given with --hub_token has spaces or a line break around it"),
    ],
)  # fmt: skip
def test_push_to_hub_that_cannot_upload_is_refused_at_start_up(script, monkeypatch, capsys, offline, token, message):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", offline)
    monkeypatch.setattr("diffusers_lmlp.hub.upload.get_token", lambda: None)
    error = parser_error(script, ["--output_dir", "x", "--push_to_hub", *token], capsys)
    assert message in error and "hf_abc" not in error


@pytest.mark.parametrize(
    "name, metadata, problem",
    [
        ("metadata.jsonl", '{"file_name": "0.png", "text": "a red circle"}\n{"file_name": "1.png"}\n',
         "line 2 (file_name '1.png'): it has no 'text' field"),
        ("metadata.jsonl", '{"file_name": "0.png", "text": "a red circle"}\n{"file_name": "1.png", "text": []}\n',
         "line 2 (file_name '1.png'): a caption must be a non-empty string or a non-empty list of them, got []"),
        ("metadata.csv", "file_name,text\n0.png,a red circle\n1.png,\n", "line 3 (file_name '1.png'): ")
    ]
)  # fmt: skip
def test_an_imagefolder_row_without_a_usable_caption_is_refused_before_feature_extraction(
    script, workspace, tmp_path, name, metadata, problem
):
    data = tmp_path / "data"
    data.mkdir()
    for i in range(2):
        shutil.copy(workspace / "data" / f"{i}.png", data / f"{i}.png")
    (data / name).write_text(metadata)
    message = start_up_error(script, tiny_args(workspace, tmp_path / "out", "--cache_features", data=data))
    assert f"{data / name} {problem}" in message
    assert not (tmp_path / "out" / "cache").exists()  # no dataset was loaded, no feature extracted


@pytest.mark.parametrize("case", ["base", "subfolder", "clip layout", "missing"])
def test_a_component_folder_without_its_tokenizer_or_at_all_is_named(script, workspace, tmp_path, capsys, case):
    without_tokenizer = tmp_path / "no-tokenizer"
    shutil.copytree(workspace / "tiny", without_tokenizer, ignore=shutil.ignore_patterns("tokenizer"))
    argv = tiny_args(workspace, Path("x"))
    if case == "base":
        argv[argv.index("--pretrained_model_name_or_path") + 1] = str(without_tokenizer)
        expected = f"--pretrained_model_name_or_path {without_tokenizer} has no tokenizer/ folder"
    elif case == "subfolder":
        argv += ["--pretrained_text_encoder", str(without_tokenizer), "--text_encoder_subfolder", "text_encoder"]
        expected = f"--pretrained_text_encoder {without_tokenizer} has no tokenizer/ folder"
    elif case == "clip layout":  # tokenizer and model side by side, and only the model there
        argv += ["--pretrained_text_encoder", str(workspace / "tiny" / "text_encoder")]
        expected = f"the tokenizer folder {workspace / 'tiny' / 'text_encoder'} has no tokenizer.json or vocab.json"
    else:
        argv += ["--pretrained_text_encoder", str(tmp_path / "no" / "such" / "clip")]
        expected = f"--pretrained_text_encoder {tmp_path / 'no' / 'such' / 'clip'}: no such folder"
    message = parser_error(script, argv, capsys)
    assert expected in message and "model_max_length" not in message


def test_a_clip_layout_text_encoder_trains_and_says_it_has_no_validation(
    script, workspace, tmp_path, caplog, monkeypatch
):
    # openai/clip-vit-large-patch14's layout: the tokenizer and the model in one folder, no subfolder.
    clip = tmp_path / "clip"
    shutil.copytree(workspace / "tiny" / "text_encoder", clip)
    shutil.copytree(workspace / "tiny" / "tokenizer", clip, dirs_exist_ok=True)
    # As `accelerate launch` starts its one process: its OMP_NUM_THREADS=1 is not the user's, so the run takes every
    # core (1 here, so as not to slow the suite's other worker).
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "NO")
    monkeypatch.setattr("diffusers_lmlp.threads.available_cores", lambda: 1)
    monkeypatch.setattr("diffusers_lmlp.threads.launcher_environment", lambda: {})
    num_threads = torch.get_num_threads()
    with caplog.at_level(logging.INFO):
        script.main(tiny_args(workspace, tmp_path / "out", "--pretrained_text_encoder", str(clip)))
    torch.set_num_threads(num_threads)
    assert (tmp_path / "out" / "model_index.json").is_file()
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


@pytest.mark.slow
def test_shapes_num_images_sizes_the_shapes_world_only(script, tmp_path):
    from diffusers_lmlp.training import load_training_data

    assert script.parse_args(["--output_dir", "x", "--shapes_num_images", "100"]).shapes_num_images == 100
    common = dict(
        dataset_name=None, dataset_config_name=None, train_data_dir=None, image_column="image", caption_column="text",
        max_train_samples=None, streaming=False, seed=0, cache_dir=str(tmp_path)
    )  # fmt: skip
    sized, default = load_training_data(shapes_num_images=100, **common), load_training_data(**common)
    assert len(sized) == 100 and len(default) == 8000
    assert sized._fingerprint != default._fingerprint  # so the feature store of one is never read for the other
