"""The trainer's arguments: the option table, the presets, and the checks that refuse a wrong command at start-up
with a message that says what to change.

This module imports no heavy library (diffusers, transformers, accelerate): `--help` and every argument error
return about as fast as `import torch`. A check that needs a model class's signature (`--model_config` values,
`--model_overrides`) imports that class only then.
"""

import argparse
import inspect
import json
import math
import typing
from pathlib import Path

from huggingface_hub.utils import HFValidationError, validate_repo_id

from ..commands import program_name
from ..evaluation.captions import draw_captions, read_captions_file
from ..folders import TOKENIZER_FILES
from ..models.families import FAMILIES, family_of, named_configs
from ..shapes.pretrained import PIPELINE_PATH as SHAPES_PIPELINE_PATH
from .checkpoint_folders import CHECKPOINT_PATTERN, list_checkpoints
from .data import DATA_LAYOUTS
from .features import TEXT_DTYPES
from .sources import COCO_TEXT_ENCODER_REPO, COCO_VAE_REPO, resolve_text_encoder, resolve_vae


# The console script setup.py installs for this command.
CONSOLE_SCRIPT = "diffusers-lmlp-train"
# The command's description (`--help`).
DESCRIPTION = """Train a text-to-image backbone of any of the package's block families (--model_type: the UL-MLP, the MoE-MLP, the
U-ViT baseline and the papers' other MLPs) with 🤗 accelerate, from a laptop CPU to many GPUs.

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
# `--lr_scheduler`: diffusers' `get_scheduler` names (tests/test_train_options.py checks them against diffusers').
LR_SCHEDULERS = (
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "piecewise_constant",
)
# `--preset NAME` sets these defaults; explicit arguments still win.
PRESETS = {
    # The embedded default: the procedural shapes world with the package's offline components, ≤ 10 min on 2 CPUs.
    "shapes": dict(
        model_config="shapes-S",
        # bf16 autocast where the CPU (or GPU) runs it natively: about 1.4× faster steps on avx512_bf16; else float32.
        mixed_precision="auto",
        # torch.compile where it works, for runs long enough to repay it: 9.5 → 15 steps/s here after ~20 s.
        torch_compile="auto",
        resolution=32,
        train_batch_size=64,
        max_train_steps=5200,
        learning_rate=3e-3,
        # Cosine decay to 0 and a little weight decay; Min-SNR weighting moves the loss towards the noisy timesteps,
        # where the shape is decided: held-out shape 99% at γ = 1, 94% at 2, 92% at 5, 77–80% without it
        # (docs/shapes-runs.md).
        lr_scheduler="cosine",
        snr_gamma=1.0,
        adam_beta2=0.99,
        adam_weight_decay=0.05,
        lr_warmup_steps=100,
        use_ema=True,
        # A short average: the model still improves fast at the end, and a longer one (0.995) lags behind it.
        ema_decay=0.99,
        cache_features=True,
        checkpointing_steps=1300,
        checkpoints_total_limit=2,
        validation_steps=1300,
        # The pipeline's defaults (the papers' 50 steps and s = 1), with which the final scores are measured too.
        validation_inference_steps=50,
        validation_guidance_scale=2.0,
        output_dir="lmlp-shapes",
    ),
    # The L-MLP paper's MS-COCO run (reference configs/lmlp_f2.py + the U-ViT COCO recipe): F2-deep, SD VAE, CLIP L/14,
    # batch 256 (32 per GPU on 8 GPUs; on one GPU add --gradient_accumulation_steps 8), 1M steps.
    "coco-f2": dict(
        model_config="F2-deep",
        pretrained_vae=COCO_VAE_REPO,  # the SD-v1 KL-f8 VAE, in the repo's vae/ folder
        pretrained_text_encoder=COCO_TEXT_ENCODER_REPO,
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


def model_class_of(model_type: str) -> type:
    """The backbone class of a `--model_type` (imported on first use).

    Args:
        model_type (`str`): A family name of `diffusers_lmlp.models.FAMILIES`.
    """
    return FAMILIES[model_type].model_class


def build_parser() -> argparse.ArgumentParser:
    """The trainer's options, with the diffusers example's names where it has them."""
    parser = argparse.ArgumentParser(
        prog=program_name(CONSOLE_SCRIPT, "diffusers_lmlp.train"),
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help="recipe defaults (default without data: shapes, or shapes-lora with --lora_rank)",
    )

    model = parser.add_argument_group("model")
    model.add_argument(
        "--model_type",
        choices=sorted(FAMILIES),
        help="the block family (default: --model_config's, else lmlp; or the base pipeline's)",
    )
    model.add_argument(
        "--model_config",
        help=f"a named configuration ({', '.join(named_configs())}) or a JSON file of config values "
        "(default: the family's defaults, the papers' COCO model)",
    )
    model.add_argument("--model_overrides", nargs="*", default=[], metavar="KEY=VALUE", help="e.g. num_layers=12")
    model.add_argument(
        "--pretrained_model_name_or_path",
        help="a saved LMLPPipeline (a folder or Hub id) to fine-tune, or to fine-tune with LoRA (--lora_rank)",
    )
    model.add_argument(
        "--revision", help="the Hub revision (branch, tag or commit) of --pretrained_model_name_or_path"
    )
    model.add_argument(
        "--variant",
        help="the weights variant of --pretrained_model_name_or_path's backbone, e.g. fp16 for "
        "diffusion_pytorch_model.fp16.safetensors",
    )

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
        "--pretrained_vae",
        help="Hub id or folder of an AutoencoderKL: a standalone VAE (stabilityai/sd-vae-ft-mse: config.json at its "
        f"root) or a pipeline with a vae/ folder (default: {COCO_VAE_REPO}, or the shapes VAE without data)",
    )
    components.add_argument(
        "--vae_subfolder",
        help="the VAE's folder inside --pretrained_vae ('' for its root); default: detected from the layout",
    )
    components.add_argument(
        "--pretrained_text_encoder",
        help="Hub id or folder of a CLIP tokenizer and text model: a CLIP repo (both at its root, as "
        f"{COCO_TEXT_ENCODER_REPO}, the default) or a pipeline with text_encoder/ and tokenizer/ folders",
    )
    components.add_argument(
        "--text_encoder_subfolder",
        help="the text model's folder inside --pretrained_text_encoder ('' for its root; the tokenizer is then read "
        "from tokenizer/ if there is one, else beside the model); default: detected from the layout",
    )
    components.add_argument("--latent_scale", type=float, help="latent scaling factor (default: the VAE config's)")

    data = parser.add_argument_group("data")
    data.add_argument("--dataset_name", help="a datasets Hub id or a local dataset script/folder")
    data.add_argument("--dataset_config_name", help="the configuration of --dataset_name, if it has several")
    data.add_argument(
        "--streaming", action="store_true",
        help="read --dataset_name as a stream instead of downloading it whole (no --cache_features)",
    )  # fmt: skip
    data.add_argument(
        "--train_data_dir",
        help="a local folder: an imagefolder with metadata.jsonl/.csv/.parquet, or the COCO-2014 folder (detected)",
    )
    data.add_argument(
        "--data_layout", choices=DATA_LAYOUTS, default="auto",
        help="how --train_data_dir is laid out: auto (COCO-2014 when the folder holds "
        "annotations/captions_train2014.json and train2014/, an imagefolder otherwise), imagefolder (images + "
        "metadata.jsonl, .csv or .parquet; file names never split the data), or coco2014 (the official COCO-2014 "
        "folder: annotations/captions_train2014.json and train2014/*.jpg; one sample per image, one of its captions "
        "picked at random at each use)",
    )  # fmt: skip
    data.add_argument(
        "--shapes_split", choices=("train", "heldout"), default="train",
        help="without data, the shapes world's combinations to train on: train (292 of them), or heldout (the 32 held "
        "out of the shipped model's training: the shapes-lora preset's new attribute set)",
    )  # fmt: skip
    data.add_argument(
        "--shapes_num_images", type=int,
        help="without data, how many images of the shapes world to render and train on, each combination equally "
        "often and each image with its own jitter (default: 8000 of train, 800 of heldout)",
    )  # fmt: skip
    data.add_argument("--image_column", default="image", help="the column of the images (default: image)")
    data.add_argument(
        "--caption_column", default="text",
        help="the column of the captions: a caption or a list of them per image (default: text)",
    )  # fmt: skip
    data.add_argument("--max_train_samples", type=int, help="train on the first N samples only (for quick runs)")
    data.add_argument(
        "--resolution", type=int, default=256,
        help="the side of the square training images in pixels, after a centre crop: the backbone's sample_size × "
        "the VAE's factor (256 for the papers' models, 32 for the shapes world)",
    )  # fmt: skip
    data.add_argument("--random_flip", action="store_true", help="mirror each image left to right at random")
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
    train.add_argument(
        "--seed", type=int, default=0,
        help="seeds the initial weights and every draw of the run (data order, noise, timesteps): a run is "
        "reproducible from it, and resumes exactly",
    )  # fmt: skip
    train.add_argument("--train_batch_size", type=int, default=16, help="per device, per accumulation step")
    train.add_argument("--max_train_steps", type=int, default=10_000, help="optimizer steps to train for")
    train.add_argument(
        "--gradient_accumulation_steps", type=int, default=1,
        help="micro-batches per optimizer step: the batch per step is --train_batch_size × this × the processes",
    )  # fmt: skip
    train.add_argument(
        "--gradient_checkpointing", action="store_true",
        help="recompute each block's activations in the backward pass: much less activation memory, for one more "
        "forward of each block per step",
    )  # fmt: skip
    train.add_argument("--learning_rate", type=float, default=2e-4, help="AdamW's peak learning rate")
    train.add_argument("--adam_beta1", type=float, default=0.9, help="AdamW's beta1")
    train.add_argument("--adam_beta2", type=float, default=0.9, help="AdamW's beta2 (the papers' recipe: 0.9)")
    train.add_argument("--adam_weight_decay", type=float, default=0.03, help="AdamW's decoupled weight decay")
    train.add_argument("--adam_epsilon", type=float, default=1e-8, help="AdamW's epsilon")
    train.add_argument("--max_grad_norm", type=float, help="clip gradients to this norm (off by default)")
    train.add_argument(
        "--lr_scheduler", default="constant_with_warmup", choices=LR_SCHEDULERS,
        help="the learning-rate schedule after --lr_warmup_steps of linear warm-up (diffusers' get_scheduler)",
    )  # fmt: skip
    train.add_argument("--lr_warmup_steps", type=int, default=5000, help="steps of linear warm-up from 0")
    train.add_argument("--snr_gamma", type=float, help="Min-SNR loss weighting (5.0 is the usual value)")
    train.add_argument(
        "--noise_offset", type=float, default=0.0, help="scale of a per-channel offset added to the noise (0: off)"
    )
    train.add_argument("--load_balance_weight", type=float, default=0.0, help="MoE-MLP balancing loss (paper: 0.01)")
    train.add_argument(
        "--symmetry_breaking_weight",
        type=float,
        default=0.0,
        help="AsymMixer's penalty λ·Σ‖W̃‖²_F (the ParaMixer paper sweeps 1e-6 to 1)",
    )
    train.add_argument(
        "--use_ema", action=argparse.BooleanOptionalAction, default=False,
        help="keep an exponential moving average of the weights, saved as the pipeline's weights",
    )  # fmt: skip
    train.add_argument("--ema_decay", type=float, default=0.9999, help="the EMA's decay per step")
    train.add_argument(
        "--num_threads", type=int,
        help="CPU threads of a one-process CPU run (default: the OMP_NUM_THREADS you set, else every core; "
        "accelerate launch's own OMP_NUM_THREADS=1 is not taken for yours). On busy cores, fewer threads run faster",
    )  # fmt: skip
    train.add_argument(
        "--mixed_precision", choices=["no", "fp16", "bf16", "auto"],
        help="autocast the backbone's forward (default: accelerate's config; the shapes preset: auto); bf16 runs on "
        "Ampere or newer GPUs and on CPU, fp16 on GPUs only; auto is bf16 where it is native (a GPU that supports it, a "
        "CPU with avx512_bf16 or AMX) and float32 elsewhere, unless accelerate launch set a precision",
    )  # fmt: skip
    train.add_argument(
        "--torch_compile", choices=["yes", "no", "auto"],
        help="compile the backbone with torch.compile (inductor) for training (default: accelerate's config, "
        "accelerate launch --dynamo_backend; the shapes preset: auto); auto compiles where a trial compilation works "
        "(a C++ compiler on a CPU, Triton on a GPU) and the run has >= 1000 steps to repay it, unless accelerate launch "
        "chose a backend. Validation and the saved pipeline use the plain backbone",
    )  # fmt: skip
    train.add_argument(
        "--allow_tf32", action="store_true",
        help="let float32 matmuls and convolutions use TF32 on Ampere and newer NVIDIA GPUs (faster, 10-bit "
        "mantissa); no effect on CPU",
    )  # fmt: skip

    out = parser.add_argument_group("output, logging, validation")
    out.add_argument(
        "--output_dir", default="lmlp-model", help="where the pipeline, checkpoints, samples and logs are written"
    )
    out.add_argument(
        "--overwrite_output_dir", action="store_true",
        help="train from step 0 into an --output_dir that already holds a run (its checkpoints are replaced as the "
        "new run reaches their steps); without it such a folder is refused, unless --resume_from_checkpoint",
    )  # fmt: skip
    out.add_argument("--logging_dir", default="logs", help="the trackers' folder, inside --output_dir")
    out.add_argument("--report_to", default="tensorboard", help='"tensorboard", "wandb", "all" or "none"')
    out.add_argument(
        "--tracker_project_name", default="lmlp-text-to-image", help="the project name in tensorboard or wandb"
    )
    prompts = out.add_mutually_exclusive_group()
    prompts.add_argument(
        "--validation_prompts", nargs="*",
        help="prompts sampled every --validation_steps and at the end (default: shapes captions on the shapes world)",
    )  # fmt: skip
    prompts.add_argument(
        "--validation_prompts_file", metavar="PATH",
        help="a UTF-8 text file of validation prompts, one per line; blank lines and lines starting with # are skipped",
    )  # fmt: skip
    out.add_argument(
        "--validation_steps", type=int, default=1000,
        help="sample the validation prompts (and the FID of --validation_fid_images) every N steps",
    )  # fmt: skip
    out.add_argument(
        "--validation_inference_steps", type=int, default=25, help="sampler steps of the validation images"
    )
    out.add_argument(
        "--validation_guidance_scale", type=float, default=2.0,
        help="guidance scale of the validation images (diffusers' g; the papers' s = g - 1)",
    )  # fmt: skip
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
    out.add_argument(
        "--checkpointing_steps", type=int, default=1000,
        help="write a checkpoint (weights, optimizer, EMA, data position) every N steps, and at the end",
    )  # fmt: skip
    out.add_argument(
        "--checkpoints_total_limit", type=int,
        help="keep the newest N checkpoints (the oldest is removed once the new one is complete: N + 1 for a moment)",
    )  # fmt: skip
    out.add_argument(
        "--resume_from_checkpoint",
        help='"latest" or a checkpoint folder; an older one abandons the later checkpoints, overwritten as reached',
    )
    out.add_argument(
        "--push_to_hub", action="store_true",
        help="upload the finished pipeline (or LoRA) to the Hub, as `python -m diffusers_lmlp.hub push` does",
    )  # fmt: skip
    out.add_argument("--hub_model_id", help="the Hub repo to push to (default: --output_dir's name, under your user)")
    out.add_argument("--hub_token", help="used for the upload only: never logged, tracked or written to the output")

    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and check the options; exit (2) with a message that says what to change when one is wrong.

    Args:
        argv (`list[str]`, *optional*): The arguments; `sys.argv[1:]` when None.
    """
    parser = build_parser()
    # Presets change defaults only: read the preset first, then parse everything with its defaults in place.
    given = given_options(parser, argv)
    uses_data = bool({"dataset_name", "train_data_dir"} & given)
    known, _ = parser.parse_known_args(argv)
    preset = known.preset or (None if uses_data else ("shapes-lora" if known.lora_rank else "shapes"))
    if preset:
        parser.set_defaults(**PRESETS[preset])
    args = parser.parse_args(argv)
    args.preset = preset
    args.shapes_world = preset in SHAPES_WORLD_PRESETS and not uses_data
    args.model_config_from_preset = bool(preset) and "model_config" not in given
    args.mixed_precision_from_preset = bool(preset) and "mixed_precision" not in given
    validate_args(parser, args, given)
    return args


def given_options(parser: argparse.ArgumentParser, argv: list[str] | None) -> set[str]:
    """The destinations of the options given on the command line (abbreviated or not), as opposed to defaults.

    argparse fills in a default only where the namespace lacks the attribute, so a namespace holding a marker for
    every option keeps the marker for each option not given.

    Args:
        parser (`argparse.ArgumentParser`): The parser.
        argv (`list[str]`, *optional*): The arguments (`sys.argv[1:]` when None).
    """
    unset = object()
    namespace = argparse.Namespace(**{a.dest: unset for a in parser._actions if a.dest != argparse.SUPPRESS})
    parsed, _ = parser.parse_known_args(argv, namespace)
    return {dest for dest, value in vars(parsed).items() if value is not unset}


def validate_args(parser: argparse.ArgumentParser, args: argparse.Namespace, given: set[str] = frozenset()) -> None:
    """Fail at start-up, with a message that says what to change, rather than after minutes of set-up.

    Args:
        parser (`argparse.ArgumentParser`): The parser, whose `error` prints the message and exits (2).
        args (`argparse.Namespace`): The parsed arguments.
        given (`set[str]`, *optional*): The options given on the command line (`given_options`).
    """
    if args.dataset_name and args.train_data_dir:
        parser.error("pass either --dataset_name or --train_data_dir, not both")
    validate_lora_args(parser, args)
    if args.preset == "coco-f2" and not (args.dataset_name or args.train_data_dir):
        parser.error(
            "--preset coco-f2 needs the COCO images: pass --train_data_dir with the COCO-2014 folder (annotations/ "
            "and train2014/), or --train_data_dir with an imagefolder, or --dataset_name"
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
    if args.shapes_num_images is not None:
        if args.shapes_num_images < 1:
            parser.error(f"--shapes_num_images must be >= 1, got {args.shapes_num_images}")
        if not args.shapes_world:
            parser.error("--shapes_num_images sizes the shapes world, which your data replaces: leave it out")
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
    if "validation_steps" in given and not (
        args.validation_prompts or args.shapes_world or args.validation_fid_images
    ):
        parser.error(
            f"--validation_steps {args.validation_steps} samples validation prompts, and your data has none: pass "
            "--validation_prompts (or --validation_prompts_file), or --validation_fid_images, or drop "
            "--validation_steps"
        )
    try:
        check_component_sources(args)
    except ValueError as error:
        parser.error(str(error))
    if args.push_to_hub:  # checked now, not after hours of training
        from huggingface_hub import constants

        from diffusers_lmlp.hub.upload import check_repo_id, require_token

        try:
            check_repo_id(args.hub_model_id or Path(args.output_dir).name, "--hub_model_id")
        except ValueError as error:
            parser.error(str(error))
        if constants.HF_HUB_OFFLINE:
            parser.error(
                "--push_to_hub uploads at the end of training, but HF_HUB_OFFLINE=1 forbids any request to the Hub: "
                "unset HF_HUB_OFFLINE, or drop --push_to_hub and upload the finished folder later with "
                f"`python -m diffusers_lmlp.hub push {args.output_dir} <user>/<name>`"
            )
        try:
            require_token(args.hub_token, option="--hub_token")
        except ValueError as error:
            parser.error(str(error))
    if args.num_threads is not None and args.num_threads < 1:
        parser.error(f"--num_threads must be >= 1, got {args.num_threads}")
    if args.overwrite_output_dir and args.resume_from_checkpoint:
        parser.error("--overwrite_output_dir trains anew, --resume_from_checkpoint continues a run: pass one of them")
    if not (args.overwrite_output_dir or args.resume_from_checkpoint):
        held = earlier_run(Path(args.output_dir))
        if held:
            parser.error(
                f"--output_dir {args.output_dir} already holds {held}. Pass --resume_from_checkpoint latest to continue "
                "that run, --overwrite_output_dir to train anew over it, or another --output_dir"
            )
    if args.model_overrides and args.pretrained_model_name_or_path:
        parser.error(
            "--model_overrides configures a new model; --pretrained_model_name_or_path fine-tunes a saved one, whose "
            "configuration is kept: drop one of them"
        )
    if not args.pretrained_model_name_or_path:  # a base pipeline's backbone is resolved when it is read
        resolve_model_type(parser, args)
    try:
        args.model_overrides = parse_overrides(args.model_overrides, model_class_of(args.model_type or "lmlp"))
    except ValueError as error:
        parser.error(str(error))


def earlier_run(output_dir: Path) -> str | None:
    """What of an earlier run `output_dir` holds (a finished run, checkpoints), in words; None if nothing.

    Args:
        output_dir (`Path`): The `--output_dir`.
    """
    if (output_dir / "training_summary.json").is_file():
        return "a finished run (training_summary.json)"
    checkpoints = list_checkpoints(output_dir) if output_dir.is_dir() else []
    if checkpoints:
        return f"the checkpoints of an earlier run (the last: {checkpoints[-1].name})"
    return None


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
    args.model_config_values = None
    if config is not None and config.endswith(".json"):
        try:
            args.model_config_values, config_family = read_model_config_file(Path(config))
        except ValueError as error:
            parser.error(str(error))
        if config_family is not None and args.model_type not in (None, config_family):
            parser.error(f"--model_config {config} is a --model_type {config_family} config (its _class_name)")
        args.model_type = args.model_type or config_family or "lmlp"
        try:
            check_config_values(args.model_config_values, model_class_of(args.model_type), f"--model_config {config}")
        except ValueError as error:
            parser.error(str(error))
        args.model_skeleton = {}
        return
    if config is not None and config not in named:
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
    overrides = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep:
            raise ValueError(f"--model_overrides takes KEY=VALUE pairs, got {pair!r}; {accepted_keys(model_class)}")
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text
        check_config_values({key: value}, model_class, f"--model_overrides {pair}", shown={key: text})
        overrides[key] = value
    return overrides


def accepted_keys(model_class: type) -> str:
    """The config keys of a backbone class (its `__init__` arguments), in words, for messages."""
    keys = sorted(name for name in inspect.signature(model_class.__init__).parameters if name != "self")
    return f"the accepted keys of {model_class.__name__} are {', '.join(keys)}"


def check_config_values(values: dict, model_class: type, source: str, shown: dict | None = None) -> None:
    """Refuse config values that `model_class` does not take: unknown keys, and values of another type than the
    argument's annotation.

    Args:
        values (`dict`): Config values (keys starting with `_`, such as a saved config's `_class_name`, are skipped).
        model_class (`type`): The backbone class whose `__init__` arguments are the accepted keys.
        source (`str`): Where the values come from, for the message (`"--model_config my.json"`).
        shown (`dict`, *optional*): How to show each value in the message (as the user wrote it); default: repr.

    Raises:
        `ValueError`: Naming the key and listing the accepted ones, or naming the types the key takes.
    """
    parameters = inspect.signature(model_class.__init__, eval_str=True).parameters
    for key, value in values.items():
        if key.startswith("_"):
            continue
        if key not in parameters or key == "self":
            raise ValueError(f"{source}: unknown config key {key!r}; {accepted_keys(model_class)}")
        kinds = typing.get_args(parameters[key].annotation) or (parameters[key].annotation,)  # int | None → both
        if not value_fits(value, kinds):
            names = " or ".join("null" if kind is type(None) else kind.__name__ for kind in kinds)
            written = (shown or {}).get(key, json.dumps(value))
            raise ValueError(f"{source}: {key} takes {names}, got {written!r}")


def read_model_config_file(path: Path) -> tuple[dict, str | None]:
    """The config values of a `--model_config` JSON file, and the family its `_class_name` names, if any (a saved
    backbone's `config.json` records it).

    Args:
        path (`Path`): The JSON file.

    Raises:
        `ValueError`: For a missing file, invalid JSON, or JSON that is not an object.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise ValueError(f"--model_config {path}: cannot read it ({error.strerror or error})") from None
    try:
        values = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"--model_config {path} is not valid JSON: {error}") from None
    if not isinstance(values, dict):
        raise ValueError(
            f"--model_config {path} must hold a JSON object of config values, got {type(values).__name__}"
        )
    class_name = values.get("_class_name")
    try:
        family = family_of(class_name).name if isinstance(class_name, str) else None
    except ValueError as error:
        raise ValueError(f"--model_config {path}: {error}") from None
    return {k: v for k, v in values.items() if not k.startswith("_")}, family


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
    # The papers' components when training on data without a base pipeline; a base pipeline's or the shapes world's
    # own otherwise, unless --pretrained_vae / --pretrained_text_encoder replace them.
    defaults = not args.pretrained_model_name_or_path and not args.shapes_world
    text = args.pretrained_text_encoder or (COCO_TEXT_ENCODER_REPO if defaults else None)
    vae = args.pretrained_vae or (COCO_VAE_REPO if defaults else None)
    args.text_encoder_source = resolve_text_encoder(text, args.text_encoder_subfolder) if text else None
    args.vae_source = resolve_vae(vae, args.vae_subfolder) if vae else None


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
