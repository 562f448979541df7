"""`--allow_tf32`, `--validation_prompts_file`, bf16 COCO runs logged to tensorboard and wandb, the VAE's latent size
against `sample_size`, and diffusers' options this script does not take."""

import io
import json
import struct
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from coco_fixture import CLIP_REPO, CLIP_TEXT_WIDTH, SD_REPO, write_coco2014, write_hub_cache
from diffusers import AutoencoderKL
from PIL import Image
from test_train_text_to_image import ENV, SCRIPT, weights
from test_train_validation import parser_error, start_up_error

from diffusers_lmlp import LMLPPipeline
from diffusers_lmlp.image_grid import make_image_grid
from diffusers_lmlp.training import components, trainer, validation
from diffusers_lmlp.training.arguments import DIFFUSERS_ONLY_OPTIONS, build_parser


PROMPTS_FILE = (
    "# validation prompts for the COCO run\n\nA dog on a street.\n  A woman in a kitchen.  \n# a comment\nA red bus.\n"
)
PROMPTS = ["A dog on a street.", "A woman in a kitchen.", "A red bus."]
# The coco-f2 recipe with a tiny model and batch (the recipe's VAE and CLIP layouts, F2's 32×32 latents at 256 px).
COCO = ["--preset", "coco-f2", "--train_data_dir", "coco2014"]
TINY = [
    "--model_overrides", "hidden_size=32", "num_layers=2", f"text_embed_dim={CLIP_TEXT_WIDTH}",
    "--train_batch_size", "2", "--lr_warmup_steps", "0", "--report_to", "none"
]  # fmt: skip


@pytest.fixture
def tf32_off():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.mark.slow
@pytest.mark.parametrize("flag, expected", [(["--allow_tf32"], True), ([], False)])
def test_allow_tf32_is_applied_before_training_and_only_when_asked(
    script, monkeypatch, tmp_path, tf32_off, flag, expected
):
    seen, cuda, cudnn = [], torch.backends.cuda.matmul, torch.backends.cudnn
    monkeypatch.setattr(trainer, "run_training", lambda *a: seen.append((cuda.allow_tf32, cudnn.allow_tf32, torch.get_float32_matmul_precision())))  # fmt: skip
    script.main(["--output_dir", str(tmp_path / "out"), "--report_to", "none", *flag])
    assert seen == [(expected, expected, "high" if expected else "highest")]


def test_validation_prompts_file_skips_blank_lines_and_comments_and_excludes_prompts(script, tmp_path, capsys):
    path = tmp_path / "prompts.txt"
    path.write_text(PROMPTS_FILE, encoding="utf-8")
    args = script.parse_args(["--output_dir", "x", "--validation_prompts_file", str(path)])
    assert args.validation_prompts == validation.default_validation_prompts(args) == PROMPTS
    argv = ["--validation_prompts", "a cat", "--validation_prompts_file", str(path)]
    message = "argument --validation_prompts_file: not allowed with argument --validation_prompts"
    assert message in parser_error(script, argv, capsys)


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "--validation_prompts_file {path}: no such file"),
        ("\n# only a comment\n   \n", "--validation_prompts_file {path} has no prompts: write one prompt per line"),
        (b"\xff\xfe\x00bad", "--validation_prompts_file {path} is not UTF-8 text"),
        ("folder", "--validation_prompts_file {path} is a folder, not a text file of prompts"),
    ],
)
def test_a_bad_validation_prompts_file_is_refused_at_start_up(script, tmp_path, capsys, content, message):
    path = tmp_path / "prompts.txt"
    if content == "folder":
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content, encoding="utf-8")
    argv = ["--output_dir", "x", "--validation_prompts_file", str(path)]
    assert message.format(path=path) in parser_error(script, argv, capsys)


@pytest.fixture(scope="module")
def coco(tmp_path_factory) -> SimpleNamespace:
    """A COCO-2014 folder of 4 images and the recipe's component repos (folders and a pre-filled HF cache)."""
    root = tmp_path_factory.mktemp("coco")
    write_coco2014(root / "coco2014", num_train=4, num_val=1)
    cache = write_hub_cache(root / "hf")
    env = {**ENV, "HF_HOME": str(root / "hf"), "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    repos = root / "hf" / "repos"
    return SimpleNamespace(root=root, env=env, vae=repos / SD_REPO, text_encoder=repos / CLIP_REPO)


@pytest.fixture(scope="module")
def bf16_run(coco) -> Path:
    """The COCO recipe from the HF cache in bf16: 2 steps, validation at both, logged to tensorboard and wandb."""
    (coco.root / "prompts.txt").write_text(PROMPTS_FILE, encoding="utf-8")
    wandb_dir = coco.root / "wandb-dir"
    wandb_dir.mkdir()
    env = {**coco.env, "WANDB_MODE": "offline", "WANDB_DIR": str(wandb_dir), "WANDB_SILENT": "true"}
    command = [
        sys.executable, str(SCRIPT), *COCO, *TINY, "--mixed_precision", "bf16",
        "--max_train_steps", "2", "--checkpointing_steps", "2", "--output_dir", "bf16",
        "--validation_prompts_file", "prompts.txt", "--validation_steps", "1", "--validation_inference_steps", "2",
        "--report_to", "all"
    ]  # fmt: skip
    result = subprocess.run(command, cwd=coco.root, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-5000:]
    assert "mixed precision bf16" in result.stderr
    return coco.root / "bf16"


@pytest.mark.slow
def test_bf16_run_saves_finite_weights_and_a_pipeline_that_samples(bf16_run):
    for folder in (bf16_run / "checkpoint-2", bf16_run):
        saved = weights(folder)
        assert saved and all(torch.isfinite(t).all() and t.dtype == torch.float32 for t in saved.values()), folder
    pipe = LMLPPipeline.from_pretrained(bf16_run)
    pipe.set_progress_bar_config(disable=True)
    images = pipe(PROMPTS[:2], num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="pt")
    assert images.images.shape == (2, 3, 256, 256)
    assert torch.isfinite(images.images).all() and images.images.std() > 0


def blank_cells(grid: Image.Image, count: int, cell: int = 128, gap: int = 6) -> np.ndarray:
    """The grid's pixels with its image cells painted black, leaving the white space and the captions."""
    pixels = np.array(grid)
    columns = int(np.ceil(np.sqrt(count)))
    step_y = (grid.height + gap) // int(np.ceil(count / columns))  # rows of cell + caption + gap, less the last gap
    for i in range(count):
        x, y = (i % columns) * (cell + gap), (i // columns) * step_y
        pixels[y : y + cell, x : x + cell] = 0
    return pixels


@pytest.mark.slow
def test_validation_grid_png_has_the_file_prompts_as_captions(bf16_run):
    for step in (1, 2):
        grid = Image.open(bf16_run / "validation" / f"step-{step:07d}.png").convert("RGB")
        expected = make_image_grid([Image.new("RGB", (256, 256))] * len(PROMPTS), captions=PROMPTS)
        assert grid.size == expected.size
        np.testing.assert_array_equal(blank_cells(grid, len(PROMPTS)), blank_cells(expected, len(PROMPTS)))
        assert np.array(grid)[:128, :128].std() > 0  # a sample, not a blank cell


@pytest.mark.slow
def test_validation_images_are_logged_to_tensorboard_at_their_steps(bf16_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = bf16_run / "logs" / "lmlp-text-to-image"  # --logging_dir / --tracker_project_name
    events = EventAccumulator(str(run_dir), size_guidance={"images": 0}).Reload()
    images = events.Images("validation")
    assert [event.step for event in images] == [1, 2]
    for event in images:  # the 3 samples side by side, as tensorboard tiles a batch of images (8 per row)
        assert (event.width, event.height) == (3 * 256, 256)
        decoded = Image.open(io.BytesIO(event.encoded_image_string))
        assert decoded.size == (3 * 256, 256) and np.array(decoded).std() > 0
    assert [event.step for event in events.Scalars("loss")] == [1, 2]


def wandb_history(run_dir: Path) -> list[dict]:
    """The history rows of an offline wandb run: a LevelDB-style log of `Record`s (32 KiB blocks of chunks with a
    7-byte header: CRC, length, type FULL=1 / FIRST=2 / MIDDLE=3 / LAST=4)."""
    from wandb.proto import wandb_internal_pb2

    [path] = run_dir.glob("run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, chunks, offset = [], [], 7
    while offset + 7 <= len(data):
        room = 32768 - offset % 32768
        if room < 7:  # a block's tail too short for a header is padding
            offset += room
            continue
        _, length, kind = struct.unpack("<IHB", data[offset : offset + 7])
        chunks.append(data[offset + 7 : offset + 7 + length])
        offset += 7 + length
        if kind in (1, 4):
            records.append(b"".join(chunks))
            chunks = []
    rows = []
    for raw in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            items = record.history.item
            rows.append({"/".join(item.nested_key) or item.key: json.loads(item.value_json) for item in items})
    return rows


@pytest.mark.slow
def test_validation_images_are_logged_to_wandb_with_their_prompts(bf16_run):
    pytest.importorskip("wandb")
    [run_dir] = (bf16_run.parent / "wandb-dir" / "wandb").glob("offline-run-*")
    logged = [row for row in wandb_history(run_dir) if "validation/captions" in row]
    assert [row["_step"] for row in logged] == [1, 2]
    for row in logged:
        assert row["validation/captions"] == PROMPTS and row["validation/count"] == len(PROMPTS)
        assert (row["validation/width"], row["validation/height"]) == (256, 256)
        for name in row["validation/filenames"]:
            assert Image.open(run_dir / "files" / name).size == (256, 256)
    assert [row["_step"] for row in wandb_history(run_dir) if "loss" in row] == [1, 2]


def coco_argv(coco, tmp_path: Path, *extra: str) -> list[str]:
    """The coco-f2 preset on the fixture, tiny, with the component folders given explicitly."""
    return [
        *COCO[:3], str(coco.root / "coco2014"), "--pretrained_vae", str(coco.vae),
        "--pretrained_text_encoder", str(coco.text_encoder), *TINY, "--output_dir", str(tmp_path / "out"),
        "--cache_dir", str(tmp_path / "cache"), "--mixed_precision", "no", *extra
    ]  # fmt: skip


@pytest.mark.parametrize(
    "extra, override, message",
    [(["--resolution", "128"], None, "--resolution 128 does not match the model: sample_size 32 × VAE factor 8 = 256 px"),
     ([], "sample_size=16", "--resolution 256 does not match the model: sample_size 16 × VAE factor 8 = 128 px")],
)  # fmt: skip
def test_a_resolution_the_separate_vae_and_model_config_disagree_on_stops_before_feature_extraction(
    script, coco, tmp_path, extra, override, message
):
    argv = coco_argv(coco, tmp_path, *extra)
    if override:  # one more of the --model_overrides pairs
        argv.insert(argv.index("hidden_size=32"), override)
    error = start_up_error(script, argv)
    assert error.startswith(f"error: {message}")
    assert "pass --resolution" in error and "or --model_overrides sample_size=" in error
    assert not (tmp_path / "cache").exists()  # before any dataset or feature work


def test_a_resolution_the_base_pipeline_does_not_take_stops_before_feature_extraction(script, workspace, tmp_path):
    argv = [
        "--pretrained_model_name_or_path", str(workspace / "tiny"), "--train_data_dir", str(workspace / "data"),
        "--resolution", "32", "--report_to", "none", "--output_dir", str(tmp_path / "out"),
        "--cache_dir", str(tmp_path / "cache"), "--cache_features"
    ]  # fmt: skip
    error = start_up_error(script, argv)
    assert error.startswith("error: --resolution 32 does not match the model: sample_size 8 × VAE factor 2 = 16 px")
    assert error.endswith("pass --resolution 16 (a fine-tuned model keeps its sample_size).")
    assert not (tmp_path / "cache").exists()


def test_a_vae_that_downsamples_other_than_its_config_says_is_refused(script, coco, tmp_path):
    # An SD-layout VAE whose config says ×8 (4 block widths) but whose 2 encoder blocks downsample by 4.
    vae = tmp_path / "vae-repo"
    AutoencoderKL(down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 4,
                  block_out_channels=(8, 16, 16, 16), layers_per_block=1, latent_channels=4,
                  norm_num_groups=8).save_pretrained(vae / "vae")  # fmt: skip
    assert components.vae_latent_size(AutoencoderKL.from_pretrained(coco.vae, subfolder="vae"), 256) == (32, 32)
    assert components.vae_latent_size(AutoencoderKL.from_pretrained(vae, subfolder="vae"), 256) == (64, 64)
    argv = coco_argv(coco, tmp_path)
    argv[argv.index(str(coco.vae))] = str(vae)
    error = start_up_error(script, argv)
    assert error.startswith(
        "error: the VAE encodes 256×256 px images to 64×64 latents, but the model's sample_size is 32"
    )
    assert "its config (block_out_channels of 4 entries) gives a factor of 8, its layers downsample by 4" in error
    assert not (tmp_path / "cache").exists()


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
    lines = [line for line in err.splitlines() if "train_text_to_image.py:" in line]
    assert [line.split(" is an option")[0].split()[-1] for line in lines] == [
        "--center_crop",
        "--enable_xformers_memory_efficient_attention",
    ]
    options = sorted(DIFFUSERS_ONLY_OPTIONS)
    given = [part for i, option in enumerate(options) for part in ([f"{option}=1"] if i % 2 else [option, "1"])]
    err = parser_error(script, ["--output_dir", "x", *given], capsys)
    for option in options:  # joined (--option=1) or not
        assert f"{option} is an option of diffusers' train_text_to_image.py: {DIFFUSERS_ONLY_OPTIONS[option]}\n" in err
    # An option of ours in the table would be refused instead of read.
    assert not {flag for action in build_parser()._actions for flag in action.option_strings} & set(options)
    args = script.parse_args(
        ["--output_dir", "x", "--lr_scheduler", "linear", "--snr_gamma", "5", "--noise_offset", "0.1"]
    )
    assert (args.lr_scheduler, args.snr_gamma, args.noise_offset) == ("linear", 5.0, 0.1)
    err = parser_error(script, ["--output_dir", "x", "--no_such_option"], capsys)
    assert "unrecognized arguments: --no_such_option" in err and "train_text_to_image.py:" not in err
