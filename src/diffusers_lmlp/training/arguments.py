"""The trainer's command line: the option table and presets (`build_parser`, `parse_args`), the start-up checks that
refuse a wrong command with a message that says what to change, diffusers' options this script does not take, and
what the checks read: how checkpoint folders are named and where the frozen VAE and text encoder come from (a local
folder or Hub id, standalone or a pipeline's). No heavy library (diffusers, transformers, accelerate) is imported
here, so `--help` and argument errors are fast; the loaders import theirs when they run.
"""

import argparse
import contextlib
import inspect
import json
import logging
import re
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from huggingface_hub.utils import HFValidationError, validate_repo_id

from ..commands import number, program_name
from ..evaluation.captions import draw_captions, read_captions_file
from ..folders import TOKENIZER_FILES
from ..models.families import FAMILIES, family_of, named_configs
from ..sampling import GUIDANCE_SCALE, NUM_INFERENCE_STEPS
from ..shapes.pretrained import PIPELINE_PATH as SHAPES_PIPELINE_PATH
from .data import DATA_LAYOUTS
from .features import TEXT_DTYPES


# A checkpoint is only ever complete under this name. A killed run may leave an operation under way, which the next
# one cleans up: `.checkpoint-N.tmp` (being written) and `.checkpoint-N.deleting` are removed; `.checkpoint-N.old`
# (set aside while checkpoint-N is replaced) is removed, or renamed back when checkpoint-N is missing.
CHECKPOINT_PATTERN = re.compile(r"^checkpoint-(\d+)$")
UNDER_WAY_PATTERN = re.compile(r"^\.checkpoint-(\d+)\.(tmp|old|deleting)$")
# The run's own state inside a checkpoint: {"step": ..., "train_seconds": ...}.
STATE_FILE = "training_state.json"
# Held (flock) by the main process of the run that uses the output folder.
LOCK_FILE = ".train.lock"
SUMMARY_FILE = "training_summary.json"  # written last: a folder with it holds a finished run


def checkpoint_step(path: Path) -> int:
    """The step of a `checkpoint-N` folder.

    Args:
        path (`Path`): The checkpoint folder.
    """
    return int(CHECKPOINT_PATTERN.match(path.name).group(1))


def list_checkpoints(output_dir: Path) -> list[Path]:
    """The complete checkpoints, oldest first (an interrupted write, `.checkpoint-N.tmp`, never appears here).

    Args:
        output_dir (`Path`): The `--output_dir`.
    """
    found = [p for p in output_dir.glob("checkpoint-*") if p.is_dir() and CHECKPOINT_PATTERN.match(p.name)]
    return sorted(found, key=checkpoint_step)


# The files the trainer reads of the papers' components (docs/coco.md's `hf download` lines name exactly these).
COCO_VAE_REPO = "CompVis/stable-diffusion-v1-4"
COCO_VAE_FILES = ("vae/config.json", "vae/diffusion_pytorch_model.safetensors")
COCO_TEXT_ENCODER_REPO = "openai/clip-vit-large-patch14"
COCO_TEXT_ENCODER_FILES = (
    "config.json",
    "model.safetensors",
    "vocab.json",
    "merges.txt",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "preprocessor_config.json",  # read by the CLIP score of the evaluation, not by training
)
# A component's folder inside a full pipeline.
VAE_FOLDER, TEXT_ENCODER_FOLDER, TOKENIZER_FOLDER = "vae", "text_encoder", "tokenizer"
# The weights file of each component, as diffusers and transformers name it (`<name>.safetensors`, or shards listed in
# `<name>.safetensors.index.json`).
VAE_WEIGHTS, TEXT_ENCODER_WEIGHTS = "diffusion_pytorch_model", "model"
# The CLIP tokenizer's files: a fast tokenizer's `tokenizer.json`, or a slow one's vocabulary and merges, and settings.
TOKENIZER_FILE_NAMES = (*TOKENIZER_FILES, "merges.txt", "tokenizer_config.json", "special_tokens_map.json")
# The tensors of a full CLIP checkpoint that its text model does not use: the vision tower, projections, logit scale.
CLIP_OTHER_TENSORS = ("vision_model.", "visual_projection.", "text_projection.", "logit_scale")


def in_folder(folder: str, name: str) -> str:
    """The POSIX path of the file `name` in `folder` of a source (`""`: its root)."""
    return f"{folder}/{name}" if folder else name


@dataclass(frozen=True)
class VaeSource:
    """Where the VAE loads from: `source` (a local folder or Hub repo id) and its `subfolder` (`""`: the root)."""

    source: str
    subfolder: str


@dataclass(frozen=True)
class TextEncoderSource:
    """Where the tokenizer and the text encoder load from: `source` (a local folder or Hub repo id) and the text
    model's and the tokenizer's folders in it (`""`: the root)."""

    source: str
    subfolder: str
    tokenizer_subfolder: str


class Location:
    """Reads the files of a local folder or Hub repo id `source` to tell its layout; `ValueError` when it is neither
    (`option` names it in the messages)."""

    def __init__(self, source: str, option: str, revision: str | None = None):
        self.source, self.option, self.revision = source, option, revision
        self.local = Path(source).is_dir()
        if not self.local:
            try:
                validate_repo_id(source)
            except HFValidationError:
                raise ValueError(f"{option} {source}: no such folder") from None

    def has(self, path: str) -> bool | None:
        """Whether the source has the file `path` (POSIX, relative); None when a Hub repo cannot be asked (offline,
        and the cache does not know)."""
        if self.local:
            return (Path(self.source) / path).is_file()
        from huggingface_hub import constants, file_exists, try_to_load_from_cache

        cached = try_to_load_from_cache(self.source, path, revision=self.revision)
        if isinstance(cached, str):
            return True
        if cached is not None:  # the cache recorded that the repo has no such file
            return False
        if constants.HF_HUB_OFFLINE:
            return None
        try:
            return file_exists(self.source, path, revision=self.revision)
        except Exception:  # no connection, a private repo without a token, ...: loading will say what is wrong
            return None

    def config(self, path: str) -> dict | None:
        """The JSON file `path` of a local source, or of a Hub source's cache; None if not at hand."""
        if self.local:
            file = Path(self.source) / path
        else:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(self.source, path, revision=self.revision)
            file = Path(cached) if isinstance(cached, str) else None
        if file is None or not file.is_file():
            return None
        try:
            config = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return config if isinstance(config, dict) else None

    def unreachable(self, what: str, files: list[str]) -> ValueError:
        """The error for a Hub source whose files are neither in the cache nor reachable."""
        from huggingface_hub import constants

        why = (
            "HF_HUB_OFFLINE=1 keeps it from downloading"
            if constants.HF_HUB_OFFLINE
            else "the Hub could not be reached, or the repo is private (log in with `hf auth login`)"
        )
        return ValueError(
            f"{self.option} {self.source}: {what} ({' or '.join(files)}) is not in the Hugging Face cache, and {why}. "
            f"Fetch the files once, e.g. `hf download {self.source} {files[0]}` and the weights beside it (docs/coco.md "
            f"lists the exact files), or pass a local folder with {self.option}."
        )


def is_vae_config(config: dict | None) -> bool:
    """Whether a `config.json` is a diffusers autoencoder's (its `_class_name`, or a VAE's fields)."""
    if not config:
        return False
    name = config.get("_class_name")
    return name.startswith("Autoencoder") if isinstance(name, str) else "latent_channels" in config


def resolve_vae(
    source: str, subfolder: str | None, option: str = "--pretrained_vae", revision: str | None = None
) -> VaeSource:
    """Where the VAE of `source` is: its root (a standalone VAE) or its `vae/` folder (a full pipeline). A `subfolder`
    (`--vae_subfolder`) is used as given, None detects; a `ValueError` names what the source lacks."""
    location = Location(source, option, revision)
    if subfolder is not None:
        config = f"{subfolder}/config.json" if subfolder else "config.json"
        if location.local and not location.has(config):
            raise ValueError(
                f"{option} {source}: --vae_subfolder {subfolder!r} has no config.json ({Path(source) / config} is "
                "missing); leave --vae_subfolder out to detect the layout"
            )
        return VaeSource(source, subfolder)
    root, nested = location.has("config.json"), location.has(f"{VAE_FOLDER}/config.json")
    if root and (is_vae_config(location.config("config.json")) or not nested):
        return VaeSource(source, "")
    if nested:
        return VaeSource(source, VAE_FOLDER)
    if root is None or nested is None:
        raise location.unreachable("the VAE", ["config.json", f"{VAE_FOLDER}/config.json"])
    raise ValueError(
        f"{option} {source} holds no VAE: it has neither a config.json (a standalone VAE, as "
        f"stabilityai/sd-vae-ft-mse) nor {VAE_FOLDER}/config.json (a pipeline, as {COCO_VAE_REPO})"
    )


def resolve_text_encoder(
    source: str, subfolder: str | None, option: str = "--pretrained_text_encoder", revision: str | None = None
) -> TextEncoderSource:
    """Where the text encoder and tokenizer of `source` are: side by side at its root (a CLIP repo) or in
    `text_encoder/` and `tokenizer/` (a full pipeline). A given `subfolder` is used as is, the tokenizer then read from
    `tokenizer/` if there is one, else beside the model; a `ValueError` names what the source lacks."""
    location = Location(source, option, revision)
    if subfolder is None:
        nested, root = location.has(f"{TEXT_ENCODER_FOLDER}/config.json"), location.has("config.json")
        if nested:
            subfolder = TEXT_ENCODER_FOLDER
        elif root:
            subfolder = ""
        elif nested is None or root is None:
            raise location.unreachable("the text encoder", ["config.json", f"{TEXT_ENCODER_FOLDER}/config.json"])
        else:
            raise ValueError(
                f"{option} {source} holds no text encoder: it has neither a config.json (a CLIP repo, as "
                f"{COCO_TEXT_ENCODER_REPO}) nor {TEXT_ENCODER_FOLDER}/config.json (a pipeline, as {COCO_VAE_REPO})"
            )
    else:
        config = f"{subfolder}/config.json" if subfolder else "config.json"
        found = location.has(config)
        if found is None:
            raise location.unreachable("the text encoder", [config])
        if not found:
            if location.local and subfolder and not (Path(source) / subfolder).is_dir():
                raise ValueError(f"{option} {source} has no {subfolder}/ folder: the text model is missing")
            raise ValueError(f"{option} {source}: the text model's {config} is missing")
    # A pipeline keeps its tokenizer in tokenizer/, a CLIP repo beside the model.
    candidates = [TOKENIZER_FOLDER, subfolder] if subfolder else [""]
    holds = [tokenizer_files(location, folder) for folder in candidates]
    if True in holds:
        return TextEncoderSource(source, subfolder, candidates[holds.index(True)])
    if None in holds:
        raise location.unreachable("the tokenizer", [in_folder(candidates[0], TOKENIZER_FILES[1])])
    if subfolder and location.local and not (Path(source) / TOKENIZER_FOLDER).is_dir():
        raise ValueError(f"{option} {source} has no {TOKENIZER_FOLDER}/ folder: the tokenizer is missing")
    folder = Path(source) / candidates[0] if location.local else f"{source}/{candidates[0]}"
    raise ValueError(f"{option} {source}: the tokenizer folder {folder} has no {' or '.join(TOKENIZER_FILES)}")


def tokenizer_files(location: Location, folder: str) -> bool | None:
    """Whether `folder` of the source holds tokenizer files; None when a Hub repo cannot be asked."""
    found = [location.has(in_folder(folder, name)) for name in TOKENIZER_FILES]
    return True if True in found else None if None in found else False


def local_folder(
    source: str, folder: str, weights: str, optional: tuple[str, ...] = (), revision: str | None = None
) -> str:
    """A local folder holding `source`'s model in `folder`: `source` itself, or the HF cache snapshot of a Hub repo,
    into which its config, its safetensors weights (`weights`: the name without `.safetensors`, or its index's shards)
    and those of the `optional` files it has are downloaded first."""
    if Path(source).is_dir():
        return source
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    def fetch(name: str) -> Path:
        return Path(hf_hub_download(source, name, revision=revision))

    config = in_folder(folder, "config.json")
    snapshot = fetch(config).parents[config.count("/")]
    try:
        fetch(in_folder(folder, f"{weights}.safetensors"))
    except EntryNotFoundError:  # sharded weights
        index = fetch(in_folder(folder, f"{weights}.safetensors.index.json"))
        for shard in sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())):
            fetch(in_folder(folder, shard))
    for name in optional:
        try:
            fetch(name)
        except EntryNotFoundError:
            pass
    return str(snapshot)


def load_vae(source: VaeSource, revision: str | None = None):
    """The VAE of `source` (`resolve_vae`), its weights from safetensors only."""
    from diffusers import AutoencoderKL

    folder = local_folder(source.source, source.subfolder, VAE_WEIGHTS, revision=revision)
    return AutoencoderKL.from_pretrained(folder, subfolder=source.subfolder or None, use_safetensors=True)


def load_text_encoder(
    source: TextEncoderSource, option: str = "--pretrained_text_encoder", revision: str | None = None
):
    """The CLIP tokenizer and text model of `source` (`resolve_text_encoder`), the model loaded strictly from
    safetensors: `ValueError` for text-model tensors missing from the checkpoint, or tensors neither it nor a full CLIP
    checkpoint's other tower has."""
    from transformers import CLIPTextModel, CLIPTokenizer

    tokenizer_files = tuple(in_folder(source.tokenizer_subfolder, name) for name in TOKENIZER_FILE_NAMES)
    folder = local_folder(source.source, source.subfolder, TEXT_ENCODER_WEIGHTS, tokenizer_files, revision)
    tokenizer = CLIPTokenizer.from_pretrained(folder, subfolder=source.tokenizer_subfolder)
    with without_load_report():
        text_encoder, info = CLIPTextModel.from_pretrained(
            folder, subfolder=source.subfolder, use_safetensors=True, output_loading_info=True
        )
    missing = sorted(info["missing_keys"])
    unknown = sorted(key for key in info["unexpected_keys"] if not key.startswith(CLIP_OTHER_TENSORS))
    where = f"{option} {source.source}" + (f" ({source.subfolder}/)" if source.subfolder else "")
    if missing:
        raise ValueError(
            f"{where}: the checkpoint lacks {len(missing)} of the CLIP text model's tensors ({named(missing)}), "
            "which would be left random. Pass a CLIP text model or a full CLIP checkpoint."
        )
    if unknown:
        raise ValueError(
            f"{where}: the checkpoint holds {len(unknown)} tensors that are not a CLIP text model's ({named(unknown)}): "
            "it is not the text encoder its config.json describes."
        )
    return tokenizer, text_encoder


def named(keys: list[str], shown: int = 3) -> str:
    """The first `shown` of `keys`, and how many more there are."""
    more = f", and {len(keys) - shown} more" if len(keys) > shown else ""
    return ", ".join(keys[:shown]) + more


@contextlib.contextmanager
def without_load_report() -> Iterator[None]:
    """Leave out transformers' "LOAD REPORT" warning while a model loads: the caller reads the loading information
    itself, so a full CLIP checkpoint's unused vision tower is not reported on every run."""

    def not_a_load_report(record: logging.LogRecord) -> bool:
        return " LOAD REPORT" not in str(record.msg)

    logger = logging.getLogger("transformers.modeling_utils")
    logger.addFilter(not_a_load_report)
    try:
        yield
    finally:
        logger.removeFilter(not_a_load_report)


# Option → what to do instead.
DIFFUSERS_ONLY_OPTIONS = {
    "--num_train_epochs": (
        "this script counts optimizer steps: give --max_train_steps (one epoch is ⌈images / (--train_batch_size × "
        "--gradient_accumulation_steps × processes)⌉ steps)"
    ),
    "--center_crop": (
        "images are always center-cropped to a square and resized to --resolution, as U-ViT prepares COCO; drop it"
    ),
    "--image_interpolation_mode": "images are always resized with Lanczos, diffusers' default; drop it",
    "--scale_lr": "multiply --learning_rate by the total batch (batch × accumulation × processes) yourself",
    "--prediction_type": "the backbones predict the noise ε, as both papers train them; drop it",
    "--input_perturbation": "it is not implemented here; drop it",
    "--dream_training": "DREAM is not implemented here; drop it",
    "--dream_detail_preservation": "DREAM is not implemented here; drop it",
    "--use_8bit_adam": "the trainer steps torch's AdamW (fused on the CPU and CUDA); drop it",
    "--validation_epochs": "give --validation_steps (optimizer steps between validations)",
    "--enable_xformers_memory_efficient_attention": (
        "the MLP backbones have no attention, and U-ViT runs torch's scaled_dot_product_attention, which picks a "
        "fused kernel itself; drop it"
    ),
    "--non_ema_revision": "a fine-tune starts from the weights at --pretrained_model_name_or_path and --revision; drop it",
    "--offload_ema": "the EMA weights stay on the model's device; drop it",
    "--foreach_ema": "the EMA always updates in one multi-tensor pass; drop it",
    "--local_rank": "`accelerate launch` gives each process its rank; drop it",
}


def diffusers_only_options(unknown: list[str]) -> list[str]:
    """One line per diffusers option among the arguments argparse left over (`unknown`, as `parse_known_args` gives
    them), in the order given."""
    lines = []
    for argument in unknown:
        option = argument.split("=", 1)[0]
        if option in DIFFUSERS_ONLY_OPTIONS:
            lines.append(
                f"{option} is an option of diffusers' train_text_to_image.py: {DIFFUSERS_ONLY_OPTIONS[option]}"
            )
    return lines


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
    check_push_to_hub(parser, args)
    check_output_dir(parser, args)
    if args.model_overrides and args.pretrained_model_name_or_path:
        parser.error(
            "--model_overrides configures a new model; --pretrained_model_name_or_path fine-tunes a saved one, whose "
            "configuration is kept: drop one of them"
        )


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
    """The checkpoint to resume from, and the shapes world's size (the ranges are the options' argparse types)."""
    if args.resume_from_checkpoint and args.resume_from_checkpoint != "latest":
        if not Path(args.resume_from_checkpoint).is_dir():
            parser.error(f"--resume_from_checkpoint {args.resume_from_checkpoint}: no such checkpoint folder")
        if not CHECKPOINT_PATTERN.match(Path(args.resume_from_checkpoint).name):
            parser.error(f"--resume_from_checkpoint {args.resume_from_checkpoint}: not a checkpoint-<step> folder")
    if args.shapes_num_images is not None and args.world != "shapes":
        parser.error("--shapes_num_images sizes the shapes world, which this run does not train on: leave it out")


def check_validation_args(parser: argparse.ArgumentParser, args: argparse.Namespace, given: set[str]) -> None:
    """What the validations sample: FID's captions and reference, the prompts file, and that there is something."""
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


def settled_model(parser: argparse.ArgumentParser, args: argparse.Namespace, preset_overrides: dict) -> dict:
    """The backbone's family and configuration, and `--model_overrides` as config values checked against it (after
    the preset's, which it replaces key by key); a base pipeline's backbone is settled when it is read."""
    model = {} if args.pretrained_model_name_or_path else settled_model_type(parser, args)
    model_class = model_class_of(model.get("model_type", args.model_type) or "lmlp")
    try:
        check_config_values(preset_overrides, model_class, f"--preset {args.preset}'s model_overrides")
        overrides = {**preset_overrides, **parse_overrides(args.model_overrides, model_class)}
    except ValueError as error:
        parser.error(str(error))
    return {**model, "model_overrides": overrides}


def earlier_run(output_dir: Path) -> str | None:
    """What of an earlier run `output_dir` holds (a finished run, checkpoints), in words; None if nothing."""
    if (output_dir / SUMMARY_FILE).is_file():
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


def settled_model_type(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    """`model_type`, `model_config`, `model_config_values` and `model_skeleton` of a new model: the family is
    --model_type, else the named configuration's, else lmlp. A preset's named configuration of another family lends
    it its skeleton (`SKELETON_FIELDS`), which explicit --model_overrides still replace."""
    named, config = named_configs(), args.model_config
    if config is not None and config.endswith(".json"):
        try:
            values, config_family = read_model_config_file(Path(config))
        except ValueError as error:
            parser.error(str(error))
        if config_family is not None and args.model_type not in (None, config_family):
            parser.error(f"--model_config {config} is a --model_type {config_family} config (its _class_name)")
        model_type = args.model_type or config_family or "lmlp"
        try:
            check_config_values(values, model_class_of(model_type), f"--model_config {config}")
        except ValueError as error:
            parser.error(str(error))
        return dict(model_type=model_type, model_config=config, model_config_values=values, model_skeleton={})
    if config is not None and config not in named:
        parser.error(f"unknown --model_config {config!r}; choose one of {sorted(named)} or a .json file")
    config_family = named[config][0].name if config in named else None
    model = dict(model_type=args.model_type or config_family or "lmlp", model_config=config, model_skeleton={})
    if config_family not in (None, model["model_type"]):
        if not args.model_config_from_preset:
            parser.error(f"--model_config {config} is a --model_type {config_family} configuration")
        skeleton = {k: v for k, v in named[config][1].items() if k in SKELETON_FIELDS}
        model.update(model_config=None, model_skeleton=skeleton)
    return model


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


def component_sources(args: argparse.Namespace) -> dict:
    """`text_encoder_source` and `vae_source`; a missing local folder or file of a base pipeline or frozen component
    is named now, before loading turns it into a confusing error (an empty tokenizer, a failed download)."""
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
    return dict(
        text_encoder_source=resolve_text_encoder(text, args.text_encoder_subfolder) if text else None,
        vae_source=resolve_vae(vae, args.vae_subfolder) if vae else None,
    )


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

# `--lr_scheduler`: diffusers' `get_scheduler` names (tests/training/test_train_options.py checks them against
# diffusers').
LR_SCHEDULERS = (
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "piecewise_constant",
)


@dataclass(frozen=True)
class TrainingConfig:
    """The trainer's settings: the command's options, by their names (`build_parser`; its defaults are these), then
    what `parse_args` settles from them. A preset is an instance: its values are the defaults that options replace."""

    preset: str | None = None
    # model
    model_type: str | None = None
    model_config: str | None = None
    model_overrides: dict = field(default_factory=dict)  # config values, from KEY=VALUE pairs
    pretrained_model_name_or_path: str | None = None
    revision: str | None = None
    variant: str | None = None
    # LoRA
    lora_rank: int | None = None
    lora_alpha: float | None = None
    lora_dropout: float = 0.0
    lora_target_modules: list[str] | None = None
    # frozen components
    pretrained_vae: str | None = None
    vae_subfolder: str | None = None
    pretrained_text_encoder: str | None = None
    text_encoder_subfolder: str | None = None
    latent_scale: float | None = None
    # data
    dataset_name: str | None = None
    dataset_config_name: str | None = None
    streaming: bool = False
    train_data_dir: str | None = None
    data_layout: str = "auto"
    shapes_split: str = "train"
    shapes_num_images: int | None = None
    image_column: str = "image"
    caption_column: str = "text"
    max_train_samples: int | None = None
    resolution: int = 256
    random_flip: bool = False
    caption_dropout: float = 0.1
    cache_features: bool = False
    cache_text_dtype: str | None = None
    cache_dir: str | None = None
    dataloader_num_workers: int = 0
    # optimisation (the papers' COCO recipe)
    seed: int = 0
    train_batch_size: int = 16
    max_train_steps: int = 10_000
    gradient_accumulation_steps: int = 1
    gradient_checkpointing: bool = False
    learning_rate: float = 2e-4
    adam_beta1: float = 0.9
    adam_beta2: float = 0.9
    adam_weight_decay: float = 0.03
    adam_epsilon: float = 1e-8
    max_grad_norm: float | None = None
    lr_scheduler: str = "constant_with_warmup"
    lr_warmup_steps: int = 5000
    snr_gamma: float | None = None
    noise_offset: float = 0.0
    load_balance_weight: float = 0.0
    symmetry_breaking_weight: float = 0.0
    use_ema: bool = False
    ema_decay: float = 0.9999
    num_threads: int | None = None
    mixed_precision: str | None = None
    torch_compile: str | None = None
    allow_tf32: bool = False
    # output, logging, validation
    output_dir: str = "lmlp-model"
    overwrite_output_dir: bool = False
    logging_dir: str = "logs"
    logging_steps: int = 1
    report_to: str = "tensorboard"
    tracker_project_name: str = "lmlp-text-to-image"
    validation_prompts: list[str] | None = None
    validation_prompts_file: str | None = None
    validation_steps: int = 1000
    validation_inference_steps: int = 25
    validation_guidance_scale: float = GUIDANCE_SCALE
    final_evaluation_inference_steps: int = NUM_INFERENCE_STEPS
    validation_fid_images: int = 0
    validation_fid_captions: str | None = None
    validation_fid_reference: str | None = None
    checkpointing_steps: int = 1000
    checkpoints_total_limit: int | None = None
    resume_from_checkpoint: str | None = None
    push_to_hub: bool = False
    hub_model_id: str | None = None
    hub_token: str | None = None
    # settled by `parse_args`
    world: str | None = None  # the embedded world trained on and scored, without data
    model_config_from_preset: bool = False
    mixed_precision_from_preset: bool = False
    model_config_values: dict | None = None  # a --model_config JSON file's values
    model_skeleton: dict = field(default_factory=dict)  # a preset's named configuration of another family lends it
    text_encoder_source: TextEncoderSource | None = None
    vae_source: VaeSource | None = None


# `--preset NAME`: these defaults; explicit arguments still win.
PRESETS = {
    # The embedded default: the procedural shapes world with the package's offline components, sized for a CPU.
    "shapes": TrainingConfig(
        model_config="shapes-S",
        # A projection of the text encoder's last-position state added to every image token (docs/shapes-runs.md);
        # explicit --model_overrides are added to it (pooled_text_projection=false turns it off).
        model_overrides={"pooled_text_projection": True},
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
    "coco-f2": TrainingConfig(
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
    "emoji": TrainingConfig(
        model_config="emoji-S",
        model_overrides={"pooled_text_projection": True},
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
    "shapes-lora": TrainingConfig(
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
        metavar="KEY=VALUE",
        help="config values of a new model, e.g. num_layers=12; added to the preset's (the shapes preset sets "
        f"{' '.join(f'{k}={json.dumps(v)}' for k, v in PRESETS['shapes'].model_overrides.items())})",
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
        "--lora_rank", type=number(int, 1),
        help="train a LoRA adapter of this rank instead of the whole backbone; the output is "
        "pytorch_lora_weights.safetensors (LMLPPipeline.load_lora_weights) and a card",
    )  # fmt: skip
    lora.add_argument(
        "--lora_alpha",
        type=number(float, above=0),
        help="LoRA alpha: the update is scaled by alpha / rank (default: rank)",
    )
    lora.add_argument("--lora_dropout", type=number(float, 0, below=1), help="dropout on the adapter's input")
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
        "--data_layout", choices=DATA_LAYOUTS,
        help="how --train_data_dir is laid out: auto (COCO-2014 when the folder holds "
        "annotations/captions_train2014.json and train2014/, an imagefolder otherwise), imagefolder (images + "
        "metadata.jsonl, .csv or .parquet; file names never split the data), or coco2014 (the official COCO-2014 "
        "folder: annotations/captions_train2014.json and train2014/*.jpg; one sample per image, one of its captions "
        "picked at random at each use)",
    )  # fmt: skip
    data.add_argument(
        "--shapes_split", choices=("train", "heldout"),
        help="without data, the shapes world's combinations to train on: train (292 of them), or heldout (the 32 held "
        "out of the shipped model's training: the shapes-lora preset's new attribute set)",
    )  # fmt: skip
    data.add_argument(
        "--shapes_num_images", type=number(int, 1),
        help="without data, how many images of the shapes world to render and train on, each combination equally "
        "often and each image with its own jitter (default: 8000 of train, 800 of heldout)",
    )  # fmt: skip
    data.add_argument("--image_column", help="the column of the images (default: image)")
    data.add_argument(
        "--caption_column",
        help="the column of the captions: a caption or a list of them per image (default: text)",
    )  # fmt: skip
    data.add_argument(
        "--max_train_samples", type=number(int, 1), help="train on the first N samples only (for quick runs)"
    )
    data.add_argument(
        "--resolution", type=number(int, 1),
        help="the side of the square training images in pixels, after a centre crop: the backbone's sample_size × "
        "the VAE's factor (256 for the papers' models, 32 for the shapes world)",
    )  # fmt: skip
    data.add_argument("--random_flip", action="store_true", help="mirror each image left to right at random")
    data.add_argument(
        "--caption_dropout", type=number(float, 0, below=1), help='probability of training on "" instead'
    )
    data.add_argument(
        "--cache_features", action=argparse.BooleanOptionalAction,
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
        "--dataloader_num_workers", type=number(int, 0, why=" (0 reads the data in the training process)"),
        help="worker processes that read the feature store (or decode and crop the images) ahead of the training "
        "steps, and decode the images of the feature extraction; 0 reads in the training process. The batches are "
        "the same with any number",
    )  # fmt: skip

    train = parser.add_argument_group("optimisation")
    train.add_argument(
        "--seed", type=number(int, 0, below=2**32, why=" (numpy's 32-bit seeds; every draw of the run comes from it)"),
        help="seeds the initial weights and every draw of the run (data order, noise, timesteps): a run is "
        "reproducible from it, and resumes exactly",
    )  # fmt: skip
    train.add_argument("--train_batch_size", type=number(int, 1), help="per device, per accumulation step")
    train.add_argument("--max_train_steps", type=number(int, 1), help="optimizer steps to train for")
    train.add_argument(
        "--gradient_accumulation_steps", type=number(int, 1),
        help="micro-batches per optimizer step: the batch per step is --train_batch_size × this × the processes",
    )  # fmt: skip
    train.add_argument(
        "--gradient_checkpointing", action="store_true",
        help="recompute each block's activations in the backward pass: much less activation memory, for one more "
        "forward of each block per step",
    )  # fmt: skip
    train.add_argument("--learning_rate", type=number(float, above=0), help="AdamW's peak learning rate")
    train.add_argument("--adam_beta1", type=float, help="AdamW's beta1")
    train.add_argument("--adam_beta2", type=float, help="AdamW's beta2 (the papers' recipe: 0.9)")
    train.add_argument("--adam_weight_decay", type=float, help="AdamW's decoupled weight decay")
    train.add_argument("--adam_epsilon", type=float, help="AdamW's epsilon")
    train.add_argument("--max_grad_norm", type=float, help="clip gradients to this norm (off by default)")
    train.add_argument(
        "--lr_scheduler", choices=LR_SCHEDULERS,
        help="the learning-rate schedule after --lr_warmup_steps of linear warm-up (diffusers' get_scheduler)",
    )  # fmt: skip
    train.add_argument("--lr_warmup_steps", type=number(int, 0), help="steps of linear warm-up from 0")
    train.add_argument("--snr_gamma", type=float, help="Min-SNR loss weighting (5.0 is the usual value)")
    train.add_argument("--noise_offset", type=float, help="scale of a per-channel offset added to the noise (0: off)")
    train.add_argument("--load_balance_weight", type=number(float, 0), help="MoE-MLP balancing loss (paper: 0.01)")
    train.add_argument(
        "--symmetry_breaking_weight",
        type=number(float, 0),
        help="AsymMixer's penalty λ·Σ‖W̃‖²_F (the ParaMixer paper sweeps 1e-6 to 1)",
    )
    train.add_argument(
        "--use_ema", action=argparse.BooleanOptionalAction,
        help="keep an exponential moving average of the weights, saved as the pipeline's weights",
    )  # fmt: skip
    train.add_argument("--ema_decay", type=float, help="the EMA's decay per step")
    train.add_argument(
        "--num_threads", type=number(int, 1),
        help="CPU threads of a one-process CPU run (default: the OMP_NUM_THREADS you set, "
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
    out.add_argument("--output_dir", help="where the pipeline, checkpoints, samples and logs are written")
    out.add_argument(
        "--overwrite_output_dir", action="store_true",
        help="train from step 0 into an --output_dir that already holds a run (its checkpoints and summary are "
        "removed at start-up); without it such a folder is refused, unless --resume_from_checkpoint",
    )  # fmt: skip
    out.add_argument("--logging_dir", help="the trackers' folder, inside --output_dir")
    out.add_argument(
        "--logging_steps", type=number(int, 1),
        help="send the trackers the mean loss and gradient norm of every this many steps, and the learning rate (the "
        "shapes presets: 10; the progress bar shows every step)",
    )  # fmt: skip
    out.add_argument("--report_to", help='"tensorboard", "wandb", "all" or "none"')
    out.add_argument("--tracker_project_name", help="the project name in tensorboard or wandb")
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
        "--validation_steps", type=int,
        help="sample the validation prompts (and the FID of --validation_fid_images) every N steps",
    )  # fmt: skip
    out.add_argument(
        "--validation_inference_steps", type=number(int, 1), help="sampler steps of the validation images"
    )
    out.add_argument(
        "--validation_guidance_scale", type=float,
        help="guidance scale of the validation images (diffusers' g; the papers' s = g - 1)",
    )  # fmt: skip
    out.add_argument(
        "--final_evaluation_inference_steps",
        type=number(int, 1),
        help="sampler steps of the shapes world's final evaluation (default: the pipeline's 50; fewer for smoke runs)",
    )
    out.add_argument(
        "--validation_fid_images", type=number(int, 0, why=" (0: no FID during training)"),
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
        "--checkpointing_steps", type=number(int, 1),
        help="write a checkpoint (weights, optimizer, EMA, data position) every N steps, and at the end",
    )  # fmt: skip
    out.add_argument(
        "--checkpoints_total_limit", type=number(int, 1, why=" (or left out to keep all)"),
        help="keep the newest N checkpoints, and one more until the steps after the newest prove healthy",
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
    parser.set_defaults(**option_defaults(parser, TrainingConfig()))
    return parser


def option_defaults(parser: argparse.ArgumentParser, config: TrainingConfig) -> dict:
    """`config`'s values as the parser's defaults: --model_overrides' pairs come on top of the config's values."""
    return {a.dest: getattr(config, a.dest) for a in parser._actions if a.dest != "help"} | {"model_overrides": []}


def parse_args(argv: list[str] | None = None) -> TrainingConfig:
    """Parse and check the options; exit (2) with a message that says what to change when one is wrong.

    Args:
        argv (`list[str]`, *optional*): The arguments; `sys.argv[1:]` when None.

    Returns:
        `TrainingConfig`: The checked settings, with the preset, the world and the model settled.
    """
    parser = build_parser()
    # Presets change defaults only: read the preset first, then parse everything with its defaults in place.
    given = given_options(parser, argv)
    uses_data = bool({"dataset_name", "train_data_dir"} & given)
    known, unknown = parser.parse_known_args(argv)
    if explanations := diffusers_only_options(unknown):  # diffusers' options, with what to do instead
        parser.error("\n".join(explanations))
    preset = known.preset or (None if uses_data else ("shapes-lora" if known.lora_rank else "shapes"))
    base = PRESETS[preset] if preset else TrainingConfig()
    parser.set_defaults(**option_defaults(parser, base))
    args = parser.parse_args(argv)
    args.preset, args.world = preset, None if uses_data else WORLD_PRESETS.get(preset)
    args.model_config_from_preset = bool(preset) and "model_config" not in given
    args.mixed_precision_from_preset = bool(preset) and "mixed_precision" not in given
    if args.validation_prompts_file:  # read once, checked and kept
        try:
            args.validation_prompts = read_captions_file(args.validation_prompts_file, "--validation_prompts_file")
        except ValueError as error:
            parser.error(str(error))
    validate_args(parser, args, given)
    # A preset's model options stay unless a saved model is fine-tuned (the last value of a key wins).
    keep_preset = "model_overrides" in given or not args.pretrained_model_name_or_path
    try:
        sources = component_sources(args)
    except ValueError as error:
        parser.error(str(error))
    return TrainingConfig(
        **{
            **vars(args),
            **sources,
            **settled_model(parser, args, base.model_overrides if keep_preset else {}),
        }
    )


def given_options(parser: argparse.ArgumentParser, argv: list[str] | None) -> set[str]:
    """The destinations of the options given on the command line (abbreviated or not), as opposed to defaults.
    argparse fills in a default only where the namespace lacks the attribute, so a marker set for every option stays
    for each one not given."""
    unset = object()
    namespace = argparse.Namespace(**{a.dest: unset for a in parser._actions if a.dest != argparse.SUPPRESS})
    parsed, _ = parser.parse_known_args(argv, namespace)
    return {dest for dest, value in vars(parsed).items() if value is not unset}
