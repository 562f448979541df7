"""The trainer's arguments: the option table and the presets. `parse_args` reads them, then
`training.argument_checks` refuses a wrong command at start-up with a message that says what to change.
No heavy library (diffusers, transformers, accelerate) is imported here, so `--help` and argument errors are fast.
"""

import argparse

from ..commands import program_name
from ..models.families import FAMILIES, named_configs
from ..sampling import GUIDANCE_SCALE, NUM_INFERENCE_STEPS
from ..shapes.pretrained import PIPELINE_PATH as SHAPES_PIPELINE_PATH
from . import argument_checks
from .data import DATA_LAYOUTS
from .diffusers_options import diffusers_only_options
from .features import TEXT_DTYPES
from .sources import COCO_TEXT_ENCODER_REPO, COCO_VAE_REPO


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
    # The embedded default: the procedural shapes world with the package's offline components, sized for a CPU.
    "shapes": dict(
        model_config="shapes-S",
        # A projection of the text encoder's last-position state added to every image token (docs/shapes-runs.md);
        # explicit --model_overrides are added to it (pooled_text_projection=false turns it off).
        model_overrides=["pooled_text_projection=true"],
        # bf16 autocast where the CPU (or GPU) runs it natively, else float32.
        mixed_precision="auto",
        # torch.compile where it works, for runs long enough to repay it.
        torch_compile="auto",
        resolution=32,
        train_batch_size=64,
        # Twice 5,200 steps: more shapes drawn right, their corners sharper (docs/shapes-runs.md#twice-the-steps).
        max_train_steps=10400,
        learning_rate=3e-3,
        # Cosine decay to 0 and a little weight decay; Min-SNR weighting moves the loss towards the noisy timesteps,
        # where the shape is decided (docs/shapes-runs.md).
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
        # tensorboard flushes its file at each log, which costs much next to a short step.
        logging_steps=10,
        # The pipeline's defaults (the papers' 50 steps and s = 1), with which the final scores are measured too.
        validation_inference_steps=NUM_INFERENCE_STEPS,
        validation_guidance_scale=GUIDANCE_SCALE,
        output_dir="lmlp-shapes",
    ),
    # The L-MLP paper's MS-COCO run (its F2 configuration and the U-ViT COCO recipe): F2-deep, SD VAE, CLIP L/14,
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
    # The emoji world: a UL-MLP drawing the Noto emoji from their names, with the world's VAE and CLIP text tower,
    # scored by the emoji CLIP's retrieval and by pixels (docs/emoji.md).
    "emoji": dict(
        model_config="emoji-S",
        model_overrides=["pooled_text_projection=true"],
        mixed_precision="auto",
        torch_compile="auto",
        resolution=32,
        train_batch_size=128,
        max_train_steps=4000,
        learning_rate=2e-3,
        lr_scheduler="cosine",
        snr_gamma=1.0,
        adam_beta2=0.99,
        adam_weight_decay=0.05,
        lr_warmup_steps=200,
        use_ema=True,
        ema_decay=0.999,
        cache_features=True,
        cache_text_dtype="float16",
        checkpointing_steps=1000,
        checkpoints_total_limit=2,
        validation_steps=500,
        logging_steps=10,
        validation_inference_steps=NUM_INFERENCE_STEPS,
        validation_guidance_scale=GUIDANCE_SCALE,
        output_dir="lmlp-emoji",
    ),
    # LoRA: teach the shapes model that ships in the package the 32 colour × shape × position combinations held out
    # of its training (a new attribute set); the final evaluation scores it before and after.
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
        logging_steps=10,
        validation_inference_steps=NUM_INFERENCE_STEPS,
        validation_guidance_scale=GUIDANCE_SCALE,
        output_dir="lmlp-shapes-lora",
    ),
}
# The presets that train on an embedded world (when no data is given) and score the result on it: preset → world.
WORLD_PRESETS = {"shapes": "shapes", "shapes-lora": "shapes", "emoji": "emoji"}


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
    model.add_argument(
        "--model_overrides",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="config values of a new model, e.g. num_layers=12; added to the preset's (the shapes preset sets "
        f"{' '.join(PRESETS['shapes']['model_overrides'])})",
    )
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
    data.add_argument(
        "--dataset_name", help="a datasets Hub id, a local dataset folder, or a folder written by save_to_disk"
    )
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
        help="CPU threads of a one-process CPU run (default: the OMP_NUM_THREADS you set outside accelerate launch, "
        "else every core). On busy cores, fewer threads run faster",
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
    out.add_argument(
        "--logging_steps", type=int, default=1,
        help="send the trackers the mean loss and gradient norm of every this many steps, and the learning rate (the "
        "shapes presets: 10; the progress bar shows every step)",
    )  # fmt: skip
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
        "--validation_guidance_scale", type=float, default=GUIDANCE_SCALE,
        help="guidance scale of the validation images (diffusers' g; the papers' s = g - 1)",
    )  # fmt: skip
    out.add_argument(
        "--final_evaluation_inference_steps",
        type=int,
        default=NUM_INFERENCE_STEPS,
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

    Returns:
        `argparse.Namespace`: The checked arguments, with `preset` and `world` settled.
    """
    parser = build_parser()
    # Presets change defaults only: read the preset first, then parse everything with its defaults in place.
    given = given_options(parser, argv)
    uses_data = bool({"dataset_name", "train_data_dir"} & given)
    known, unknown = parser.parse_known_args(argv)
    if explanations := diffusers_only_options(unknown):  # diffusers' options, with what to do instead
        parser.error("\n".join(explanations))
    preset = known.preset or (None if uses_data else ("shapes-lora" if known.lora_rank else "shapes"))
    if preset:
        parser.set_defaults(**PRESETS[preset])
    args = parser.parse_args(argv)
    args.preset = preset
    args.world = None if uses_data else WORLD_PRESETS.get(preset)
    args.model_config_from_preset = bool(preset) and "model_config" not in given
    args.mixed_precision_from_preset = bool(preset) and "mixed_precision" not in given
    preset_overrides = PRESETS[preset].get("model_overrides", []) if preset else []
    if "model_overrides" in given:  # a preset's model options stay unless named again (the last value of a key wins)
        args.model_overrides = [*preset_overrides, *args.model_overrides]
    elif args.pretrained_model_name_or_path:  # a saved model keeps its own configuration
        args.model_overrides = []
    argument_checks.validate_args(parser, args, given)
    return args


def given_options(parser: argparse.ArgumentParser, argv: list[str] | None) -> set[str]:
    """The destinations of the options given on the command line (abbreviated or not), as opposed to defaults.
    argparse fills in a default only where the namespace lacks the attribute, so a marker set for every option stays
    for each one not given."""
    unset = object()
    namespace = argparse.Namespace(**{a.dest: unset for a in parser._actions if a.dest != argparse.SUPPRESS})
    parsed, _ = parser.parse_known_args(argv, namespace)
    return {dest for dest, value in vars(parsed).items() if value is not unset}
