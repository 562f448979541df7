"""Train an L-MLP or MoE-MLP text-to-image backbone with 🤗 accelerate, from a laptop CPU to many GPUs.

    # the embedded default, the shapes world; then the L-MLP paper's COCO run
    accelerate launch -m diffusers_lmlp.train
    accelerate launch -m diffusers_lmlp.train --preset coco-f2 ...
    # the same: `diffusers-lmlp-train` (one process), or examples/train_text_to_image.py in a checkout

With `--lora_rank` it fine-tunes LoRA adapters of a saved pipeline's backbone instead of the backbone itself.

With no dataset argument it trains a small UL-MLP on the procedural shapes world with the offline tokenizer,
text encoder and VAE that ship with the package, then scores its samples. Arguments and behaviour follow diffusers'
examples/text_to_image/train_text_to_image.py; the recipe defaults are the papers' COCO recipe (ε-prediction MSE,
AdamW 2e-4 / wd 0.03 / betas (0.9, 0.9), linear warm-up then constant, EMA, caption dropout 0.1).

Every random choice (data order, caption pick, caption dropout, noise, timesteps) is a function of (seed, step,
sample position), so a resumed run continues exactly as the uninterrupted one, and N accumulation steps of b
samples see the same samples and noise as one step of N·b.
"""

import argparse
import atexit
import contextlib
import faulthandler
import functools
import hashlib
import inspect
import itertools
import json
import logging
import math
import os
import sys
import time
import typing
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import ProjectConfiguration, set_seed
from diffusers import AutoencoderKL, DDPMScheduler
from diffusers.optimization import get_scheduler
from diffusers.training_utils import EMAModel, compute_snr
from huggingface_hub.utils import HFValidationError, validate_repo_id
from PIL import Image
from transformers import CLIPTextModel, CLIPTokenizer
from transformers.utils import logging as transformers_logging

from diffusers_lmlp import FAMILIES, LMLPPipeline, default_scheduler, load_balancing_loss, symmetry_breaking_penalty
from diffusers_lmlp.evaluation import draw_captions, evaluate, read_captions_file
from diffusers_lmlp.hub import write_model_card
from diffusers_lmlp.hub.lora_card import write_lora_card
from diffusers_lmlp.image_grid import make_image_grid
from diffusers_lmlp.models import family_of, named_configs
from diffusers_lmlp.shapes.pretrained import PIPELINE_PATH as SHAPES_PIPELINE_PATH
from diffusers_lmlp.training import (
    CHECKPOINT_PATTERN,
    DATA_LAYOUTS,
    TEXT_DTYPES,
    FeatureStore,
    captions_of,
    checkpoint_step,
    encode_text,
    exclusive_output_dir,
    feature_store_key,
    format_run_summary,
    is_terminal,
    list_checkpoints,
    load_training_data,
    open_feature_store,
    preprocess_image,
    progress_bar,
    register_checkpoint_hooks,
    save_checkpoint,
    saved_train_seconds,
    warn_about_later_checkpoints,
)
from diffusers_lmlp.training.lora import add_lora, lora_config, save_adapter


logger = get_logger(__name__)

MODEL_TYPES = {name: family.model_class for name, family in FAMILIES.items()}
# A finished multi-process run's teardown that takes longer has hung: its Python stacks are dumped and it exits (1).
TEARDOWN_TIMEOUT_SECONDS = 120
# The config fields that fit a backbone to its frozen components and data (latent and text shapes) and set its size:
# a preset's named configuration lends them to a --model_type of another family.
SKELETON_FIELDS = (
    "sample_size",
    "patch_size",
    "in_channels",
    "hidden_size",
    "num_layers",
    "text_embed_dim",
    "text_seq_len",
)
# A CLIP tokenizer folder holds one of these (vocab.json with merges.txt, or the fast tokenizer's tokenizer.json).
TOKENIZER_FILES = ("tokenizer.json", "vocab.json")
# The papers' frozen components, used when training on real data without a base pipeline.
COCO_VAE = ("CompVis/stable-diffusion-v1-4", "vae")  # the SD-v1 KL-f8 VAE
COCO_TEXT_ENCODER = "openai/clip-vit-large-patch14"
# Arguments that never leave this process: kept out of trackers, logs, the model card and training_summary.json.
SECRET_ARGUMENTS = frozenset({"hub_token"})

# Images per caption (each from its own noise seed) in the final shapes evaluation: the intervals resample captions,
# so more seeds of the 32 held-out combinations narrow them.
FINAL_EVALUATION_SEEDS = {"train": 3, "held-out": 4}
# `--preset NAME` sets these defaults; explicit arguments still win.
PRESETS = {
    # The embedded default: the procedural shapes world with the package's offline components, ≤ 10 min on 2 CPUs.
    "shapes": dict(
        model_config="shapes-S",
        resolution=32,
        train_batch_size=64,
        max_train_steps=3900,
        learning_rate=3e-3,
        adam_beta2=0.99,
        adam_weight_decay=0.0,
        lr_warmup_steps=100,
        use_ema=True,
        # A short average: the model still improves fast at the end, and a longer one (0.995) lags behind it.
        ema_decay=0.99,
        cache_features=True,
        checkpointing_steps=975,
        checkpoints_total_limit=2,
        validation_steps=975,
        # The pipeline's defaults (the papers' 50 steps and s = 1), with which the final scores are measured too.
        validation_inference_steps=50,
        validation_guidance_scale=2.0,
        output_dir="lmlp-shapes",
    ),
    # The L-MLP paper's MS-COCO run (reference configs/lmlp_f2.py + the U-ViT COCO recipe): F2-deep, SD VAE, CLIP L/14,
    # batch 256 (32 per GPU on 8 GPUs; on one GPU add --gradient_accumulation_steps 8), 1M steps.
    "coco-f2": dict(
        model_config="F2-deep",
        pretrained_vae=COCO_VAE[0],
        vae_subfolder=COCO_VAE[1],
        pretrained_text_encoder=COCO_TEXT_ENCODER,
        data_layout="coco2014",
        latent_scale=0.23010,
        resolution=256,
        train_batch_size=32,
        max_train_steps=1_000_000,
        learning_rate=2e-4,
        lr_warmup_steps=5000,
        use_ema=True,
        ema_decay=0.9999,
        cache_features=True,
        mixed_precision="fp16",
        checkpointing_steps=10_000,
        validation_steps=5000,
        output_dir="lmlp-coco-f2",
    ),
    # LoRA: teach the shapes model that ships in the package the 32 colour × shape × position combinations held out
    # of its training (a new attribute set), a few minutes on 2 CPUs; the final evaluation scores it before and after.
    "shapes-lora": dict(
        pretrained_model_name_or_path=str(SHAPES_PIPELINE_PATH),
        shapes_split="heldout",
        lora_rank=8,
        resolution=32,
        train_batch_size=64,
        max_train_steps=400,
        learning_rate=1e-3,
        adam_beta2=0.99,
        adam_weight_decay=0.0,
        lr_warmup_steps=20,
        cache_features=True,
        checkpointing_steps=200,
        checkpoints_total_limit=1,
        validation_steps=200,
        validation_inference_steps=50,
        validation_guidance_scale=2.0,
        output_dir="lmlp-shapes-lora",
    ),
}
# The presets that train on the procedural shapes world (when no data is given) and score the result on it.
SHAPES_WORLD_PRESETS = ("shapes", "shapes-lora")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help="recipe defaults (default without data: shapes, or shapes-lora with --lora_rank)",
    )

    model = parser.add_argument_group("model")
    model.add_argument(
        "--model_type",
        choices=sorted(MODEL_TYPES),
        help="the block family (default: --model_config's, else lmlp; or the base pipeline's)",
    )
    model.add_argument(
        "--model_config",
        help=f"a named configuration ({', '.join(named_configs())}) or a JSON file of config values "
        "(default: the family's defaults, the papers' COCO model)",
    )
    model.add_argument("--model_overrides", nargs="*", default=[], metavar="KEY=VALUE", help="e.g. num_layers=12")
    model.add_argument("--pretrained_model_name_or_path", help="a saved LMLPPipeline to fine-tune")
    model.add_argument("--revision")
    model.add_argument("--variant")

    lora = parser.add_argument_group("LoRA (fine-tune adapters of --pretrained_model_name_or_path's backbone)")
    lora.add_argument(
        "--lora_rank", type=int,
        help="train a LoRA adapter of this rank instead of the whole backbone; the output is "
        "pytorch_lora_weights.safetensors (LMLPPipeline.load_lora_weights) and a card",
    )  # fmt: skip
    lora.add_argument(
        "--lora_alpha", type=float, help="LoRA alpha: the update is scaled by alpha / rank (default: rank)"
    )
    lora.add_argument("--lora_dropout", type=float, default=0.0, help="dropout on the adapter's input")
    lora.add_argument(
        "--lora_target_modules", nargs="+", metavar="NAME",
        help="the layers to adapt, by name or name suffix (e.g. left right merge); default: every nn.Linear of every "
        "block, token mixers included (and SymMixer's tied weights)",
    )  # fmt: skip

    components = parser.add_argument_group("frozen components")
    components.add_argument(
        "--pretrained_vae", help=f"Hub id or folder of an AutoencoderKL (default: {COCO_VAE[0]}, or the shapes VAE)"
    )
    components.add_argument("--vae_subfolder")
    components.add_argument(
        "--pretrained_text_encoder",
        help=f"Hub id or folder of CLIP tokenizer + text model (default: {COCO_TEXT_ENCODER})",
    )
    components.add_argument("--text_encoder_subfolder", help="subfolder of the text model (tokenizer: 'tokenizer')")
    components.add_argument("--latent_scale", type=float, help="latent scaling factor (default: the VAE config's)")

    data = parser.add_argument_group("data")
    data.add_argument("--dataset_name", help="a datasets Hub id or a local dataset script/folder")
    data.add_argument("--dataset_config_name")
    data.add_argument("--streaming", action="store_true")
    data.add_argument(
        "--train_data_dir",
        help="a local folder: an imagefolder with metadata.jsonl, or the COCO-2014 folder with --data_layout coco2014",
    )
    data.add_argument(
        "--data_layout", choices=DATA_LAYOUTS, default="imagefolder",
        help="how --train_data_dir is laid out: imagefolder (images + metadata.jsonl/.csv), or coco2014 (the "
        "official COCO-2014 folder: annotations/captions_train2014.json and train2014/*.jpg; one sample per image, "
        "one of its captions picked at random at each use; the coco-f2 preset's default)",
    )  # fmt: skip
    data.add_argument(
        "--shapes_split", choices=("train", "heldout"), default="train",
        help="without data, the shapes world's combinations to train on: train (292 of them), or heldout (the 32 held "
        "out of the shipped model's training: the shapes-lora preset's new attribute set)",
    )  # fmt: skip
    data.add_argument("--image_column", default="image")
    data.add_argument("--caption_column", default="text")
    data.add_argument("--max_train_samples", type=int)
    data.add_argument("--resolution", type=int, default=256)
    data.add_argument("--random_flip", action="store_true")
    data.add_argument("--caption_dropout", type=float, default=0.1, help='probability of training on "" instead')
    data.add_argument(
        "--cache_features", action=argparse.BooleanOptionalAction, default=False,
        help="encode VAE moments and text states once, into an on-disk feature store under --cache_dir, read lazily "
        "(the shapes and coco-f2 default; --no-cache_features encodes every step)",
    )  # fmt: skip
    data.add_argument(
        "--cache_text_dtype", choices=sorted(TEXT_DTYPES),
        help="how the feature store keeps the text states (default: float32); float16 halves the store's size, the "
        "VAE moments stay float32",
    )  # fmt: skip
    data.add_argument(
        "--cache_dir",
        help="where datasets and the feature store are kept (default: <output_dir>/../.lmlp-cache); on several "
        "machines, a folder that all of them see",
    )  # fmt: skip
    data.add_argument(
        "--dataloader_num_workers", type=int, default=0,
        help="worker processes that read the feature store (or decode and crop the images) ahead of the training "
        "steps, and decode the images of the feature extraction; 0 reads in the training process. The batches are "
        "the same with any number",
    )  # fmt: skip

    train = parser.add_argument_group("optimisation")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--train_batch_size", type=int, default=16, help="per device, per accumulation step")
    train.add_argument("--max_train_steps", type=int, default=10_000)
    train.add_argument("--gradient_accumulation_steps", type=int, default=1)
    train.add_argument("--gradient_checkpointing", action="store_true")
    train.add_argument("--learning_rate", type=float, default=2e-4)
    train.add_argument("--adam_beta1", type=float, default=0.9)
    train.add_argument("--adam_beta2", type=float, default=0.9)
    train.add_argument("--adam_weight_decay", type=float, default=0.03)
    train.add_argument("--adam_epsilon", type=float, default=1e-8)
    train.add_argument("--max_grad_norm", type=float, help="clip gradients to this norm (off by default)")
    train.add_argument("--lr_scheduler", default="constant_with_warmup")
    train.add_argument("--lr_warmup_steps", type=int, default=5000)
    train.add_argument("--snr_gamma", type=float, help="Min-SNR loss weighting (5.0 is the usual value)")
    train.add_argument("--noise_offset", type=float, default=0.0)
    train.add_argument("--load_balance_weight", type=float, default=0.0, help="MoE-MLP balancing loss (paper: 0.01)")
    train.add_argument(
        "--symmetry_breaking_weight",
        type=float,
        default=0.0,
        help="AsymMixer's penalty λ·Σ‖W̃‖²_F (the ParaMixer paper sweeps 1e-6 to 1)",
    )
    train.add_argument("--use_ema", action=argparse.BooleanOptionalAction, default=False)
    train.add_argument("--ema_decay", type=float, default=0.9999)
    train.add_argument(
        "--mixed_precision", choices=["no", "fp16", "bf16"],
        help="autocast the backbone's forward (default: accelerate's config); bf16 runs on Ampere or newer GPUs and on "
        "CPU, fp16 on GPUs only (on CPU accelerate trains in float32)",
    )  # fmt: skip
    train.add_argument(
        "--allow_tf32", action="store_true",
        help="let float32 matmuls and convolutions use TF32 on Ampere and newer NVIDIA GPUs (faster, 10-bit "
        "mantissa); no effect on CPU",
    )  # fmt: skip

    out = parser.add_argument_group("output, logging, validation")
    out.add_argument("--output_dir", default="lmlp-model")
    out.add_argument("--logging_dir", default="logs")
    out.add_argument("--report_to", default="tensorboard", help='"tensorboard", "wandb", "all" or "none"')
    out.add_argument("--tracker_project_name", default="lmlp-text-to-image")
    prompts = out.add_mutually_exclusive_group()
    prompts.add_argument(
        "--validation_prompts", nargs="*",
        help="prompts sampled every --validation_steps and at the end (default: shapes captions on the shapes world)",
    )  # fmt: skip
    prompts.add_argument(
        "--validation_prompts_file", metavar="PATH",
        help="a UTF-8 text file of validation prompts, one per line; blank lines and lines starting with # are skipped",
    )  # fmt: skip
    out.add_argument("--validation_steps", type=int, default=1000)
    out.add_argument("--validation_inference_steps", type=int, default=25)
    out.add_argument("--validation_guidance_scale", type=float, default=2.0)
    out.add_argument(
        "--final_evaluation_inference_steps",
        type=int,
        default=50,
        help="sampler steps of the shapes world's final evaluation (default: the pipeline's 50; fewer for smoke runs)",
    )
    out.add_argument(
        "--validation_fid_images", type=int, default=0,
        help="at every validation, sample this many images and log their FID (0: off); the shapes world uses the "
        "shapes feature network, other data the Inception network (needs torch-fidelity)",
    )  # fmt: skip
    out.add_argument(
        "--validation_fid_captions", metavar="SOURCE",
        help="the captions FID samples, as `python -m diffusers_lmlp.evaluation --captions` takes them: a COCO-2014 "
        "folder, a captions .json or a text file (default on the shapes world: shapes:train)",
    )  # fmt: skip
    out.add_argument(
        "--validation_fid_reference", metavar="PATH",
        help="what that FID compares with: an .npz of mu/sigma (e.g. fid_stats_mscoco256_val.npz) or a folder of real "
        "images (default on the shapes world: renders of the same captions)",
    )  # fmt: skip
    out.add_argument("--checkpointing_steps", type=int, default=1000)
    out.add_argument(
        "--checkpoints_total_limit", type=int,
        help="keep the newest N checkpoints (the oldest is removed once the new one is complete: N + 1 for a moment)",
    )  # fmt: skip
    out.add_argument(
        "--resume_from_checkpoint",
        help='"latest" or a checkpoint folder; an older one abandons the later checkpoints, overwritten as reached',
    )
    out.add_argument("--push_to_hub", action="store_true")
    out.add_argument("--hub_model_id")
    out.add_argument("--hub_token", help="used for the upload only: never logged, tracked or written to the output")

    # Presets change defaults only: read the preset first, then parse everything with its defaults in place.
    known, _ = parser.parse_known_args(argv)
    uses_data = any(a.split("=")[0] in ("--dataset_name", "--train_data_dir") for a in (argv or sys.argv[1:]))
    preset = known.preset or (None if uses_data else ("shapes-lora" if known.lora_rank else "shapes"))
    if preset:
        parser.set_defaults(**PRESETS[preset])
    args = parser.parse_args(argv)
    args.preset = preset
    args.shapes_world = preset in SHAPES_WORLD_PRESETS and not uses_data
    args.model_config_from_preset = bool(preset) and not any(
        a.split("=")[0] == "--model_config" for a in (argv if argv is not None else sys.argv[1:])
    )
    validate_args(parser, args)
    return args


def validate_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fail at start-up, with a message that says what to change, rather than after minutes of set-up."""
    if args.dataset_name and args.train_data_dir:
        parser.error("pass either --dataset_name or --train_data_dir, not both")
    validate_lora_args(parser, args)
    if args.preset == "coco-f2" and not (args.dataset_name or args.train_data_dir):
        parser.error(
            "--preset coco-f2 needs the COCO images: pass --train_data_dir with the COCO-2014 folder (annotations/ "
            "and train2014/), or --data_layout imagefolder --train_data_dir, or --dataset_name"
        )
    if args.data_layout == "coco2014" and not (args.train_data_dir or args.dataset_name):
        parser.error("--data_layout coco2014 reads --train_data_dir: pass the COCO-2014 folder there")
    if args.streaming and not args.dataset_name:
        parser.error("--streaming applies to --dataset_name")
    if args.streaming and args.cache_features:
        parser.error("--cache_features needs a map-style dataset: drop --streaming or --cache_features")
    if args.random_flip and args.cache_features:
        parser.error("--random_flip cannot be combined with --cache_features (cached latents are of unflipped images)")
    if args.cache_text_dtype and not args.cache_features:
        parser.error("--cache_text_dtype is how --cache_features stores text states: add --cache_features or drop it")
    for name in ("load_balance_weight", "symmetry_breaking_weight"):
        if not (math.isfinite(getattr(args, name)) and getattr(args, name) >= 0):
            parser.error(f"--{name} must be a finite number >= 0 (0: off), got {getattr(args, name)}")
    if args.dataloader_num_workers < 0:
        parser.error(
            f"--dataloader_num_workers must be >= 0 (0 reads the data in the training process), got "
            f"{args.dataloader_num_workers}"
        )
    if args.resume_from_checkpoint and args.resume_from_checkpoint != "latest":
        if not Path(args.resume_from_checkpoint).is_dir():
            parser.error(f"--resume_from_checkpoint {args.resume_from_checkpoint}: no such checkpoint folder")
        if not CHECKPOINT_PATTERN.match(Path(args.resume_from_checkpoint).name):
            parser.error(f"--resume_from_checkpoint {args.resume_from_checkpoint}: not a checkpoint-<step> folder")
    for name in (
        "train_batch_size",
        "max_train_steps",
        "gradient_accumulation_steps",
        "checkpointing_steps",
        "final_evaluation_inference_steps",
    ):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.checkpoints_total_limit is not None and args.checkpoints_total_limit < 1:
        parser.error(
            f"--checkpoints_total_limit must be >= 1 (or left out to keep all), got {args.checkpoints_total_limit}"
        )
    if not (math.isfinite(args.learning_rate) and args.learning_rate > 0):
        parser.error(f"--learning_rate must be a positive number, got {args.learning_rate}")
    if not 0.0 <= args.caption_dropout < 1.0:
        parser.error(f"--caption_dropout must be in [0, 1), got {args.caption_dropout}")
    if args.validation_fid_images < 0:
        parser.error(
            f"--validation_fid_images must be >= 0 (0: no FID during training), got {args.validation_fid_images}"
        )
    if args.validation_fid_images and not args.shapes_world:
        missing = [
            f"--{name}" for name in ("validation_fid_captions", "validation_fid_reference") if not getattr(args, name)
        ]
        if missing:
            parser.error(
                f"--validation_fid_images on your data needs {' and '.join(missing)}: the captions to sample (e.g. the "
                "COCO-2014 folder, whose val2014 captions are drawn) and the real images' statistics (e.g. "
                "fid_stats_mscoco256_val.npz)"
            )
    if args.validation_fid_captions:
        try:
            draw_captions(args.validation_fid_captions, 1)
        except ValueError as error:
            parser.error(str(error).replace("--captions", "--validation_fid_captions"))
    if args.validation_fid_reference and not Path(args.validation_fid_reference).exists():
        parser.error(f"--validation_fid_reference {args.validation_fid_reference}: no such file or folder")
    if args.validation_prompts_file:
        try:
            args.validation_prompts = read_captions_file(args.validation_prompts_file, "--validation_prompts_file")
        except ValueError as error:
            parser.error(str(error))
    try:
        check_component_sources(args)
    except ValueError as error:
        parser.error(str(error))
    if args.push_to_hub:  # checked now, not after hours of training
        from diffusers_lmlp.hub.upload import check_repo_id, require_token

        try:
            check_repo_id(args.hub_model_id or Path(args.output_dir).name, "--hub_model_id")
            require_token(args.hub_token, option="--hub_token")
        except ValueError as error:
            parser.error(str(error))
    if args.model_overrides and args.pretrained_model_name_or_path:
        parser.error(
            "--model_overrides configures a new model; --pretrained_model_name_or_path fine-tunes a saved one, whose "
            "configuration is kept: drop one of them"
        )
    if not args.pretrained_model_name_or_path:  # a base pipeline's backbone is resolved when it is read
        resolve_model_type(parser, args)
    try:
        args.model_overrides = parse_overrides(args.model_overrides, MODEL_TYPES[args.model_type or "lmlp"])
    except ValueError as error:
        parser.error(str(error))


def validate_lora_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The LoRA options: they need --lora_rank and a base pipeline, and refuse what LoRA training cannot do."""
    if args.lora_rank is None:
        given = [f"--{n}" for n in ("lora_alpha", "lora_target_modules") if getattr(args, n) is not None]
        given += ["--lora_dropout"] if args.lora_dropout else []
        if given:
            parser.error(f"{', '.join(given)} configure the LoRA adapter of --lora_rank: add --lora_rank")
        return
    if args.lora_rank < 1:
        parser.error(f"--lora_rank must be >= 1, got {args.lora_rank}")
    if args.lora_alpha is not None and not (math.isfinite(args.lora_alpha) and args.lora_alpha > 0):
        parser.error(f"--lora_alpha must be a positive number, got {args.lora_alpha}")
    if not 0.0 <= args.lora_dropout < 1.0:
        parser.error(f"--lora_dropout must be in [0, 1), got {args.lora_dropout}")
    for name, why in (
        (
            "use_ema",
            "the adapter is trained without an EMA copy (--preset shapes turns EMA on, --preset shapes-lora not)",
        ),
        ("symmetry_breaking_weight", "its penalty reads the frozen base weights, which LoRA does not change"),
    ):
        if getattr(args, name):
            parser.error(f"--{name} does not go with --lora_rank: {why}")
    if not args.pretrained_model_name_or_path:
        parser.error(
            "--lora_rank fine-tunes a trained pipeline: pass --pretrained_model_name_or_path (or --preset shapes-lora, "
            "which fine-tunes the shapes model that ships in the package)"
        )


def resolve_model_type(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Settle --model_type and --model_config for a new model.

    The family is --model_type, else the named configuration's, else lmlp. A preset's named configuration of
    another family lends that family its skeleton (`SKELETON_FIELDS`: the shapes world's latent and text shapes and
    size), which explicit --model_overrides still replace.
    """
    named = named_configs()
    config = args.model_config
    if config is not None and not config.endswith(".json") and config not in named:
        parser.error(f"unknown --model_config {config!r}; choose one of {sorted(named)} or a .json file")
    config_family = named[config][0].name if config in named else None
    args.model_type = args.model_type or config_family or "lmlp"
    args.model_skeleton = {}
    if config_family not in (None, args.model_type):
        if not args.model_config_from_preset:
            parser.error(f"--model_config {config} is a --model_type {config_family} configuration")
        args.model_skeleton = {k: v for k, v in named[config][1].items() if k in SKELETON_FIELDS}
        args.model_config = None


def parse_overrides(pairs: list[str], model_class: type) -> dict:
    """`KEY=VALUE` pairs as config values (JSON, else a string), checked against the model class's config signature.

    Args:
        pairs (`list[str]`): The `--model_overrides` arguments, e.g. `["num_layers=12", "mlp_ratio=2.5"]`.
        model_class (`type`): The backbone class whose `__init__` arguments are the accepted keys.

    Raises:
        `ValueError`: For a pair without `=`, an unknown key or a value of the wrong type; the message lists the
            accepted keys.
    """
    parameters = inspect.signature(model_class.__init__, eval_str=True).parameters
    keys = sorted(name for name in parameters if name != "self")
    accepted = f"the accepted keys of {model_class.__name__} are {', '.join(keys)}"
    overrides = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep:
            raise ValueError(f"--model_overrides takes KEY=VALUE pairs, got {pair!r}; {accepted}")
        if key not in keys:
            raise ValueError(f"--model_overrides {pair}: unknown config key {key!r}; {accepted}")
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text
        kinds = typing.get_args(parameters[key].annotation) or (parameters[key].annotation,)  # int | None → both
        if not value_fits(value, kinds):
            names = " or ".join("null" if kind is type(None) else kind.__name__ for kind in kinds)
            raise ValueError(f"--model_overrides {pair}: {key} takes {names}, got {text!r}")
        overrides[key] = value
    return overrides


def value_fits(value, kinds: tuple[type, ...]) -> bool:
    """Whether a JSON value is of one of the annotated types (a bool is not an int; an int is a valid float).

    Args:
        value: The decoded value.
        kinds (`tuple[type, ...]`): The types of the annotation (`inspect.Parameter.empty` when unannotated).
    """
    if inspect.Parameter.empty in kinds:
        return True
    if isinstance(value, bool):
        return bool in kinds
    return isinstance(value, kinds) or (isinstance(value, int) and float in kinds)


def check_component_sources(args: argparse.Namespace) -> None:
    """Name a missing local folder or file of a base pipeline or frozen component, before any loading.

    Loaders turn these into confusing errors: transformers builds an empty tokenizer from a folder without tokenizer
    files (then `model_max_length=1e30` does not match the model), and a missing folder reads as a failed download.
    A source that is not a local folder must be a valid Hub id; the loader fetches it.

    Raises:
        `ValueError`: Naming the option, the folder and what it lacks.
    """
    option = "--pretrained_model_name_or_path"
    if args.pretrained_model_name_or_path and is_local(args.pretrained_model_name_or_path, option):
        base = Path(args.pretrained_model_name_or_path)
        if not (base / "model_index.json").is_file():
            raise ValueError(f"{option} {base} is not a saved pipeline: it has no model_index.json")
        for name in ("transformer", "vae", "text_encoder"):
            require_files(option, base, name, ("config.json",), f"the {name}")
        require_files(option, base, "tokenizer", TOKENIZER_FILES, "the tokenizer")
    option = "--pretrained_text_encoder"
    if args.pretrained_text_encoder and is_local(args.pretrained_text_encoder, option):
        source, subfolder = Path(args.pretrained_text_encoder), args.text_encoder_subfolder or ""
        require_files(option, source, "tokenizer" if subfolder else "", TOKENIZER_FILES, "the tokenizer")
        require_files(option, source, subfolder, ("config.json",), "the text model")
    if args.pretrained_vae and is_local(args.pretrained_vae, "--pretrained_vae"):
        require_files(
            "--pretrained_vae", Path(args.pretrained_vae), args.vae_subfolder or "", ("config.json",), "the VAE"
        )


def is_local(source: str, option: str) -> bool:
    """Whether a component source is a local folder; if not, it must be a Hub repo id.

    Args:
        source (`str`): The folder or Hub id given.
        option (`str`): The option that gave it, for the message.

    Raises:
        `ValueError`: When it is neither a folder nor a valid Hub id (a path that does not exist).
    """
    if Path(source).is_dir():
        return True
    try:
        validate_repo_id(source)
    except HFValidationError:
        raise ValueError(f"{option} {source}: no such folder") from None
    return False


def require_files(option: str, source: Path, subfolder: str, files: tuple[str, ...], what: str) -> None:
    """Require the folder `source/subfolder`, holding at least one of `files`.

    Args:
        option (`str`): The option that gave `source`, for the message.
        source (`Path`): The local folder given.
        subfolder (`str`): Where in it the component lives ("" for the folder itself).
        files (`tuple[str, ...]`): The component's files; one of them is enough.
        what (`str`): The component, for the message ("the tokenizer").

    Raises:
        `ValueError`: Naming the missing folder, or the folder and the files it lacks.
    """
    folder = source / subfolder
    if not folder.is_dir():
        raise ValueError(f"{option} {source} has no {subfolder}/ folder: {what} is missing")
    if not any((folder / name).is_file() for name in files):
        raise ValueError(f"{option} {source}: {what} folder {folder} has no {' or '.join(files)}")


# --------------------------------------------------------------------------------------------- model and components


def routes(model_class: type) -> bool:
    """Whether the backbone can report router probabilities for the load-balancing loss."""
    return "output_router_probs" in inspect.signature(model_class.forward).parameters


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    if args.pretrained_model_name_or_path:
        config = LMLPPipeline.load_config(args.pretrained_model_name_or_path, revision=args.revision)
        saved = family_of(config["transformer"][1]).name
        if args.model_type not in (None, saved):
            raise SystemExit(
                f"error: --model_type {args.model_type} conflicts with the base pipeline, whose backbone is "
                f"{config['transformer'][1]} (--model_type {saved}); fine-tuning keeps the saved backbone."
            )
        args.model_type = saved
        if args.load_balance_weight and not routes(MODEL_TYPES[saved]):
            raise SystemExit("error: --load_balance_weight applies to MoE-MLP backbones only")
        model = MODEL_TYPES[saved].from_pretrained(
            args.pretrained_model_name_or_path, subfolder="transformer", revision=args.revision, variant=args.variant
        )
    else:
        model = build_new_model(args)
    if args.symmetry_breaking_weight:
        try:
            symmetry_breaking_penalty(model)  # refuses a backbone without symmetry-breaking weights
        except ValueError as error:
            raise SystemExit(f"error: --symmetry_breaking_weight: {error}") from None
    return model


def build_new_model(args: argparse.Namespace) -> torch.nn.Module:
    """A randomly initialised backbone of --model_type from --model_config and --model_overrides."""
    model_class = MODEL_TYPES[args.model_type]
    if args.load_balance_weight and not routes(model_class):
        raise SystemExit("error: --load_balance_weight applies to a backbone with routers (--model_type moe_mlp)")
    if args.model_config is None:
        build = functools.partial(model_class, **{**args.model_skeleton, **args.model_overrides})
    elif args.model_config.endswith(".json"):
        with open(args.model_config, encoding="utf-8") as f:
            config = {k: v for k, v in json.load(f).items() if not k.startswith("_")}
        build = functools.partial(model_class, **{**config, **args.model_overrides})
    else:
        build = functools.partial(model_class.from_named_config, args.model_config, **args.model_overrides)
    try:
        return build()
    except ValueError as error:  # a value the model refuses (hidden_size=0)
        source = f"--model_config {args.model_config}" if args.model_config else f"--model_type {args.model_type}"
        raise SystemExit(f"error: {source} with --model_overrides: {error}") from None


def load_components(args: argparse.Namespace) -> tuple[CLIPTokenizer, CLIPTextModel, AutoencoderKL]:
    """The frozen tokenizer, text encoder and VAE.

    A base pipeline's own, else the shapes world's (the embedded default), else the papers' SD VAE and CLIP L/14;
    `--pretrained_vae` / `--pretrained_text_encoder` replace either.
    """
    text_id, text_subfolder = args.pretrained_text_encoder, args.text_encoder_subfolder
    vae_id, vae_subfolder = args.pretrained_vae, args.vae_subfolder
    if args.pretrained_model_name_or_path:
        pipe = LMLPPipeline.from_pretrained(args.pretrained_model_name_or_path, revision=args.revision)
        tokenizer, text_encoder, vae = pipe.tokenizer, pipe.text_encoder, pipe.vae
    elif args.shapes_world:
        from diffusers_lmlp.shapes.text import shapes_components

        tokenizer, text_encoder, vae = shapes_components()
    else:
        text_id = text_id or COCO_TEXT_ENCODER
        vae_id, vae_subfolder = (vae_id, vae_subfolder) if vae_id else COCO_VAE
    if text_id:
        with loading_from("the text encoder", text_id):  # subfolder "" is the folder itself (None breaks transformers)
            tokenizer = CLIPTokenizer.from_pretrained(text_id, subfolder="tokenizer" if text_subfolder else "")
            text_encoder = CLIPTextModel.from_pretrained(text_id, subfolder=text_subfolder or "", use_safetensors=True)
    if vae_id:
        with loading_from("the VAE", vae_id):
            vae = AutoencoderKL.from_pretrained(vae_id, subfolder=vae_subfolder, use_safetensors=True)
    if args.latent_scale is not None:
        vae.register_to_config(scaling_factor=args.latent_scale)
    return tokenizer, text_encoder.requires_grad_(False).eval(), vae.requires_grad_(False).eval()


@contextlib.contextmanager
def loading_from(what: str, source: str):
    """Turn a loader's `OSError` for a Hub id (local folders were checked at start-up) into a message that says so.

    Args:
        what (`str`): The component, for the message.
        source (`str`): The Hub id or folder it is loaded from.
    """
    try:
        yield
    except OSError as error:
        where = "a local folder" if Path(source).is_dir() else "not a local folder, so it was looked up on the Hub"
        raise SystemExit(f"error: could not load {what} from {source!r} ({where}): {error}") from None


def check_compatible(model, tokenizer, text_encoder, vae, resolution: int, fine_tuning: bool = False) -> None:
    """Refuse components and a resolution that do not fit the backbone, before any data is touched.

    The model mixes a fixed number of tokens, so the VAE must turn `resolution` px images into latents of exactly
    the model's `sample_size`. That size is measured from the VAE's layers, not only computed from its config: the
    pipeline sizes images by the config's factor, so a VAE whose layers downsample otherwise is refused too.

    Args:
        model: The backbone.
        tokenizer: The CLIP tokenizer.
        text_encoder: The CLIP text model.
        vae (`AutoencoderKL`): The VAE.
        resolution (`int`): `--resolution`, in pixels.
        fine_tuning (`bool`, *optional*, defaults to `False`): Whether the model is a saved one, whose `sample_size`
            is kept (so the message does not offer `--model_overrides`).

    Raises:
        `SystemExit`: With a message that says what to pass instead.
    """
    config = model.config
    factor = 2 ** (len(vae.config.block_out_channels) - 1)  # the factor LMLPPipeline sizes images by
    native = config.sample_size * factor
    if resolution != native:
        fix = f"pass --resolution {native}"
        if fine_tuning:
            fix += " (a fine-tuned model keeps its sample_size)"
        elif resolution % (factor * config.patch_size) == 0:
            fix += f", or --model_overrides sample_size={resolution // factor}"
        raise SystemExit(
            f"error: --resolution {resolution} does not match the model: sample_size {config.sample_size} × VAE "
            f"factor {factor} = {native} px. Token mixing is over a fixed number of tokens: {fix}."
        )
    height, width = vae_latent_size(vae, resolution)
    if (height, width) != (config.sample_size, config.sample_size):
        raise SystemExit(
            f"error: the VAE encodes {resolution}×{resolution} px images to {height}×{width} latents, but the "
            f"model's sample_size is {config.sample_size}: its config (block_out_channels of "
            f"{len(vae.config.block_out_channels)} entries) gives a factor of {factor}, its layers downsample by "
            f"{resolution // height}. Use a VAE whose config matches its layers (one down block per entry of "
            "block_out_channels)."
        )
    # LMLPPipeline's constructor checks text width, tokenizer length and latent channels with clear messages.
    try:
        LMLPPipeline(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=model, scheduler=None)
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None


def vae_latent_size(vae: AutoencoderKL, resolution: int) -> tuple[int, int]:
    """The (height, width) of the VAE encoder's output for a `resolution`² image, run on the meta device: shapes
    only, no memory for a copy of the weights and no arithmetic, even for SD's VAE at 512 px.

    Args:
        vae (`AutoencoderKL`): The VAE.
        resolution (`int`): The image side, in pixels.

    Raises:
        `SystemExit`: When the encoder cannot take images of that size.
    """
    encoder = vae.encoder
    tensors = {**dict(encoder.named_parameters()), **dict(encoder.named_buffers())}
    meta = {name: torch.empty_like(tensor, device="meta") for name, tensor in tensors.items()}
    image = torch.empty(1, vae.config.in_channels, resolution, resolution, dtype=vae.dtype, device="meta")
    try:
        with torch.no_grad():
            moments = torch.func.functional_call(encoder, meta, (image,))  # (1, 2C, h, w)
    except RuntimeError as error:
        raise SystemExit(f"error: the VAE cannot encode {resolution}×{resolution} px images: {error}") from None
    return tuple(moments.shape[-2:])


# ----------------------------------------------------------------------------------------------------------- data


def step_generator(seed: int, *keys: int) -> torch.Generator:
    """A generator that depends only on the seed and the keys (step, sample position, …): exact resume."""
    digest = hashlib.sha256(repr((seed, *keys)).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


def build_feature_store(args, dataset, tokenizer, text_encoder, vae, accelerator, cache_dir: Path) -> FeatureStore:
    """The feature store of this data and these components, extracted first by every process (each its shards).

    Args:
        args (`argparse.Namespace`): The parsed arguments (columns, resolution, `--cache_text_dtype`, workers).
        dataset (`datasets.Dataset`): The training data.
        tokenizer (`CLIPTokenizer`): The tokenizer.
        text_encoder (`CLIPTextModel`): The text encoder.
        vae (`AutoencoderKL`): The VAE.
        accelerator (`Accelerator`): The run's accelerator (rank, number of processes, barrier).
        cache_dir (`Path`): The store is `<cache_dir>/features/<key>`.
    """
    columns = dict(image_column=args.image_column, caption_column=args.caption_column, resolution=args.resolution)
    components = dict(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae)
    text_dtype = args.cache_text_dtype or "float32"
    key = feature_store_key(dataset, **columns, **components, text_dtype=text_dtype)
    try:
        return open_feature_store(
            cache_dir / "features" / key,
            dataset,
            process_index=accelerator.process_index,
            num_processes=accelerator.num_processes,
            wait_for_everyone=accelerator.wait_for_everyone,
            **columns,
            **components,
            text_dtype=text_dtype,
            num_workers=args.dataloader_num_workers,
        )
    except (OSError, ValueError) as error:  # a caption that is not one, a store other processes cannot see
        raise SystemExit(f"error: {error}") from None


class BatchReader:
    """The CPU half of making a batch, which runs in `DataLoader` worker processes: the caption pick, caption dropout
    and flip draws, then the samples, read from the feature store (latents re-sampled from the stored moments at
    every use, as the reference does) or decoded and cropped.

    A map-style dataset is read as an endless stream of per-epoch permutations (sample k of step s is a pure
    function of the seed and s), so resuming needs no data state. A streaming dataset is read in order from this
    process's shard, shuffled per epoch with a seeded buffer, skipping what the steps before `step` used; the stream
    is opened by the process that reads it.

    Args:
        args (`argparse.Namespace`): The parsed arguments (seed, columns, resolution, flips, batch sizes, streaming).
        dataset (`datasets.Dataset` or `datasets.IterableDataset`): The training data.
        store (`FeatureStore`, *optional*): The feature store of `dataset`, read instead of its images.
        process_index (`int`): This process's rank.
        num_processes (`int`): The number of training processes.
        step (`int`): The first step read.
    """

    def __init__(self, args, dataset, store: FeatureStore | None, process_index: int, num_processes: int, step: int):
        self.args, self.dataset, self.store = args, dataset, store
        self.process_index, self.num_processes, self.step = process_index, num_processes, step
        self._permutation = (-1, None)
        self._stream = None

    def sample_index(self, position: int) -> int:
        """Index of the sample at `position` of the endless stream of per-epoch permutations."""
        epoch, offset = divmod(position, len(self.dataset))
        if self._permutation[0] != epoch:
            generator = step_generator(self.args.seed, "epoch", epoch)
            self._permutation = (epoch, torch.randperm(len(self.dataset), generator=generator))
        return int(self._permutation[1][offset])

    def _next_records(self, count: int) -> list[dict]:
        if self._stream is None:
            self._stream = self._epochs()
            per_step = self.args.train_batch_size * self.args.gradient_accumulation_steps
            self._next_records(self.step * per_step)  # what the steps before a resume consumed
        return [next(self._stream) for _ in range(count)]

    def _epochs(self) -> Iterator[dict]:
        """This process's shard of the stream, shuffled, epoch after epoch, one record at a time.

        Read with `iter(batch_size=1)`: iterating the dataset itself in a `DataLoader` worker would let `datasets`
        split it between the workers, in another order than in the main process.
        """
        from datasets.distributed import split_dataset_by_node

        shard = split_dataset_by_node(self.dataset, self.process_index, self.num_processes)
        shard = shard.shuffle(seed=self.args.seed, buffer_size=1000)
        for epoch in itertools.count():
            shard.set_epoch(epoch)
            empty = True
            for batch in shard.iter(batch_size=1):
                empty = False
                yield {column: values[0] for column, values in batch.items()}
            if empty:
                raise ValueError(f"the stream of process {self.process_index} is empty: it has no records to train on")

    @torch.no_grad()
    def load(self, positions: list[int], generator: torch.Generator) -> dict:
        """The CPU half of the batch of the samples at `positions` of the sample stream.

        Args:
            positions (`list[int]`): The positions.
            generator (`torch.Generator`): The step's generator; `BatchSource.finish` continues where this leaves it.

        Returns:
            `dict`: `drop` (b,) (caption dropout), and `latents` (b, C, h, w) unscaled and `states` (b, T, D) from the
            store, or `pixels` (b, 3, H, W) and `texts` (b captions) to encode.
        """
        args = self.args
        choice = torch.rand(len(positions), generator=generator)  # caption pick
        drop = torch.rand(len(positions), generator=generator) < args.caption_dropout
        flip = torch.rand(len(positions), generator=generator) < 0.5
        if self.store is not None:
            moments, states = self.store.read([self.sample_index(p) for p in positions], choice)
            mean, logvar = moments.chunk(2, dim=1)  # (b, C, h, w) each
            noise = torch.randn(mean.shape, generator=generator)
            latents = mean + torch.exp(0.5 * logvar.clamp(-30.0, 20.0)) * noise  # (b, C, h, w)
            return {"drop": drop, "latents": latents, "states": states}
        if args.streaming:
            records = self._next_records(len(positions))
        else:
            records = [self.dataset[self.sample_index(p)] for p in positions]
        captions = [captions_of(r[args.caption_column]) for r in records]
        pixels = torch.stack(
            [
                preprocess_image(r[args.image_column], args.resolution, bool(f and args.random_flip))
                for r, f in zip(records, flip)
            ]
        )  # (b, 3, H, W)
        texts = [caps[int(c * len(caps))] for caps, c in zip(captions, choice)]
        return {"drop": drop, "pixels": pixels, "texts": texts}


class StepBatches(torch.utils.data.IterableDataset):
    """This process's `BatchReader.load` of steps `first` … `last - 1`, each with its step generator's state after it.

    Worker w of W makes steps first + w, first + w + W, …, and a `DataLoader` returns its workers' items in turn,
    so the steps come back in order. A stream, read in order, is read by one worker.

    Args:
        reader (`BatchReader`): Makes each step's batch.
        first (`int`): The first step.
        last (`int`): The step after the last.
    """

    def __init__(self, reader: BatchReader, first: int, last: int):
        self.reader, self.first, self.last = reader, first, last

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        args, rank = self.reader.args, self.reader.process_index
        per_step = args.train_batch_size * args.gradient_accumulation_steps  # per process
        for step in range(self.first + worker, self.last, workers):
            first = (step * self.reader.num_processes + rank) * per_step
            generator = step_generator(args.seed, "step", step, rank)
            yield self.reader.load(list(range(first, first + per_step)), generator), generator.get_state()


class BatchSource:
    """Produces the clean latents and conditioning of the samples at given positions of the sample stream.

    A `BatchReader` makes the CPU half (in `--dataloader_num_workers` worker processes, ahead of the training step
    that needs it); this process runs the encoders when there is no feature store, applies caption dropout and scales
    the latents. Every random draw comes from the step's generator, in one order whichever process makes it, so the
    batches, their noise and timesteps are the same with any number of workers, and a resumed run continues exactly.

    Args:
        args (`argparse.Namespace`): The parsed arguments.
        dataset (`datasets.Dataset` or `datasets.IterableDataset`): The training data.
        store (`FeatureStore`, *optional*): Its feature store.
        tokenizer (`CLIPTokenizer`): The tokenizer.
        text_encoder (`CLIPTextModel`): The text encoder (for "" and, without a store, every caption).
        vae (`AutoencoderKL`): The VAE (its config's scale and shift; without a store, it encodes every image).
        step (`int`): The first step.
        process_index (`int`, *optional*, defaults to 0): This process's rank.
        num_processes (`int`, *optional*, defaults to 1): The number of training processes.
    """

    def __init__(self, args, dataset, store, tokenizer, text_encoder, vae, step, process_index=0, num_processes=1):
        self.args, self.tokenizer, self.text_encoder, self.vae = args, tokenizer, text_encoder, vae
        self.reader = BatchReader(args, dataset, store, process_index, num_processes, step)
        self.empty_states = encode_text(tokenizer, text_encoder, [""])  # (1, T, D)

    def batch(self, positions: list[int], generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents (b, C, h, w) scaled by the latent scale, and text states (b, T, D), caption dropout applied.

        Args:
            positions (`list[int]`): Positions in the sample stream.
            generator (`torch.Generator`): The step's generator.
        """
        return self.finish(self.reader.load(positions, generator), generator)

    @torch.no_grad()
    def finish(self, loaded: dict, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents (b, C, h, w) scaled by the latent scale, and text states (b, T, D), caption dropout applied.

        Args:
            loaded (`dict`): What `BatchReader.load` made.
            generator (`torch.Generator`): The step's generator, where `load` left it.
        """
        if "pixels" in loaded:
            states = encode_text(self.tokenizer, self.text_encoder, loaded["texts"])  # (b, T, D)
            dist = self.vae.encode(loaded["pixels"].to(self.vae.device, self.vae.dtype)).latent_dist
            latents = dist.mean + dist.std * torch.randn(dist.mean.shape, generator=generator).to(dist.mean)
        else:
            latents, states = loaded["latents"], loaded["states"]
        states = states.float()
        empty = self.empty_states.float().to(states.device)
        states = torch.where(loaded["drop"].to(states.device)[:, None, None], empty, states)  # (b, T, D)
        config = self.vae.config
        latents = latents.float()
        if config.shift_factor is not None:
            latents = latents - config.shift_factor
        return latents * config.scaling_factor, states

    def steps(self, first: int, last: int) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Generator]]:
        """The batches of steps `first` … `last - 1`, read by `--dataloader_num_workers` worker processes.

        Args:
            first (`int`): The first step.
            last (`int`): The step after the last.

        Yields:
            `tuple`: Latents (b, C, h, w), text states (b, T, D) and the step's generator, where the batch left it
            (the step's noise and timesteps come next).
        """
        workers = self.args.dataloader_num_workers
        if self.args.streaming and workers > 1:
            logger.info(f"--dataloader_num_workers {workers}: a stream is read in order, by one worker process")
            workers = 1
        loader = torch.utils.data.DataLoader(
            StepBatches(self.reader, first, last),
            batch_size=None,  # items are batches already
            num_workers=workers,
            pin_memory=self.vae.device.type == "cuda",
            generator=torch.Generator().manual_seed(0),  # DataLoader would otherwise draw from the global RNG
        )
        for loaded, state in loader:
            generator = torch.Generator()
            generator.set_state(state)
            yield *self.finish(loaded, generator), generator


# ------------------------------------------------------------------------------------------ validation and output


@torch.no_grad()
def generate(pipe: LMLPPipeline, prompts: list[str], args, seed: int) -> list[Image.Image]:
    generator = torch.Generator().manual_seed(seed)
    pipe.set_progress_bar_config(disable=True)
    return pipe(
        prompts,
        num_inference_steps=args.validation_inference_steps,
        guidance_scale=args.validation_guidance_scale,
        generator=generator,
    ).images


def build_pipeline(model, tokenizer, text_encoder, vae) -> LMLPPipeline:
    return LMLPPipeline(
        vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=model, scheduler=default_scheduler()
    )


def default_validation_prompts(args) -> list[str]:
    """The validation grid's prompts: `--validation_prompts` (or the file's), else on the shapes world 6 training
    captions and 2 held-out combinations, else none (no validation during training, no sample grid at the end).

    Args:
        args (`argparse.Namespace`): The parsed arguments.
    """
    if args.validation_prompts:
        return args.validation_prompts
    if args.shapes_world:
        from diffusers_lmlp.shapes.world import held_out_specs, train_specs

        return [s.caption for s in train_specs()[:: max(1, len(train_specs()) // 6)][:6]] + [
            s.caption for s in held_out_specs()[:2]
        ]
    return []


def final_evaluation(pipe: LMLPPipeline, args) -> dict[str, dict]:
    """Evaluate the finished pipeline on the shapes world at the pipeline's default sampler settings (what a user
    gets from `pipe(caption)`; `--final_evaluation_inference_steps` changes the steps, for smoke runs): the shapes scorer's accuracies with 95% intervals over captions, and shapes-FID
    against renders of the same captions with its real-vs-real floor. Each split has as many captions as there are
    held-out combinations (all of them, for the held-out split), each sampled `FINAL_EVALUATION_SEEDS` times.

    Args:
        pipe (`LMLPPipeline`): The trained pipeline.
        args (`argparse.Namespace`): The parsed arguments (the seed, the sampler steps).

    Returns:
        `dict[str, dict]`: The evaluation report of each split ("train", "held-out").
    """
    from diffusers_lmlp.shapes.world import held_out_specs

    reports = {}
    for split, source in (("train", "shapes:train"), ("held-out", "shapes:heldout")):
        captions = draw_captions(source, len(held_out_specs()), args.seed) * FINAL_EVALUATION_SEEDS[split]
        reports[split], _ = evaluate(
            pipe,
            captions,
            fid_reference="shapes",
            num_inference_steps=args.final_evaluation_inference_steps,
            batch_size=64,
            seed=args.seed,
            progress=False,
        )
    return reports


def score_summary(reports: dict[str, dict], suffix: str = "") -> dict[str, dict]:
    """The summary's entries for one final evaluation: the scorer's accuracies, their intervals and shapes-FID, each
    by split, under keys ending with `suffix` (`"_before"` for the base model of a LoRA run).

    Args:
        reports (`dict[str, dict]`): `final_evaluation`'s reports, by split.
        suffix (`str`, *optional*, defaults to `""`): Appended to each key.
    """
    return {
        f"scores{suffix}": {split: report["shapes"] for split, report in reports.items()},
        f"score_intervals{suffix}": {split: report["shapes_intervals"] for split, report in reports.items()},
        f"shapes_fid{suffix}": {
            split: {key: report[key] for key in ("fid", "fid_floor", "num_images")}
            for split, report in reports.items()
        },
    }


def allow_tf32() -> None:
    """Let float32 matmuls and cuDNN convolutions run on TF32 tensor cores (NVIDIA Ampere and newer), as diffusers'
    `--allow_tf32` does: several times faster, with a 10-bit mantissa. The matmul switch is the one that
    `torch.set_float32_matmul_precision("high")` sets. CPUs have no TF32: there it changes nothing."""
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    logger.info("TF32 allowed for float32 matmuls and convolutions (Ampere and newer GPUs)")


def use_every_core(accelerator: Accelerator) -> None:
    """Let a run of one process on the CPU use every core it may run on.

    `accelerate launch` sets `OMP_NUM_THREADS=1` for each process it starts unless told otherwise (right for several
    processes per machine, and on a GPU), which leaves a one-process CPU run on one core. torch's own default is every
    core; on 2 cores the embedded default trains 1.3× faster.

    Args:
        accelerator (`Accelerator`): The run's accelerator.
    """
    if accelerator.num_processes > 1 or accelerator.device.type != "cpu":
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if torch.get_num_threads() < cores:
        logger.info(f"one process on the CPU: {cores} threads (OMP_NUM_THREADS was {torch.get_num_threads()})")
        torch.set_num_threads(cores)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    output_dir = Path(args.output_dir)
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        mixed_precision=args.mixed_precision,
        log_with=None if args.report_to == "none" else args.report_to,
        project_config=ProjectConfiguration(
            project_dir=str(output_dir), logging_dir=str(output_dir / args.logging_dir)
        ),
    )
    logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s", level=logging.INFO)
    if not is_terminal(sys.stderr):  # a log file: the libraries' own bars (transformers' "Writing model shards" when
        transformers_logging.disable_progress_bar()  # saving, Hub downloads) would redraw with carriage returns there
    logger.info(
        f"{accelerator.num_processes} process(es), {accelerator.distributed_type}, {accelerator.device}, "
        f"mixed precision {accelerator.mixed_precision}"
    )
    if args.allow_tf32:
        allow_tf32()
    use_every_core(accelerator)
    with exclusive_output_dir(accelerator, output_dir):
        run_training(args, accelerator, output_dir)


def run_training(args: argparse.Namespace, accelerator: Accelerator, output_dir: Path) -> None:
    """Train, checkpoint, validate, then save the pipeline (and push it with --push_to_hub).

    Args:
        args (`argparse.Namespace`): The parsed arguments.
        accelerator (`Accelerator`): The run's accelerator.
        output_dir (`Path`): The `--output_dir`, held by this run.
    """
    set_seed(args.seed)  # the initial weights; data, noise and timesteps come from per-step generators
    model = build_model(args)
    tokenizer, text_encoder, vae = load_components(args)
    check_compatible(model, tokenizer, text_encoder, vae, args.resolution, bool(args.pretrained_model_name_or_path))
    text_encoder.to(accelerator.device)
    vae.to(accelerator.device)
    model_class = type(model)
    if args.lora_rank:
        config = lora_config(model, args.lora_rank, args.lora_alpha, args.lora_dropout, args.lora_target_modules)
        adapted = add_lora(model, config)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        logger.info(
            f"LoRA rank {config.r}, alpha {config.lora_alpha:g}: {len(adapted)} layers adapted, {trainable:,} trainable "
            f"parameters ({trainable / sum(p.numel() for p in model.parameters()):.2%} of the backbone)"
        )

    cache_dir = Path(args.cache_dir) if args.cache_dir else output_dir.parent / ".lmlp-cache"
    with accelerator.main_process_first():
        try:
            dataset = load_training_data(
                dataset_name=args.dataset_name,
                dataset_config_name=args.dataset_config_name,
                train_data_dir=args.train_data_dir,
                data_layout=args.data_layout,
                image_column=args.image_column,
                caption_column=args.caption_column,
                max_train_samples=args.max_train_samples,
                streaming=args.streaming,
                seed=args.seed,
                cache_dir=str(cache_dir / "datasets"),
                shapes_split=args.shapes_split,
            )
        except ValueError as error:
            raise SystemExit(f"error: {error}") from None
    store = None
    if args.cache_features:
        start = time.perf_counter()
        store = build_feature_store(args, dataset, tokenizer, text_encoder, vae, accelerator, cache_dir)
        logger.info(
            f"feature cache {store.path.name}: {len(store)} images ready in {time.perf_counter() - start:.1f} s "
            f"({store.nbytes() / len(store):,.0f} bytes per image, text states in {args.cache_text_dtype or 'float32'})"
        )

    if args.gradient_checkpointing:
        model.enable_gradient_checkpointing()
    model.train()
    ema = None
    if args.use_ema:
        ema = EMAModel(model.parameters(), decay=args.ema_decay, model_cls=model_class, model_config=model.config)
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],  # with LoRA, the adapter's
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        weight_decay=args.adam_weight_decay,
        eps=args.adam_epsilon,
    )
    lr_scheduler = get_scheduler(
        args.lr_scheduler,
        optimizer=optimizer,
        num_warmup_steps=args.lr_warmup_steps * accelerator.num_processes,
        num_training_steps=args.max_train_steps * accelerator.num_processes,
    )
    model, optimizer, lr_scheduler = accelerator.prepare(model, optimizer, lr_scheduler)
    register_checkpoint_hooks(accelerator, model_class, ema, lora=bool(args.lora_rank))
    noise_scheduler = DDPMScheduler.from_config(default_scheduler().config)

    global_step, seconds_before = 0, 0.0
    if args.resume_from_checkpoint:
        checkpoints = list_checkpoints(output_dir)
        path = (
            Path(args.resume_from_checkpoint)
            if args.resume_from_checkpoint != "latest"
            else (checkpoints[-1] if checkpoints else None)
        )
        if path is None:
            logger.info("--resume_from_checkpoint latest: no checkpoint yet, starting from scratch")
        else:
            accelerator.load_state(str(path))
            global_step, seconds_before = checkpoint_step(path), saved_train_seconds(path)
            logger.info(f"resumed from {path} at step {global_step}")
    warn_about_later_checkpoints(output_dir, global_step)

    source = BatchSource(
        args, dataset, store, tokenizer, text_encoder, vae, global_step,
        process_index=accelerator.process_index, num_processes=accelerator.num_processes,
    )  # fmt: skip
    batches = source.steps(global_step, args.max_train_steps)
    if accelerator.is_main_process:
        config = {k: v for k, v in public_args(args).items() if isinstance(v, int | float | str | bool)}
        accelerator.init_trackers(args.tracker_project_name, config=config)

    micro = args.train_batch_size
    per_step = micro * args.gradient_accumulation_steps  # per process
    # tqdm's bar in a terminal; in a log file, a plain line at every 5% of the steps and at least one a minute.
    progress = progress_bar(
        args.max_train_steps, "steps", initial=global_step, disable=not accelerator.is_local_main_process
    )
    prompts = default_validation_prompts(args)
    fid_captions = (
        draw_captions(args.validation_fid_captions or "shapes:train", args.validation_fid_images, args.seed)
        if args.validation_fid_images
        else []
    )
    start_time = time.perf_counter()
    try:
        while global_step < args.max_train_steps:
            # The samples and noise of one optimizer step, for this process, drawn before the micro-batches split them.
            latents, text_states, generator = next(batches)  # read ahead by the data loader's workers
            latents, text_states = latents.to(accelerator.device), text_states.to(accelerator.device)
            noise = torch.randn(latents.shape, generator=generator).to(latents)
            if args.noise_offset:
                noise += args.noise_offset * torch.randn(latents.shape[:2] + (1, 1), generator=generator).to(latents)
            timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (per_step,), generator=generator)
            noisy = noise_scheduler.add_noise(latents, noise, timesteps)

            step_loss = torch.zeros((), device=accelerator.device)
            for start in range(0, per_step, micro):
                part = slice(start, start + micro)
                with accelerator.accumulate(model):
                    out = model(
                        noisy[part],
                        text_states[part],
                        timesteps[part].to(accelerator.device),
                        **({"output_router_probs": True} if args.load_balance_weight else {}),
                    )
                    mse = F.mse_loss(out.sample.float(), noise[part].float(), reduction="none").mean(dim=(1, 2, 3))
                    if args.snr_gamma is not None:
                        snr = compute_snr(noise_scheduler, timesteps[part])
                        mse = mse * torch.clamp(snr, max=args.snr_gamma).to(mse) / snr.to(mse)
                    loss = mse.mean()
                    if args.load_balance_weight:
                        loss = loss + load_balancing_loss(out.router_probs, weight=args.load_balance_weight)
                    if args.symmetry_breaking_weight:
                        loss = loss + args.symmetry_breaking_weight * symmetry_breaking_penalty(model)
                    accelerator.backward(loss)
                    if accelerator.sync_gradients:  # the norm is logged; it is clipped only with --max_grad_norm
                        max_norm = args.max_grad_norm if args.max_grad_norm is not None else math.inf
                        grad_norm = accelerator.clip_grad_norm_(model.parameters(), max_norm)
                    optimizer.step()
                    lr_scheduler.step()
                    optimizer.zero_grad(set_to_none=True)
                step_loss += loss.detach() / args.gradient_accumulation_steps

            global_step += 1
            if ema is not None:
                ema.step(model.parameters())
            logs = {
                "loss": accelerator.gather(step_loss).mean().item(),
                "lr": lr_scheduler.get_last_lr()[0],
                "grad_norm": float(grad_norm),
            }
            progress.set_postfix(loss=f"{logs['loss']:.4f}", lr=f"{logs['lr']:.2e}", refresh=False)
            progress.update(1)  # after the postfix: the line written at this step shows this step's loss
            accelerator.log(logs, step=global_step)

            if global_step % args.checkpointing_steps == 0 or global_step == args.max_train_steps:
                if accelerator.is_main_process:
                    seconds = seconds_before + time.perf_counter() - start_time
                    saved = save_checkpoint(
                        accelerator, output_dir, global_step, args.checkpoints_total_limit, seconds
                    )
                    logger.info(f"saved {saved}")
                accelerator.wait_for_everyone()
            if (prompts or fid_captions) and accelerator.is_main_process and global_step % args.validation_steps == 0:
                validate(
                    accelerator,
                    model,
                    ema,
                    tokenizer,
                    text_encoder,
                    vae,
                    prompts,
                    fid_captions,
                    args,
                    output_dir,
                    global_step,
                )
    finally:  # also when a step fails: the workers exit and the bar is closed now, not at interpreter exit
        batches.close()
        progress.close()
    train_seconds = seconds_before + time.perf_counter() - start_time  # over every segment of a resumed run

    accelerator.wait_for_everyone()
    in_sync = ranks_in_sync(accelerator, model)
    if accelerator.is_main_process:
        finish(accelerator, model, ema, tokenizer, text_encoder, vae, args, output_dir, train_seconds, in_sync)
    # Every process leaves together: a rank that tears down its process group while the main process still saves
    # leaves the main process waiting for it at exit (seen with gloo).
    accelerator.wait_for_everyone()
    if accelerator.num_processes > 1:  # everything is saved: a teardown that hangs must not hold the job forever
        faulthandler.dump_traceback_later(TEARDOWN_TIMEOUT_SECONDS, exit=True)
    accelerator.end_training()


def public_args(args: argparse.Namespace) -> dict:
    """The arguments without the secrets (`SECRET_ARGUMENTS`): all that trackers, the card and the summary see.

    Args:
        args (`argparse.Namespace`): The parsed arguments.
    """
    return {name: value for name, value in vars(args).items() if name not in SECRET_ARGUMENTS}


def ranks_in_sync(accelerator: Accelerator, model) -> bool:
    """Whether every process ended with the same weights (a wrong multi-process launch trains them separately)."""
    flat = torch.cat([p.detach().float().flatten() for p in accelerator.unwrap_model(model).parameters()])
    digest = torch.tensor([flat.sum().item(), (flat * flat).sum().item()], dtype=torch.float64, device=flat.device)
    gathered = accelerator.gather(digest[None]).view(-1, 2)
    return bool((gathered == gathered[0]).all())


@contextlib.contextmanager
def ema_weights(model, ema: EMAModel | None):
    """Temporarily swap the EMA weights into the model."""
    if ema is None:
        yield
        return
    ema.store(model.parameters())
    ema.copy_to(model.parameters())
    try:
        yield
    finally:
        ema.restore(model.parameters())


def validate(
    accelerator, model, ema, tokenizer, text_encoder, vae, prompts, fid_captions, args, output_dir: Path, step: int
):
    """Sample the prompts (EMA weights if any) and save `validation/step-<step>.png`, a grid captioned with them;
    log the samples to tensorboard (one tiled image, tag "validation") and wandb (one image per prompt, captioned).
    With `--validation_fid_images`, also sample the FID captions and log their FID ("fid").

    Args:
        accelerator (`Accelerator`): The run's accelerator; its trackers receive the images.
        model: The prepared backbone.
        ema (`EMAModel`, *optional*): The EMA weights, swapped in for sampling.
        tokenizer, text_encoder, vae: The frozen components.
        prompts (`list[str]`): The validation prompts (none: no grid).
        fid_captions (`list[str]`): The captions FID samples (none: no FID).
        args (`argparse.Namespace`): The parsed arguments (seed, sampling steps, guidance scale, FID reference).
        output_dir (`Path`): The `--output_dir`.
        step (`int`): The optimizer step, the images' step in the trackers.
    """
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.eval()
    pipe = build_pipeline(unwrapped, tokenizer, text_encoder, vae)
    with ema_weights(unwrapped, ema):
        images = generate(pipe, prompts, args, seed=args.seed) if prompts else []
        if fid_captions:
            report, _ = evaluate(
                pipe,
                fid_captions,
                fid_reference=args.validation_fid_reference or "shapes",
                num_inference_steps=args.validation_inference_steps,
                guidance_scale=args.validation_guidance_scale,
                seed=args.seed,
                progress=False,
            )
            accelerator.log({"fid": report["fid"]}, step=step)
            logger.info(
                f"step {step}: FID {report['fid']:.3f} ({len(fid_captions)} images, {report['fid_extractor']})"
            )
    unwrapped.train()
    if not prompts:
        return
    grid = make_image_grid(images, captions=prompts)
    path = output_dir / "validation" / f"step-{step:07d}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    grid.save(path)
    for tracker in accelerator.trackers:
        if tracker.name == "tensorboard":
            tracker.writer.add_images(
                "validation", np.stack([np.asarray(i) for i in images]), step, dataformats="NHWC"
            )
        elif tracker.name == "wandb":
            import wandb

            tracker.log({"validation": [wandb.Image(i, caption=p) for i, p in zip(images, prompts)]}, step=step)
    logger.info(f"validation grid: {path}")


def finish(accelerator, model, ema, tokenizer, text_encoder, vae, args, output_dir: Path, seconds, in_sync) -> None:
    """Save the pipeline (EMA weights unless EMA is off) with a model card; score it on the shapes world."""
    unwrapped = accelerator.unwrap_model(model)
    unwrapped = getattr(unwrapped, "_orig_mod", unwrapped)
    if ema is not None:
        ema.copy_to(unwrapped.parameters())
    unwrapped.eval()
    pipe = build_pipeline(unwrapped, tokenizer, text_encoder, vae)
    if args.lora_rank:
        save_adapter(unwrapped, output_dir)
    else:
        pipe.save_pretrained(output_dir)

    summary = {
        **({"base_model": args.pretrained_model_name_or_path} if args.lora_rank else {}),
        "num_processes": accelerator.num_processes,
        "ranks_in_sync": in_sync,
        "steps": args.max_train_steps,
        "train_seconds": round(seconds, 1),
    }
    prompts = default_validation_prompts(args)
    grid_path = None
    if prompts:
        summary["sample_prompts"] = prompts  # the card's usage snippet samples the first
        images = generate(pipe, prompts, args, seed=args.seed)
        grid_path = output_dir / "samples.png"
        make_image_grid(images, captions=prompts).save(grid_path)
    if args.shapes_world:
        reports = final_evaluation(pipe, args)
        summary.update(score_summary(reports))
        if args.lora_rank:  # the base model, by the same evaluation: what the adapter changed
            unwrapped.disable_adapters()
            before = final_evaluation(pipe, args)
            unwrapped.enable_adapters()
            summary.update(score_summary(before, suffix="_before"))
        summary["images_per_caption"] = FINAL_EVALUATION_SEEDS
        summary["evaluation_sampler"] = reports["train"]["sampler"]
        # The whole reports go to the logs folder (the scores are in the summary, which the run prints at the end).
        reports_path = output_dir / args.logging_dir / "evaluation.json"
        reports_path.parent.mkdir(parents=True, exist_ok=True)
        whole = {"adapted": reports, "base": before} if args.lora_rank else reports
        reports_path.write_text(json.dumps(whole, indent=1), encoding="utf-8")
    with open(output_dir / "training_summary.json", "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)
    if args.lora_rank:
        write_lora_card(output_dir, unwrapped, args=public_args(args), summary=summary, sample_grid=grid_path)
        logger.info(f"saved the LoRA adapter to {output_dir}")
    else:
        write_model_card(output_dir, pipe, args=public_args(args), summary=summary, sample_grid=grid_path)
        logger.info(f"saved the pipeline to {output_dir}")

    hub_url = None
    if args.push_to_hub:
        # The same upload as `python -m diffusers_lmlp.hub push`: safetensors, configs, tokenizer, images and the
        # card (its usage block names the repo), never checkpoints, logs or pickles; one commit.
        from diffusers_lmlp.hub import push_lora, push_pipeline

        push = push_lora if args.lora_rank else push_pipeline
        commit = push(
            output_dir, args.hub_model_id or output_dir.name, token=args.hub_token, commit_message="End of training"
        )
        logger.info(f"pushed to the Hub: {commit.commit_url}")
        hub_url = commit.commit_url
    # The last words of the run, for a person: where everything is, the scores and how to load the pipeline.
    logging_dir, validation_dir = output_dir / args.logging_dir, output_dir / "validation"
    text = format_run_summary(
        summary,
        output_dir,
        sample_grid=grid_path,
        validation_dir=validation_dir if validation_dir.is_dir() else None,
        logging_dir=logging_dir if logging_dir.is_dir() else None,
        hub_url=hub_url,
    )
    print(f"\n{text}", flush=True)


def leave_finished_process() -> None:
    """End a process of a finished multi-process run without the interpreter's finalization.

    By then everything is saved and closed and the process group is destroyed. The exit handlers still run
    (`atexit`: logging, file locks, multiprocessing children); what is skipped is the teardown of modules and C++
    statics, where torch's autograd and gloo threads can race the GIL's destruction and hang a process forever after a
    complete run (pytorch/pytorch#190489; seen here as a 2-process CPU run that never exited after saving everything).
    """
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def cli() -> None:
    """The command line: `python -m diffusers_lmlp.train`, `diffusers-lmlp-train`, examples/train_text_to_image.py."""
    main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        leave_finished_process()


if __name__ == "__main__":
    cli()
