"""The start-up checks of the trainer's arguments (`training.arguments`): each refuses a wrong command with a message
that says what to change, before minutes of set-up; a few settle what the options leave open (the backbone's family
and configuration, where the frozen components load from). No heavy library is imported: a check that needs a model
class's signature imports that class only then.
"""

import argparse
import inspect
import json
import math
import typing
from pathlib import Path

from huggingface_hub.utils import HFValidationError, validate_repo_id

from ..evaluation.captions import draw_captions, read_captions_file
from ..folders import TOKENIZER_FILES
from ..models.families import FAMILIES, family_of, named_configs
from .checkpoint_folders import CHECKPOINT_PATTERN, list_checkpoints
from .sources import COCO_TEXT_ENCODER_REPO, COCO_VAE_REPO, resolve_text_encoder, resolve_vae


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


def model_class_of(model_type: str) -> type:
    """The backbone class of a `--model_type` family name (imported on first use)."""
    return FAMILIES[model_type].model_class


def validate_args(parser: argparse.ArgumentParser, args: argparse.Namespace, given: set[str] = frozenset()) -> None:
    """Fail at start-up, through `parser.error` (exit 2), with a message that says what to change, rather than after
    minutes of set-up; `given` holds the options given on the command line (`given_options`)."""
    if args.dataset_name and args.train_data_dir:
        parser.error("pass either --dataset_name or --train_data_dir, not both")
    validate_lora_args(parser, args)
    check_data_args(parser, args)
    check_training_values(parser, args)
    check_validation_args(parser, args, given)
    try:
        check_component_sources(args)
    except ValueError as error:
        parser.error(str(error))
    check_push_to_hub(parser, args)
    if args.num_threads is not None and args.num_threads < 1:
        parser.error(f"--num_threads must be >= 1, got {args.num_threads}")
    check_output_dir(parser, args)
    check_model_args(parser, args)


def check_data_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Where the data comes from, and how it is read and cached."""
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


def check_training_values(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The numbers of the run (each in its range) and the checkpoint to resume from."""
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
        "logging_steps",
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
        if args.world != "shapes":
            parser.error("--shapes_num_images sizes the shapes world, which this run does not train on: leave it out")
    if not 0.0 <= args.caption_dropout < 1.0:
        parser.error(f"--caption_dropout must be in [0, 1), got {args.caption_dropout}")
    if not 0 <= args.seed < 2**32:
        # numpy's seeds, which accelerate's set_seed sets too, are 32-bit; -1 is not "random" here.
        parser.error(
            f"--seed must be in [0, 2**32 - 1], got {args.seed}: every draw of a run comes from it, so that the run "
            "can be reproduced and resumed; pick any number in that range"
        )


def check_validation_args(parser: argparse.ArgumentParser, args: argparse.Namespace, given: set[str]) -> None:
    """What the validations sample: FID's captions and reference, the prompts file, and that there is something."""
    if args.validation_fid_images < 0:
        parser.error(
            f"--validation_fid_images must be >= 0 (0: no FID during training), got {args.validation_fid_images}"
        )
    if args.validation_fid_images and not args.world:
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
    if "validation_steps" in given and not (args.validation_prompts or args.world or args.validation_fid_images):
        parser.error(
            f"--validation_steps {args.validation_steps} samples validation prompts, and your data has none: pass "
            "--validation_prompts (or --validation_prompts_file), or --validation_fid_images, or drop "
            "--validation_steps"
        )


def check_push_to_hub(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """`--push_to_hub`: checked now (repo id, network, token), not after hours of training."""
    if args.push_to_hub:
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


def check_output_dir(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """`--output_dir`: a run never trains over an earlier one unless told which way to go."""
    if args.overwrite_output_dir and args.resume_from_checkpoint:
        parser.error("--overwrite_output_dir trains anew, --resume_from_checkpoint continues a run: pass one of them")
    if not (args.overwrite_output_dir or args.resume_from_checkpoint):
        held = earlier_run(Path(args.output_dir))
        if held:
            parser.error(
                f"--output_dir {args.output_dir} already holds {held}. Pass --resume_from_checkpoint latest to continue "
                "that run, --overwrite_output_dir to train anew over it, or another --output_dir"
            )


def check_model_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Settle the backbone's family and configuration, and check `--model_overrides` against it."""
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
    """What of an earlier run `output_dir` holds (a finished run, checkpoints), in words; None if nothing."""
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
    """Settle --model_type and --model_config for a new model: the family is --model_type, else the named
    configuration's, else lmlp. A preset's named configuration of another family lends it its skeleton
    (`SKELETON_FIELDS`), which explicit --model_overrides still replace."""
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
    """`--model_overrides` `KEY=VALUE` pairs as config values (JSON, else a string), checked against `model_class`'s
    `__init__`; the `ValueError` for a wrong pair lists the accepted keys."""
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
    """Refuse config values that `model_class` does not take (unknown keys, values not of the argument's annotated
    type), naming `source`; `shown` says how to show each value (as the user wrote it). Keys starting with `_` are
    skipped."""
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
    """The config values of a `--model_config` JSON file, and the family its `_class_name` names if any (a saved
    backbone's `config.json` records it); `ValueError` for a missing file, invalid JSON or not an object."""
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
    """Whether a decoded JSON value is of one of the annotated types `kinds` (a bool is no int; an int is a float)."""
    if inspect.Parameter.empty in kinds:
        return True
    if isinstance(value, bool):
        return bool in kinds
    return isinstance(value, kinds) or (isinstance(value, int) and float in kinds)


def check_component_sources(args: argparse.Namespace) -> None:
    """Name a missing local folder or file of a base pipeline or frozen component before loading turns it into a
    confusing error (an empty tokenizer, a failed download); then set `args.text_encoder_source` and
    `args.vae_source`."""
    option = "--pretrained_model_name_or_path"
    if args.pretrained_model_name_or_path and is_local(args.pretrained_model_name_or_path, option):
        base = Path(args.pretrained_model_name_or_path)
        if not (base / "model_index.json").is_file():
            raise ValueError(f"{option} {base} is not a saved pipeline: it has no model_index.json")
        for name in ("transformer", "vae", "text_encoder"):
            require_files(option, base, name, ("config.json",), f"the {name}")
        require_files(option, base, "tokenizer", TOKENIZER_FILES, "the tokenizer")
    # The papers' components when training on data without a base pipeline; a base pipeline's or the world's own
    # otherwise, unless --pretrained_vae / --pretrained_text_encoder replace them.
    defaults = not args.pretrained_model_name_or_path and not args.world
    text = args.pretrained_text_encoder or (COCO_TEXT_ENCODER_REPO if defaults else None)
    vae = args.pretrained_vae or (COCO_VAE_REPO if defaults else None)
    args.text_encoder_source = resolve_text_encoder(text, args.text_encoder_subfolder) if text else None
    args.vae_source = resolve_vae(vae, args.vae_subfolder) if vae else None


def is_local(source: str, option: str) -> bool:
    """Whether a component source is a local folder; if not, it must be a valid Hub repo id (else `ValueError`)."""
    if Path(source).is_dir():
        return True
    try:
        validate_repo_id(source)
    except HFValidationError:
        raise ValueError(f"{option} {source}: no such folder") from None
    return False


def require_files(option: str, source: Path, subfolder: str, files: tuple[str, ...], what: str) -> None:
    """Require the folder `source/subfolder` holding at least one of `files`; otherwise a `ValueError` naming
    `option` and `what` (e.g. "the tokenizer")."""
    folder = source / subfolder
    if not folder.is_dir():
        raise ValueError(f"{option} {source} has no {subfolder}/ folder: {what} is missing")
    if not any((folder / name).is_file() for name in files):
        raise ValueError(f"{option} {source}: {what} folder {folder} has no {' or '.join(files)}")
