"""`--allow_tf32`, `--validation_prompts_file`, a bf16 COCO run's trackers, the VAE against `sample_size`, and
diffusers' options."""

import io
import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKL
from PIL import Image
from test_train_coco import TINY
from test_train_text_to_image import SCRIPT, weights
from test_train_validation import parser_error, start_up_error

from diffusers_lmlp import LMLPPipeline
from diffusers_lmlp.image_grid import make_image_grid
from diffusers_lmlp.training import trainer, validation
from diffusers_lmlp.training.arguments import DIFFUSERS_ONLY_OPTIONS, build_parser


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
    assert args.validation_prompts == validation.default_validation_prompts(args) == PROMPTS
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
    """The history rows of an offline wandb run: a LevelDB-style log of `Record`s (32 KiB blocks of chunks with a
    7-byte header: CRC, length, type FULL=1 / FIRST=2 / MIDDLE=3 / LAST=4)."""
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
    [(["--resolution", "128"], "--resolution 128 does not match the model: sample_size 32 × VAE factor 8 = 256 px",
      "pass --resolution 256, or --model_overrides sample_size="),
     (["sample_size=16"], "--resolution 256 does not match the model: sample_size 16 × VAE factor 8 = 128 px",
      "pass --resolution 128, or --model_overrides sample_size="),
     ("vae", "the VAE encodes 256×256 px images to 64×64 latents, but the model's sample_size is 32",
      "its config (block_out_channels of 4 entries) gives a factor of 8, its layers downsample by 4")],
    ids=["resolution", "sample-size", "vae-layers"],
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
    elif change[0] == "--resolution":
        argv += change
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
