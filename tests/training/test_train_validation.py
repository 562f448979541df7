"""Bad options, data and files are refused at start-up, naming the problem; the options build one config; bf16 COCO."""

import contextlib
import dataclasses
import io
import json
import logging
import shutil
import struct
import subprocess
import sys
import types
from pathlib import Path

import huggingface_hub
import numpy as np
import pytest
import torch
from diffusers import AutoencoderKL
from diffusers.optimization import SchedulerType
from PIL import Image
from test_feature_store import load
from test_train_coco import TINY
from test_train_text_to_image import SCRIPT, start_up_error, train_args, weights

from diffusers_lmlp import FAMILIES, LMLPPipeline
from diffusers_lmlp.image_grid import make_image_grid
from diffusers_lmlp.models.catalog import SHAPES_SMALL
from diffusers_lmlp.training import TrainingConfig, arguments, components, trainer
from diffusers_lmlp.training.arguments import DIFFUSERS_ONLY_OPTIONS, PRESETS, build_parser, parse_args


def tiny_args(workspace: Path, output: Path, *extra: str, data: Path | None = None) -> list[str]:
    return [*train_args(workspace, output, data=data), "--cache_dir", str(output / "cache"), "--max_train_steps", "1",
            *extra]  # fmt: skip


def parser_error(script, argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as error:
        script.parse_args(argv)
    assert error.value.code == 2
    return capsys.readouterr().err


def test_the_options_build_one_frozen_config_whose_defaults_and_presets_are_its_instances(script, tmp_path, capsys):
    config = script.parse_args(["--output_dir", str(tmp_path / "run"), "--max_train_steps", "7"])
    assert isinstance(config, TrainingConfig) and (config.preset, config.world) == ("shapes", "shapes")
    assert config.max_train_steps == 7 and config.train_batch_size == PRESETS["shapes"].train_batch_size == 64
    # The world presets log every 10 steps, compile where it pays and choose the precision; what is given wins.
    assert (config.logging_steps, config.torch_compile, config.mixed_precision) == (10, "auto", "auto")
    assert parse_args(["--output_dir", "x", "--lora_rank", "4"]).logging_steps == 10  # shapes-lora
    given = parse_args("--output_dir x --logging_steps 1 --torch_compile no --mixed_precision no".split())
    assert (given.logging_steps, given.torch_compile, given.mixed_precision) == (1, "no", "no")
    # Other runs (your data, COCO) log every step, as diffusers' does, and keep accelerate launch's --dynamo_backend.
    parser, defaults = build_parser(), TrainingConfig()
    assert parser.get_default("logging_steps") == PRESETS["coco-f2"].logging_steps == 1
    assert parser.parse_args([]).torch_compile is None and PRESETS["emoji"].torch_compile == "auto"
    assert all(PRESETS[name].torch_compile is None for name in PRESETS if name not in ("shapes", "emoji"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.seed = 1
    assert dataclasses.replace(config, max_train_steps=100).max_train_steps == 100
    # The command's defaults are the dataclass's, field by field; every option has its field and its help.
    options = {action.dest for action in parser._actions} - {"help"}
    assert options <= {field.name for field in dataclasses.fields(TrainingConfig)}
    shared = options - {"model_overrides"}
    assert {name: parser.get_default(name) for name in shared} == {name: getattr(defaults, name) for name in shared}
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
        *[(f"{option}=0", f"argument {option}: must be >= 1, got 0") for option in (
            "--resolution", "--max_train_samples", "--num_threads", "--validation_inference_steps", "--logging_steps",
            "--shapes_num_images", "--lora_rank")],
        *[(f"{option}=-1", f"{option}: must be >= 0") for option in ("--lr_warmup_steps", "--dataloader_num_workers")],
        *[(f"--learning_rate={v}", f"--learning_rate: must be a finite number > 0, got {float(v)}")
          for v in ("0", "-1e-4", "nan", "inf")],
        *[(f"{option}={v}", f"argument {option}: must be a finite number >= 0, got {float(v)}")
          for option in ("--symmetry_breaking_weight", "--load_balance_weight") for v in ("-0.1", "nan")],
        ("--model_overrides no_such_key=3", f"no_such_key=3: unknown config key 'no_such_key'; {OVERRIDE_KEYS}"),
        ("--model_overrides hidden_size", "--model_overrides takes KEY=VALUE pairs, got 'hidden_size'; the accepted"),
        ("--model_overrides num_experts=2", "unknown config key 'num_experts'"),  # a MoE-MLP key, on an L-MLP
        ("--model_overrides hidden_size=abc", "--model_overrides hidden_size=abc: hidden_size takes int, got 'abc'"),
        ("--model_overrides hidden_size=64.5", "hidden_size takes int, got '64.5'"),
        ("--model_overrides conv_out=1", "conv_out takes bool, got '1'"),
        ("--model_overrides out_channels=four", "out_channels takes int or null, got 'four'"),
        ("--model_type uvit --model_config F2", "--model_config F2 is a --model_type lmlp configuration"),
        ("--lora_alpha 8", "--lora_alpha configure the LoRA adapter of --lora_rank: add --lora_rank"),
        ("--lora_rank 4 --lora_dropout 1", "argument --lora_dropout: must be a finite number >= 0 and < 1, got 1.0"),
        ("--lora_rank 4 --train_data_dir x", "--lora_rank fine-tunes a trained pipeline"),
        ("--lora_rank 4 --use_ema", "--use_ema does not go with --lora_rank"),
        ("--preset shapes --lora_rank 4", "--use_ema does not go with --lora_rank"),
        ("--no-cache_features --cache_text_dtype float16", "--cache_text_dtype is how --cache_features"),
        ("--data_layout coco2014", "--data_layout coco2014 reads --train_data_dir: pass the COCO-2014 folder"),
        ("--preset coco-f2", "--preset coco-f2 needs the COCO images: pass --train_data_dir"),
        ("--train_data_dir . --shapes_num_images 100", "sizes the shapes world, which this run does not train on"),
        ("--train_data_dir . --validation_steps 2", "and your data has none: pass --validation_prompts"),
    ]
)  # fmt: skip
def test_a_bad_option_is_refused_by_the_parser_naming_it(script, capsys, argv, message):
    assert message in parser_error(script, ["--output_dir", "x", *argv.split()], capsys)


@pytest.mark.parametrize(
    "argv, model_class, config",
    [
        ("--model_config A2", "MLPMixerTransformer2DModel", {}),
        ("--model_type uvit --model_overrides num_attention_heads=4", "UViTTransformer2DModel",
         {"num_attention_heads": 4, **SHAPES_SMALL}),  # another family takes the shapes world's skeleton
        ("", "LMLPTransformer2DModel", {"pooled_text_projection": True, **SHAPES_SMALL}),
        ("--model_type moe_mlp", "MoEMLPModel", {"pooled_text_projection": True, **SHAPES_SMALL}),
        ("--model_overrides pooled_text_projection=false", "LMLPTransformer2DModel",
         {"pooled_text_projection": False}),
        ("--model_overrides num_layers=4 hidden_size=64", "LMLPTransformer2DModel",  # added to the preset's
         {"num_layers": 4, "hidden_size": 64, "pooled_text_projection": True})
    ]
)  # fmt: skip
def test_the_preset_and_the_options_build_the_family_and_config_asked(script, argv, model_class, config):
    a = script.parse_args(["--output_dir", "x", *argv.split()])
    model = components.build_model(a.model_type, a.model_config, a.model_overrides, values=a.model_skeleton)
    assert type(model).__name__ == model_class and {key: model.config[key] for key in config} == config
    if "pooled_text_projection" in config:  # the caption's last text state, added to every image token
        projection = model.embed.pooled_text_proj
        assert projection.in_features == 64 if config["pooled_text_projection"] else projection is None


def test_model_overrides_are_typed_by_the_model_class_and_refused_when_fine_tuning(script, workspace, capsys):
    argv = "--model_type moe_mlp --model_config shapes-moe-S --model_overrides num_experts=2 mlp_ratio=2 "
    args = script.parse_args(["--output_dir", "x", *argv.split(), "out_channels=null", "conv_out=false"])
    expected = {"num_experts": 2, "mlp_ratio": 2, "out_channels": None, "conv_out": False}
    assert args.model_overrides == {"pooled_text_projection": True, **expected}  # on top of the shapes preset's
    argv = ["--preset", "shapes", "--pretrained_model_name_or_path", str(workspace / "tiny"), "--output_dir", "x"]
    assert script.parse_args(argv).model_overrides == {}  # a saved model keeps its own
    message = parser_error(script, tiny_args(workspace, Path("x"), "--model_overrides", "num_layers=4"), capsys)
    assert "--model_overrides configures a new model; --pretrained_model_name_or_path fine-tunes a saved" in message


@pytest.mark.parametrize(
    "text, problem",
    [
        ('{"hidden_size": 64, "num_layer": 4}', f": unknown config key 'num_layer'; {OVERRIDE_KEYS}"),
        ("{", " is not valid JSON"),
        ("[1, 2]", " must hold a JSON object of config values, got list"),
    ],
)
def test_a_model_config_file_that_does_not_fit_is_refused(script, tmp_path, capsys, text, problem):
    (config := tmp_path / "config.json").write_text(text)
    message = parser_error(script, ["--output_dir", "x", "--model_config", str(config)], capsys)
    assert f"--model_config {config}{problem}" in message and "Traceback" not in message


def test_a_saved_backbone_config_builds_its_own_family_and_no_other(script, tmp_path, capsys):
    model = FAMILIES["moe_mlp"].model_class(hidden_size=32, num_layers=2, num_experts=2, num_heads=2, sample_size=8)
    model.save_config(tmp_path)  # with _class_name and _diffusers_version
    argv = ["--output_dir", "x", "--model_config", str(config := tmp_path / "config.json")]
    args = script.parse_args(argv)
    built = components.build_model(args.model_type, args.model_config, values=args.model_config_values)
    assert args.model_type == "moe_mlp" and type(built).__name__ == "MoEMLPModel"
    assert built.config.num_experts == 2 and built.config.hidden_size == 32
    message = parser_error(script, [*argv, "--model_type", "uvit"], capsys)
    assert f"--model_config {config} is a --model_type moe_mlp config (its _class_name)" in message


@pytest.mark.parametrize(
    "offline, token, message",
    [
        (True, ["--hub_token", "hf_x"], "but HF_HUB_OFFLINE=1 forbids any request to the Hub: unset it, or upload "
                                        "later with `python -m diffusers_lmlp.hub push x <user>/<name>`"),
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
    "name, rows, problem",
    [
        (None, None, "error: --model_config shapes-S with --model_overrides: hidden_size=0 cannot build"),
        ("metadata.jsonl", '{"file_name": "0.png", "text": "a red circle"}\n{"file_name": "1.png"}\n',
         "line 2 (file_name '1.png'): it has no 'text' field"),  # test_feature_store.py has the other problems
    ]
)  # fmt: skip
def test_a_model_or_caption_that_cannot_train_stops_before_data(script, workspace, tmp_path, name, rows, problem):
    out = tmp_path / "out"
    if name is None:  # the shapes preset
        argv = ["--output_dir", str(out), "--cache_dir", str(out / "cache"), "--model_overrides", "hidden_size=0"]
    else:  # an imagefolder of two images
        (data := tmp_path / "data").mkdir()
        for i in range(2):
            shutil.copy(workspace / "data" / f"{i}.png", data / f"{i}.png")
        (data / name).write_text(rows)
        argv, problem = tiny_args(workspace, out, "--cache_features", data=data), f"{data / name} {problem}"
    assert problem in start_up_error(script, argv)
    assert not (out / "cache").exists()  # no dataset was loaded, no feature extracted


@pytest.mark.parametrize(
    "extra, expected",
    [("--pretrained_model_name_or_path {bare}", "--pretrained_model_name_or_path {bare} has no tokenizer/ folder"),
     ("--pretrained_text_encoder {bare} --text_encoder_subfolder text_encoder",
      "--pretrained_text_encoder {bare} has no tokenizer/ folder"),
     ("--pretrained_text_encoder {tiny}/text_encoder",  # tokenizer and model side by side, and only the model there
      "the tokenizer folder {tiny}/text_encoder has no tokenizer.json or vocab.json"),
     ("--pretrained_text_encoder {bare}/no/such/clip", "--pretrained_text_encoder {bare}/no/such/clip: no such")],
    ids=["base", "subfolder", "clip layout", "missing"],
)  # fmt: skip
def test_a_text_encoder_without_its_tokenizer_or_folder_is_named(script, workspace, tmp_path, capsys, extra, expected):
    folders = {"bare": tmp_path / "no-tokenizer", "tiny": workspace / "tiny"}
    shutil.copytree(workspace / "tiny", folders["bare"], ignore=shutil.ignore_patterns("tokenizer"))
    message = parser_error(script, tiny_args(workspace, Path("x"), *extra.format(**folders).split()), capsys)
    assert expected.format(**folders) in message and "model_max_length" not in message


def test_a_clip_layout_encoder_trains_and_its_run_is_kept(script, workspace, tmp_path, caplog, capsys, monkeypatch):
    # openai/clip-vit-large-patch14's layout: the tokenizer and the model in one folder, no subfolder.
    clip = shutil.copytree(workspace / "tiny" / "text_encoder", tmp_path / "clip")
    shutil.copytree(workspace / "tiny" / "tokenizer", clip, dirs_exist_ok=True)
    # As `accelerate launch` starts its one process: its OMP_NUM_THREADS=1 is not the user's; the run takes every core.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "NO")
    monkeypatch.setattr("diffusers_lmlp.threads.available_cores", lambda: 1)
    monkeypatch.setattr("diffusers_lmlp.threads.launcher_environment", lambda: {})
    num_threads, out = torch.get_num_threads(), tmp_path / "out"
    argv = tiny_args(workspace, out, "--pretrained_text_encoder", str(clip), "--checkpointing_steps", "1")
    with caplog.at_level(logging.INFO):
        script.main(argv)
    torch.set_num_threads(num_threads)
    assert (out / "model_index.json").is_file()
    assert "no validation during training and no sample grid at the end" in caplog.text
    assert "training on the CPU: 1 thread(s) (every core; --num_threads N to change)" in caplog.text
    for held in ("a finished run (training_summary.json)", "the checkpoints of an earlier run"):
        before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
        message = parser_error(script, argv, capsys)
        assert f"--output_dir {out} already holds {held}" in message
        assert "--resume_from_checkpoint latest" in message and "--overwrite_output_dir" in message
        assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == before  # nothing was touched
        (out / "training_summary.json").unlink(missing_ok=True)  # then only the checkpoints are left
    both = parser_error(script, [*argv, "--overwrite_output_dir", "--resume_from_checkpoint", "latest"], capsys)
    assert "--overwrite_output_dir trains anew, --resume_from_checkpoint continues a run" in both


@pytest.mark.parametrize(
    "option, from_preset, device, expected",
    [("fp16", True, "cpu", "float32: the coco-f2 preset's fp16 needs a GPU"), ("fp16", True, "cuda", "fp16"),
     ("fp16", False, "cpu", "fp16 mixed precision needs a GPU, and this run is on the CPU"),
     (None, False, "cpu", "fp16 mixed precision needs a GPU")],  # `accelerate launch --mixed_precision fp16`
)  # fmt: skip
def test_fp16_on_a_cpu_trains_in_float32_from_a_preset_and_is_refused_if_asked(option, from_preset, device, expected):
    accelerator = types.SimpleNamespace(mixed_precision="fp16", device=torch.device(device))
    with contextlib.nullcontext() if from_preset else pytest.raises(SystemExit, match=expected):
        assert trainer.effective_precision(accelerator, option, from_preset and "coco-f2").startswith(expected)


@pytest.mark.slow
def test_shapes_num_images_sizes_the_shapes_world_only(script, tmp_path):
    assert script.parse_args(["--output_dir", "x", "--shapes_num_images", "100"]).shapes_num_images == 100
    sized, default = load(None, tmp_path, shapes_num_images=100), load(None, tmp_path)  # the shapes world
    assert len(sized) == 100 and len(default) == 8000
    assert sized._fingerprint != default._fingerprint  # so the feature store of one is never read for the other


PROMPTS_FILE = "# validation prompts\n\nA dog on a street.\n  A woman in a kitchen.  \n# a comment\nA red bus.\n"
PROMPTS = ["A dog on a street.", "A woman in a kitchen.", "A red bus."]
COCO = ["--preset", "coco-f2", "--train_data_dir", "coco2014"]  # with TINY's model: F2's 32×32 latents at 256 px


@pytest.mark.slow
@pytest.mark.parametrize("flag, expected", [(["--allow_tf32"], True), ([], False)])
def test_allow_tf32_is_applied_before_training_and_only_when_asked(script, monkeypatch, tmp_path, flag, expected):
    seen, cuda, cudnn = [], torch.backends.cuda.matmul, torch.backends.cudnn
    saved, cuda.allow_tf32, cudnn.allow_tf32 = (cuda.allow_tf32, cudnn.allow_tf32), False, False
    flags = lambda: (cuda.allow_tf32, cudnn.allow_tf32, torch.get_float32_matmul_precision())  # noqa: E731
    monkeypatch.setattr(trainer, "run_training", lambda *a: seen.append(flags()))
    try:
        script.main(["--output_dir", str(tmp_path / "out"), "--report_to", "none", *flag])
    finally:
        cuda.allow_tf32, cudnn.allow_tf32 = saved
    assert seen == [(expected, expected, "high" if expected else "highest")]


def test_validation_prompts_file_skips_blank_lines_and_comments_and_excludes_prompts(script, tmp_path, capsys):
    (path := tmp_path / "prompts.txt").write_text(PROMPTS_FILE, encoding="utf-8")
    args = script.parse_args(["--output_dir", "x", "--validation_prompts_file", str(path)])
    assert args.validation_prompts == PROMPTS
    error = parser_error(script, ["--validation_prompts", "a cat", "--validation_prompts_file", str(path)], capsys)
    assert "--validation_prompts_file: not allowed with argument --validation_prompts" in error


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "--validation_prompts_file {path}: no such file"),
        (b"\n# only a comment\n   \n", "--validation_prompts_file {path} has no prompts: write one prompt per line"),
        (b"\xff\xfe\x00bad", "--validation_prompts_file {path} is not UTF-8 text"),
        ("folder", "--validation_prompts_file {path} is a folder, not a text file of prompts"),
    ],
)
def test_a_bad_validation_prompts_file_is_refused_at_start_up(script, tmp_path, capsys, content, message):
    path = tmp_path / "prompts.txt"
    if content == "folder":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    argv = ["--output_dir", "x", "--validation_prompts_file", str(path)]
    assert message.format(path=path) in parser_error(script, argv, capsys)


@pytest.fixture(scope="module")
def bf16_run(coco_world) -> Path:
    """The COCO recipe from the HF cache in bf16: 2 steps, validation at both, logged to tensorboard and wandb."""
    (coco_world.root / "prompts.txt").write_text(PROMPTS_FILE, encoding="utf-8")
    (wandb_dir := coco_world.root / "wandb-dir").mkdir()
    env = {**coco_world.env, "WANDB_MODE": "offline", "WANDB_DIR": str(wandb_dir), "WANDB_SILENT": "true"}
    command = [sys.executable, str(SCRIPT), *COCO, *TINY, "--mixed_precision", "bf16", "--max_train_steps", "2",
               "--checkpointing_steps", "2", "--output_dir", "bf16", "--validation_prompts_file", "prompts.txt",
               "--validation_steps", "1", "--validation_inference_steps", "2", "--report_to", "all"]  # fmt: skip
    result = subprocess.run(command, cwd=coco_world.root, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "mixed precision bf16" in result.stderr, result.stderr[-5000:]
    return coco_world.root / "bf16"


@pytest.mark.slow
def test_bf16_run_saves_finite_weights_and_a_pipeline_that_samples(bf16_run):
    for folder in (bf16_run / "checkpoint-2", bf16_run):
        saved = weights(folder)
        assert saved and all(torch.isfinite(t).all() and t.dtype == torch.float32 for t in saved.values()), folder
    pipe = LMLPPipeline.from_pretrained(bf16_run)
    pipe.set_progress_bar_config(disable=True)
    images = pipe(PROMPTS[:2], num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="pt")
    assert images.images.shape == (2, 3, 256, 256) and torch.isfinite(images.images).all() and images.images.std() > 0


@pytest.mark.slow
def test_validation_grid_png_has_the_file_prompts_as_captions(bf16_run):
    cells = [Image.new("RGB", (256, 256), colour) for colour in ("black", "white")]
    black, white = (np.array(make_image_grid([cell] * len(PROMPTS), captions=PROMPTS)) for cell in cells)
    samples = (black != white).any(-1, keepdims=True)  # where the grid's images go, on its white ground
    for step in (1, 2):
        grid = np.array(Image.open(bf16_run / "validation" / f"step-{step:07d}.png").convert("RGB"))
        np.testing.assert_array_equal(np.where(samples, 0, grid), black)  # the same ground and captions
        assert grid[samples[..., 0]].std() > 0  # samples, not blank cells


def wandb_history(run_dir: Path) -> list[dict]:
    """An offline wandb run's history: 32 KiB blocks of `Record` chunks, with CRC, length, type (FULL=1, LAST=4)"""
    from wandb.proto import wandb_internal_pb2

    [data] = [path.read_bytes() for path in run_dir.glob("run-*.wandb")]
    assert data[:4] == b":W&B"
    rows, chunks, offset = [], [], 7
    while offset + 7 <= len(data):
        if (room := 32768 - offset % 32768) < 7:  # a block's tail too short for a header is padding
            offset += room
            continue
        _, length, kind = struct.unpack("<IHB", data[offset : offset + 7])
        chunks.append(data[offset + 7 : offset + 7 + length])
        offset += 7 + length
        if kind in (1, 4):
            (record := wandb_internal_pb2.Record()).ParseFromString(b"".join(chunks))
            chunks = []
            if record.WhichOneof("record_type") == "history":
                rows.append({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item})
    return rows


@pytest.mark.slow
def test_validation_images_and_the_loss_reach_tensorboard_and_wandb_at_their_steps(bf16_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = bf16_run / "logs" / "lmlp-text-to-image"  # --logging_dir / --tracker_project_name
    events = EventAccumulator(str(run_dir), size_guidance={"images": 0}).Reload()
    assert [event.step for event in events.Images("validation")] == [1, 2]
    for event in events.Images("validation"):  # the 3 samples side by side, as tensorboard tiles a batch of images
        decoded = Image.open(io.BytesIO(event.encoded_image_string))
        assert decoded.size == (3 * 256, 256) and np.array(decoded).std() > 0
    assert [event.step for event in events.Scalars("loss")] == [1, 2]
    [run_dir] = (bf16_run.parent / "wandb-dir" / "wandb").glob("offline-run-*")
    history = wandb_history(run_dir)
    logged = [row for row in history if "validation/captions" in row]
    assert [row["_step"] for row in logged] == [1, 2] and [row["_step"] for row in history if "loss" in row] == [1, 2]
    for row in logged:  # with their prompts
        assert row["validation/captions"] == PROMPTS and row["validation/width"] == row["validation/height"] == 256
        assert all(Image.open(run_dir / "files" / name).size == (256, 256) for name in row["validation/filenames"])


@pytest.mark.parametrize(
    "change, message, fix",
    [(["sample_size=16"], "--resolution 256 does not match the model: sample_size 16 × VAE factor 8 = 128 px",
      "pass --resolution 128, or --model_overrides sample_size="),
     ("vae", "the VAE encodes 256×256 px images to 64×64 latents, but the model's sample_size is 32",
      "its config (block_out_channels of 4 entries) gives a factor of 8, its layers downsample by 4")],
    ids=["sample-size", "vae-layers"],
)  # fmt: skip
def test_a_resolution_the_vae_and_model_disagree_on_is_refused(script, coco_world, tmp_path, change, message, fix):
    vae = tmp_path / "vae-repo" if change == "vae" else coco_world.vae
    argv = [
        *COCO[:3], str(coco_world.root / "coco2014"), "--pretrained_vae", str(vae), "--pretrained_text_encoder",
        str(coco_world.text_encoder), *TINY, "--output_dir", str(tmp_path / "out"), "--mixed_precision", "no",
        "--cache_dir", str(tmp_path / "cache")
    ]  # fmt: skip
    if change == "vae":  # an SD-layout VAE whose config says ×8 (4 block widths), but whose 2 blocks downsample by 4
        AutoencoderKL(down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 4,
                      block_out_channels=(8, 16, 16, 16), layers_per_block=1, latent_channels=4,
                      norm_num_groups=8).save_pretrained(vae / "vae")  # fmt: skip
    else:  # one more of the --model_overrides pairs
        argv.insert(argv.index("hidden_size=32"), change[0])
    error = start_up_error(script, argv)
    assert error.startswith(f"error: {message}") and fix in error
    assert not (tmp_path / "cache").exists()  # before any dataset or feature work


# The command of diffusers' text-to-image README (examples/text_to_image), pointed at a local folder.
DIFFUSERS_README_COMMAND = [
    "--pretrained_model_name_or_path=CompVis/stable-diffusion-v1-4", "--train_data_dir=data", "--use_ema",
    "--resolution=512", "--center_crop", "--random_flip", "--train_batch_size=1", "--gradient_accumulation_steps=4",
    "--gradient_checkpointing", "--max_train_steps=15000", "--learning_rate=1e-05", "--max_grad_norm=1",
    "--enable_xformers_memory_efficient_attention", "--lr_scheduler=constant", "--lr_warmup_steps=0",
    "--output_dir=sd-naruto-model"
]  # fmt: skip


def test_each_diffusers_only_option_says_what_to_give_instead_and_no_option_of_ours_is_one(script, capsys):
    err = parser_error(script, DIFFUSERS_README_COMMAND, capsys)
    named = [line.split(" is an option")[0].split()[-1] for line in err.splitlines() if "text_to_image.py:" in line]
    assert named == ["--center_crop", "--enable_xformers_memory_efficient_attention"]
    options = sorted(DIFFUSERS_ONLY_OPTIONS)
    given = [part for i, option in enumerate(options) for part in ([f"{option}=1"] if i % 2 else [option, "1"])]
    err = parser_error(script, ["--output_dir", "x", *given], capsys)
    for option in options:  # joined (--option=1) or not
        assert f"{option} is an option of diffusers' train_text_to_image.py: {DIFFUSERS_ONLY_OPTIONS[option]}\n" in err
    # An option of ours in the table would be refused instead of read.
    assert not {flag for action in build_parser()._actions for flag in action.option_strings} & set(options)
    err = parser_error(script, ["--output_dir", "x", "--no_such_option"], capsys)
    assert "unrecognized arguments: --no_such_option" in err and "train_text_to_image.py:" not in err
