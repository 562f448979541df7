"""examples/train_text_to_image.py refuses bad arguments and bad data at start-up, before any feature extraction,
with a message that names the problem. The script runs in this process here (its `parse_args` and `main`)."""

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from test_train_text_to_image import load_script, make_workspace

from diffusers_lmlp.models.catalog import SHAPES_SMALL
from diffusers_lmlp.training import TrainingConfig, components
from diffusers_lmlp.training.arguments import PRESETS, build_parser


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    return make_workspace(tmp_path_factory.mktemp("validation"))


@pytest.fixture(scope="module")
def script():
    return load_script()


def tiny_args(workspace: Path, output: Path, *extra: str, data: Path | None = None) -> list[str]:
    return [
        "--pretrained_model_name_or_path", str(workspace / "tiny"), "--train_data_dir", str(data or workspace / "data"),
        "--resolution", "16", "--train_batch_size", "4", "--report_to", "none", "--output_dir", str(output),
        "--cache_dir", str(output / "cache"), "--lr_warmup_steps", "0", "--max_train_steps", "1", *extra,
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


def test_the_options_build_one_frozen_config_whose_defaults_and_presets_are_its_instances(script, tmp_path):
    config = script.parse_args(["--output_dir", str(tmp_path / "run"), "--max_train_steps", "7"])
    assert isinstance(config, TrainingConfig) and (config.preset, config.world) == ("shapes", "shapes")
    assert config.max_train_steps == 7 and config.train_batch_size == PRESETS["shapes"].train_batch_size == 64
    assert config.model_overrides == {"pooled_text_projection": True} and config.model_type == "lmlp"
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.seed = 1
    assert dataclasses.replace(config, max_train_steps=100).max_train_steps == 100
    # The command's defaults are the dataclass's, field by field; every option has its field.
    parser, defaults = build_parser(), TrainingConfig()
    options = {action.dest for action in parser._actions if action.dest != "help"}
    assert options <= {field.name for field in dataclasses.fields(TrainingConfig)}
    assert {name: parser.get_default(name) for name in options - {"model_overrides"}} == {
        name: getattr(defaults, name) for name in options - {"model_overrides"}
    }


@pytest.mark.parametrize(
    "option, value, message",
    [("--resolution", "0", "must be >= 1, got 0"), ("--max_train_samples", "0", "must be >= 1, got 0"),
     ("--lr_warmup_steps", "-1", "must be >= 0, got -1"), ("--validation_inference_steps", "0", "must be >= 1, got 0"),
     ("--num_threads", "0", "must be >= 1, got 0"),
     *[("--learning_rate", v, f"must be a finite number > 0, got {float(v)}") for v in ("0", "-1e-4", "nan", "inf")],
     *[(option, v, f"must be a finite number >= 0, got {float(v)}")
       for option in ("--symmetry_breaking_weight", "--load_balance_weight") for v in ("-0.1", "nan")]],
)  # fmt: skip
def test_a_value_outside_its_range_is_refused_naming_the_option(script, capsys, option, value, message):
    assert f"argument {option}: {message}" in parser_error(script, ["--output_dir", "x", f"{option}={value}"], capsys)


@pytest.mark.parametrize(
    "override, message",
    [
        ("no_such_key=3", "--model_overrides no_such_key=3: unknown config key 'no_such_key'; the accepted keys of "
                          "LMLPTransformer2DModel are channel_mlp, conv_out, hidden_size, in_channels, lateral_activation"),
        ("hidden_size", "--model_overrides takes KEY=VALUE pairs, got 'hidden_size'; the accepted keys of"),
        ("num_experts=2", "unknown config key 'num_experts'"),  # a MoE-MLP key, and the model is an L-MLP
        ("hidden_size=abc", "--model_overrides hidden_size=abc: hidden_size takes int, got 'abc'"),
        ("hidden_size=64.5", "hidden_size takes int, got '64.5'"),
        ("conv_out=1", "conv_out takes bool, got '1'"),
        ("out_channels=four", "out_channels takes int or null, got 'four'"),
    ],
)  # fmt: skip
def test_a_model_override_of_an_unknown_key_or_the_wrong_type_is_refused(script, capsys, override, message):
    assert message in parser_error(script, ["--output_dir", "x", "--model_overrides", override], capsys)


def test_a_model_override_the_model_refuses_stops_before_any_data(script, tmp_path):
    message = start_up_error(
        script, ["--output_dir", str(tmp_path / "out"), "--cache_dir", str(tmp_path / "cache"), "--model_overrides",
                 "hidden_size=0"]
    )  # fmt: skip
    assert message.startswith("error: --model_config shapes-S with --model_overrides: ") and "hidden_size" in message
    assert not (tmp_path / "cache").exists()


def test_a_named_config_picks_its_family_and_refuses_another(script, capsys):
    args = script.parse_args(["--output_dir", "x", "--model_config", "A2"])
    assert (args.model_type, args.model_config) == ("mlp_mixer", "A2")
    assert type(components.build_model(args)).__name__ == "MLPMixerTransformer2DModel"
    message = parser_error(script, ["--output_dir", "x", "--model_type", "uvit", "--model_config", "F2"], capsys)
    assert "--model_config F2 is a --model_type lmlp configuration" in message


def test_another_family_on_the_shapes_preset_takes_the_shapes_skeleton(script):
    args = script.parse_args(
        ["--output_dir", "x", "--model_type", "uvit", "--model_overrides", "num_attention_heads=4"]
    )
    model = components.build_model(args)
    assert type(model).__name__ == "UViTTransformer2DModel"
    assert {key: model.config[key] for key in SHAPES_SMALL} == SHAPES_SMALL  # fits the shapes world's components
    assert model.config.num_attention_heads == 4


@pytest.mark.parametrize("model_type", ["lmlp", "moe_mlp"])
def test_the_shapes_preset_adds_the_pooled_text_projection_and_one_override_removes_it(script, model_type):
    """The preset adds the caption's last text state to every image token; one override turns it off."""
    args = script.parse_args(["--output_dir", "x", "--model_type", model_type])
    model = components.build_model(args)
    assert model.config.pooled_text_projection and model.embed.pooled_text_proj.in_features == 64  # the text width
    assert {key: model.config[key] for key in SHAPES_SMALL} == SHAPES_SMALL
    args = script.parse_args(
        ["--output_dir", "x", "--model_type", model_type, "--model_overrides", "pooled_text_projection=false"]
    )
    model = components.build_model(args)
    assert not model.config.pooled_text_projection and model.embed.pooled_text_proj is None


def test_overrides_given_are_added_to_the_presets_and_a_saved_model_keeps_its_own(script, workspace):
    # Naming another key must not drop the preset's own model options.
    args = script.parse_args(["--output_dir", "x", "--model_overrides", "num_layers=4", "hidden_size=64"])
    assert args.model_overrides == {"pooled_text_projection": True, "num_layers": 4, "hidden_size": 64}
    model = components.build_model(args)
    assert (model.config.num_layers, model.config.hidden_size, model.config.pooled_text_projection) == (4, 64, True)
    argv = ["--preset", "shapes", "--pretrained_model_name_or_path", str(workspace / "tiny"), "--output_dir", "x"]
    assert script.parse_args(argv).model_overrides == {}


def test_well_formed_model_overrides_are_typed_by_the_model_class(script):
    args = script.parse_args(
        ["--output_dir", "x", "--model_type", "moe_mlp", "--model_config", "shapes-moe-S", "--model_overrides",
         "num_experts=2", "mlp_ratio=2", "out_channels=null", "conv_out=false"]
    )  # fmt: skip
    assert args.model_overrides == {
        "pooled_text_projection": True,  # the shapes preset's
        "num_experts": 2,
        "mlp_ratio": 2,
        "out_channels": None,
        "conv_out": False,
    }


def test_model_overrides_are_refused_when_fine_tuning(script, workspace, capsys):
    message = parser_error(script, tiny_args(workspace, Path("x"), "--model_overrides", "num_layers=4"), capsys)
    assert (
        "--model_overrides configures a new model; --pretrained_model_name_or_path fine-tunes a saved one" in message
    )


def write_metadata(workspace: Path, folder: Path, rows: list[dict]) -> Path:
    """An imagefolder with the workspace's first images and these metadata rows."""
    folder.mkdir()
    for row in rows:
        shutil.copy(workspace / "data" / row["file_name"], folder / row["file_name"])
    with open(folder / "metadata.jsonl", "w") as f:
        f.write("".join(json.dumps(row) + "\n" for row in rows))
    return folder


@pytest.mark.parametrize(
    "bad_row, problem",
    [
        ({"file_name": "2.png"}, "it has no 'text' field"),
        ({"file_name": "2.png", "text": ""}, "a caption must be a non-empty string or a non-empty list of them"),
        ({"file_name": "2.png", "text": []}, "got []"),
        ({"file_name": "2.png", "text": 3}, "got 3"),
        ({"file_name": "2.png", "text": None}, "got None"),
    ],
)
def test_an_imagefolder_row_without_a_usable_caption_is_refused_before_feature_extraction(
    script, workspace, tmp_path, bad_row, problem
):
    rows = [{"file_name": "0.png", "text": "a red circle"}, {"file_name": "1.png", "text": "a blue square"}, bad_row]
    data = write_metadata(workspace, tmp_path / "data", rows)
    message = start_up_error(script, tiny_args(workspace, tmp_path / "out", "--cache_features", data=data))
    assert f"{data / 'metadata.jsonl'} line 3 (file_name '2.png'): " in message and problem in message
    assert not (tmp_path / "out" / "cache").exists()  # no dataset was loaded, no feature extracted


def test_a_csv_imagefolder_row_without_a_caption_is_refused(script, workspace, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for i in range(2):
        shutil.copy(workspace / "data" / f"{i}.png", data / f"{i}.png")
    (data / "metadata.csv").write_text("file_name,text\n0.png,a red circle\n1.png,\n")
    message = start_up_error(script, tiny_args(workspace, tmp_path / "out", data=data))
    assert f"{data / 'metadata.csv'} line 3 (file_name '1.png'): " in message


@pytest.fixture
def without_tokenizer(workspace, tmp_path) -> Path:
    """The tiny pipeline without its tokenizer/ folder."""
    base = tmp_path / "no-tokenizer"
    shutil.copytree(workspace / "tiny", base)
    shutil.rmtree(base / "tokenizer")
    return base


@pytest.mark.parametrize("case", ["base", "subfolder", "clip layout", "missing"])
def test_a_component_folder_without_its_tokenizer_or_at_all_is_named(
    script, workspace, without_tokenizer, tmp_path, capsys, case
):
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


def test_a_clip_layout_text_encoder_folder_trains(script, workspace, tmp_path):
    # openai/clip-vit-large-patch14's layout, saved locally: the tokenizer and the model in one folder, no subfolder.
    clip = tmp_path / "clip"
    shutil.copytree(workspace / "tiny" / "text_encoder", clip)
    shutil.copytree(workspace / "tiny" / "tokenizer", clip, dirs_exist_ok=True)
    script.main(tiny_args(workspace, tmp_path / "out", "--pretrained_text_encoder", str(clip)))
    assert (tmp_path / "out" / "model_index.json").is_file()


@pytest.mark.slow
def test_shapes_num_images_sizes_the_shapes_world_only(tmp_path, capsys):
    from diffusers_lmlp.training import load_training_data

    script = load_script()
    out = ["--output_dir", str(tmp_path / "out")]
    assert "argument --shapes_num_images: must be >= 1, got 0" in parser_error(
        script, [*out, "--shapes_num_images", "0"], capsys
    )
    with_data = [*out, "--train_data_dir", str(tmp_path), "--shapes_num_images", "100"]
    assert (
        "--shapes_num_images sizes the shapes world, which this run does not train on: leave it out"
        in parser_error(script, with_data, capsys)
    )
    assert script.parse_args([*out, "--shapes_num_images", "100"]).shapes_num_images == 100
    common = dict(
        dataset_name=None, dataset_config_name=None, train_data_dir=None, image_column="image", caption_column="text",
        max_train_samples=None, streaming=False, seed=0, cache_dir=str(tmp_path),
    )  # fmt: skip
    sized = load_training_data(shapes_num_images=100, **common)
    default = load_training_data(**common)
    assert len(sized) == 100 and len(default) == 8000
    assert sized._fingerprint != default._fingerprint  # so the feature store of one is never read for the other
