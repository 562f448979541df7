"""The trainer's command line: `TrainingConfig`, the presets, `parse_args` and its start-up checks, and where the
frozen components load from. No heavy library is imported here, so `--help` and argument errors are fast.
"""

import argparse
import contextlib
import inspect
import json
import logging
import posixpath
import re
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path

from huggingface_hub import constants, file_exists, try_to_load_from_cache
from huggingface_hub.errors import EntryNotFoundError
from huggingface_hub.utils import HFValidationError, validate_repo_id

from ..commands import number, program_name
from ..evaluation.captions import draw_captions, read_captions_file
from ..folders import TOKENIZER_FILES
from ..models.families import FAMILIES, family_of, named_configs
from ..sampling import GUIDANCE_SCALE, NUM_INFERENCE_STEPS
from ..shapes.pretrained import PIPELINE_PATH as SHAPES_PIPELINE_PATH
from .data import DATA_LAYOUTS
from .features import TEXT_DTYPES


# A checkpoint is complete only under this name; the next run cleans up what a killed one left under another.
CHECKPOINT_PATTERN = re.compile(r"^checkpoint-(\d+)$")
UNDER_WAY_PATTERN = re.compile(r"^\.checkpoint-(\d+)\.(tmp|old|deleting)$")
STATE_FILE = "training_state.json"  # in a checkpoint: {"step": ..., "train_seconds": ...}
LOCK_FILE = ".train.lock"  # held (flock) by the main process of the run that uses the output folder
SUMMARY_FILE = "training_summary.json"  # written last: a folder with it holds a finished run


def checkpoint_step(path: Path) -> int:  # of a `checkpoint-N` folder
    return int(CHECKPOINT_PATTERN.match(path.name).group(1))


def list_checkpoints(output_dir: Path) -> list[Path]:
    """The complete checkpoints of `output_dir`, oldest first."""
    found = [p for p in output_dir.glob("checkpoint-*") if p.is_dir() and CHECKPOINT_PATTERN.match(p.name)]
    return sorted(found, key=checkpoint_step)


COCO_VAE_REPO = "CompVis/stable-diffusion-v1-4"  # the papers' components (docs/coco.md downloads them)
COCO_TEXT_ENCODER_REPO = "openai/clip-vit-large-patch14"
VAE_FOLDER, TEXT_ENCODER_FOLDER, TOKENIZER_FOLDER = "vae", "text_encoder", "tokenizer"  # inside a full pipeline
# Each component's weights file name (`<name>.safetensors`, or shards listed in `<name>.safetensors.index.json`).
VAE_WEIGHTS, TEXT_ENCODER_WEIGHTS = "diffusion_pytorch_model", "model"
TOKENIZER_FILE_NAMES = (*TOKENIZER_FILES, "merges.txt", "tokenizer_config.json", "special_tokens_map.json")
# The tensors of a full CLIP checkpoint that its text model does not use.
CLIP_OTHER_TENSORS = ("vision_model.", "visual_projection.", "text_projection.", "logit_scale")


@dataclass(frozen=True)
class VaeSource:  # where the VAE loads from: a local folder or Hub repo id, and its subfolder ("": the root)
    source: str
    subfolder: str


@dataclass(frozen=True)
class TextEncoderSource:  # where the text encoder and tokenizer load from, and their folders in it ("": the root)
    source: str
    subfolder: str
    tokenizer_subfolder: str


class Location:
    """The files of a local folder or Hub repo id `source`; `ValueError` when it is neither."""

    def __init__(self, source: str, option: str, revision: str | None = None):
        self.source, self.option, self.revision = source, option, revision
        self.local = Path(source).is_dir()
        if not self.local:
            try:
                validate_repo_id(source)
            except HFValidationError:
                raise ValueError(f"{option} {source}: no such folder") from None

    def has(self, path: str) -> bool | None:
        """Whether the source has the file `path`; None when a Hub repo cannot be asked (offline, not cached)."""
        if self.local:
            return (Path(self.source) / path).is_file()
        cached = try_to_load_from_cache(self.source, path, revision=self.revision)
        if cached is not None:  # a path, or the cache's record that the repo has no such file
            return isinstance(cached, str)
        if constants.HF_HUB_OFFLINE:
            return None
        try:
            return file_exists(self.source, path, revision=self.revision)
        except Exception:  # no connection, a private repo without a token, ...: loading will say what is wrong
            return None

    def config(self, path: str) -> dict:
        """The JSON file `path` of the source (a Hub source's cache); {} if not at hand."""
        local = Path(self.source) / path
        try:
            file = local if self.local else try_to_load_from_cache(self.source, path, revision=self.revision)
            config = json.loads(Path(file).read_text("utf-8"))
        except (OSError, TypeError, ValueError):
            return {}
        return config if isinstance(config, dict) else {}

    def detect(self, what: str, nested: str, root_first: bool, kinds: str) -> str:
        """The folder holding `what`'s config.json: the root or `nested`, the root first where `root_first`."""
        folders = ["", nested] if root_first else [nested, ""]
        found = [self.has(posixpath.join(folder, "config.json")) for folder in folders]
        if True in found:
            return folders[found.index(True)]
        if None in found:
            raise self.unreachable(what, ["config.json", f"{nested}/config.json"])
        raise ValueError(f"{self.option} {self.source} holds no {what.removeprefix('the ')}: it has neither a config.json {kinds}")  # fmt: skip

    def unreachable(self, what: str, files: list[str]) -> ValueError:
        why = "HF_HUB_OFFLINE=1 keeps it from downloading" if constants.HF_HUB_OFFLINE else "the Hub is out of reach"
        return ValueError(
            f"{self.option} {self.source}: {what} ({' or '.join(files)}) is not in the Hugging Face cache, and {why}. "
            f"Fetch it once (`hf download {self.source} {files[0]}`, see docs/coco.md) or pass a local folder."
        )


def resolve_vae(
    source: str, subfolder: str | None, option: str = "--pretrained_vae", revision: str | None = None
) -> VaeSource:
    """Where the VAE of `source` is: its root (a standalone VAE) or `vae/` (a pipeline), or the given `subfolder`."""
    location = Location(source, option, revision)
    if subfolder is not None:
        config = posixpath.join(subfolder, "config.json")
        if location.local and not location.has(config):
            raise ValueError(f"{option} {source}: --vae_subfolder {subfolder!r} has no config.json; leave it out")
        return VaeSource(source, subfolder)
    config = location.config("config.json")
    name = config.get("_class_name")
    is_vae = name.startswith("Autoencoder") if isinstance(name, str) else "latent_channels" in config
    kinds = f"(a standalone VAE) nor {VAE_FOLDER}/config.json (a pipeline, as {COCO_VAE_REPO})"
    return VaeSource(source, location.detect("the VAE", VAE_FOLDER, is_vae, kinds))


def resolve_text_encoder(
    source: str, subfolder: str | None, option: str = "--pretrained_text_encoder", revision: str | None = None
) -> TextEncoderSource:
    """Where `source`'s text encoder and tokenizer are: its root, `text_encoder/` and `tokenizer/`, or `subfolder`."""
    location = Location(source, option, revision)
    if subfolder is None:
        kinds = f"(a CLIP repo, as {COCO_TEXT_ENCODER_REPO}) nor {TEXT_ENCODER_FOLDER}/config.json (a pipeline)"
        subfolder = location.detect("the text encoder", TEXT_ENCODER_FOLDER, False, kinds)
    else:
        config = posixpath.join(subfolder, "config.json")
        if (found := location.has(config)) is None:
            raise location.unreachable("the text encoder", [config])
        if not found:
            if location.local and subfolder and not (Path(source) / subfolder).is_dir():
                raise ValueError(f"{option} {source} has no {subfolder}/ folder: the text model is missing")
            raise ValueError(f"{option} {source}: the text model's {config} is missing")
    candidates = [TOKENIZER_FOLDER, subfolder] if subfolder else [""]  # a pipeline's tokenizer/, or beside the model
    found = [[location.has(posixpath.join(folder, name)) for name in TOKENIZER_FILES] for folder in candidates]
    holds = [True if True in has else None if None in has else False for has in found]
    if True in holds:
        return TextEncoderSource(source, subfolder, candidates[holds.index(True)])
    if None in holds:
        raise location.unreachable("the tokenizer", [posixpath.join(candidates[0], TOKENIZER_FILES[1])])
    if subfolder and location.local and not (Path(source) / TOKENIZER_FOLDER).is_dir():
        raise ValueError(f"{option} {source} has no {TOKENIZER_FOLDER}/ folder: the tokenizer is missing")
    folder = Path(source) / candidates[0] if location.local else f"{source}/{candidates[0]}"
    raise ValueError(f"{option} {source}: the tokenizer folder {folder} has no {' or '.join(TOKENIZER_FILES)}")


def local_folder(
    source: str, folder: str, weights: str, optional: tuple[str, ...] = (), revision: str | None = None
) -> str:
    """`source` if a folder, else its HF cache snapshot with `folder`'s config, safetensors and `optional` files."""
    if Path(source).is_dir():
        return source
    from huggingface_hub import hf_hub_download  # looked up now: tests answer it

    fetch = lambda name: Path(hf_hub_download(source, name, revision=revision))  # noqa: E731
    config = posixpath.join(folder, "config.json")
    snapshot = fetch(config).parents[config.count("/")]
    try:
        fetch(posixpath.join(folder, f"{weights}.safetensors"))
    except EntryNotFoundError:  # sharded weights
        index = fetch(posixpath.join(folder, f"{weights}.safetensors.index.json"))
        for shard in sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())):
            fetch(posixpath.join(folder, shard))
    for name in optional:
        with contextlib.suppress(EntryNotFoundError):
            fetch(name)
    return str(snapshot)


def load_vae(source: VaeSource, revision: str | None = None):
    """The VAE of `source`, its weights from safetensors only."""
    from diffusers import AutoencoderKL

    folder = local_folder(source.source, source.subfolder, VAE_WEIGHTS, revision=revision)
    return AutoencoderKL.from_pretrained(folder, subfolder=source.subfolder or None, use_safetensors=True)


def load_text_encoder(
    source: TextEncoderSource, option: str = "--pretrained_text_encoder", revision: str | None = None
):
    """`source`'s CLIP tokenizer and text model, strictly from safetensors (`ValueError` for missing or alien keys)."""
    from transformers import CLIPTextModel, CLIPTokenizer

    tokenizer_files = tuple(posixpath.join(source.tokenizer_subfolder, name) for name in TOKENIZER_FILE_NAMES)
    folder = local_folder(source.source, source.subfolder, TEXT_ENCODER_WEIGHTS, tokenizer_files, revision)
    tokenizer = CLIPTokenizer.from_pretrained(folder, subfolder=source.tokenizer_subfolder)

    not_a_load_report = lambda record: " LOAD REPORT" not in str(record.msg)  # noqa: E731  (it is read here instead)
    transformers_logger = logging.getLogger("transformers.modeling_utils")
    transformers_logger.addFilter(not_a_load_report)
    try:
        text_encoder, info = CLIPTextModel.from_pretrained(
            folder, subfolder=source.subfolder, use_safetensors=True, output_loading_info=True
        )
    finally:
        transformers_logger.removeFilter(not_a_load_report)
    where = f"{option} {source.source}" + (f" ({source.subfolder}/)" if source.subfolder else "")
    for keys, problem in (
        (sorted(info["missing_keys"]), "lacks {} of the CLIP text model's tensors"),
        (sorted(k for k in info["unexpected_keys"] if not k.startswith(CLIP_OTHER_TENSORS)),
         "holds {} tensors that are not a CLIP text model's"),
    ):  # fmt: skip
        if keys:
            named = ", ".join(keys[:3]) + (f", and {len(keys) - 3} more" if len(keys) > 3 else "")
            message = f"the checkpoint {problem.format(len(keys))} ({named}). Pass a CLIP text model or a full CLIP."
            raise ValueError(f"{where}: {message}")
    return tokenizer, text_encoder


# diffusers' train_text_to_image.py options that this script does not take: option → what to do instead.
# fmt: off
DIFFUSERS_ONLY_OPTIONS = {
    "--num_train_epochs": "this script counts optimizer steps: give --max_train_steps (one epoch is ⌈images / (--train_batch_size × --gradient_accumulation_steps × processes)⌉ steps)",
    "--center_crop": "images are always center-cropped to a square and resized to --resolution; drop it",
    "--image_interpolation_mode": "images are always resized with Lanczos, diffusers' default; drop it",
    "--scale_lr": "multiply --learning_rate by the total batch (batch × accumulation × processes) yourself",
    "--prediction_type": "the backbones predict the noise ε, as both papers train them; drop it",
    "--input_perturbation": "it is not implemented here; drop it",
    "--dream_training": "DREAM is not implemented here; drop it",
    "--dream_detail_preservation": "DREAM is not implemented here; drop it",
    "--use_8bit_adam": "the trainer steps torch's AdamW (fused on the CPU and CUDA); drop it",
    "--validation_epochs": "give --validation_steps (optimizer steps between validations)",
    "--enable_xformers_memory_efficient_attention": "the MLP backbones have no attention, and U-ViT's scaled_dot_product_attention picks a fused kernel; drop it",
    "--non_ema_revision": "a fine-tune starts from --pretrained_model_name_or_path at --revision; drop it",
    "--offload_ema": "the EMA weights stay on the model's device; drop it",
    "--foreach_ema": "the EMA always updates in one multi-tensor pass; drop it",
    "--local_rank": "`accelerate launch` gives each process its rank; drop it",
}
# The config fields that fit a backbone to its data and size it, lent by a preset's configuration to another family.
SKELETON_FIELDS = ("sample_size", "patch_size", "in_channels", "hidden_size", "num_layers", "text_embed_dim",
                   "text_seq_len")
# fmt: on


def validate_args(parser: argparse.ArgumentParser, args: argparse.Namespace, given: set[str] = frozenset()) -> None:
    """Fail at start-up (exit 2) with what to change, not after minutes of set-up; `given`: the options given."""
    error, data, resume = parser.error, args.dataset_name or args.train_data_dir, args.resume_from_checkpoint
    lora = [f"--{n}" for n in ("lora_alpha", "lora_target_modules", "lora_dropout") if getattr(args, n)]
    no_lora = args.lora_rank is None
    fid = [f"--{n}" for n in ("validation_fid_captions", "validation_fid_reference") if not getattr(args, n)]
    for problem, message in (
        (no_lora and lora, f"{', '.join(lora)} configure the LoRA adapter of --lora_rank: add --lora_rank"),
        (not no_lora and args.use_ema, "--use_ema does not go with --lora_rank: the adapter has no EMA copy"),
        (not no_lora and args.symmetry_breaking_weight, "--symmetry_breaking_weight does not go with --lora_rank: its penalty reads the frozen base weights"),
        (not no_lora and not args.pretrained_model_name_or_path, "--lora_rank fine-tunes a trained pipeline: pass --pretrained_model_name_or_path (or --preset shapes-lora)"),
        (args.dataset_name and args.train_data_dir, "pass either --dataset_name or --train_data_dir, not both"),
        (args.preset == "coco-f2" and not data, "--preset coco-f2 needs the COCO images: pass --train_data_dir or --dataset_name"),
        (args.data_layout == "coco2014" and not data, "--data_layout coco2014 reads --train_data_dir: pass the COCO-2014 folder there"),
        (args.streaming and not args.dataset_name, "--streaming applies to --dataset_name"),
        (args.streaming and args.cache_features, "--cache_features needs a map-style dataset: drop --streaming"),
        (args.random_flip and args.cache_features, "--random_flip cannot be combined with --cache_features (cached latents are of unflipped images)"),
        (args.cache_text_dtype and not args.cache_features, "--cache_text_dtype is how --cache_features stores text states: add --cache_features or drop it"),
        (args.shapes_num_images is not None and args.world != "shapes", "--shapes_num_images sizes the shapes world, which this run does not train on: leave it out"),
        (args.model_overrides and args.pretrained_model_name_or_path, "--model_overrides configures a new model; --pretrained_model_name_or_path fine-tunes a saved one, whose configuration is kept: drop one of them"),
        (args.overwrite_output_dir and resume, "--overwrite_output_dir trains anew, --resume_from_checkpoint continues a run: pass one of them"),
        (resume not in (None, "latest") and not Path(resume).is_dir(), f"--resume_from_checkpoint {resume}: no such checkpoint folder"),
        (resume not in (None, "latest") and not CHECKPOINT_PATTERN.match(Path(resume).name), f"--resume_from_checkpoint {resume}: not a checkpoint-<step> folder"),
        (args.validation_fid_images and not args.world and fid, f"--validation_fid_images on your data needs {' and '.join(fid)}: the captions to sample and the real images' statistics (e.g. fid_stats_mscoco256_val.npz)"),
        (args.validation_fid_reference and not Path(args.validation_fid_reference).exists(), f"--validation_fid_reference {args.validation_fid_reference}: no such file or folder"),
        ("validation_steps" in given and not (args.validation_prompts or args.world or args.validation_fid_images), f"--validation_steps {args.validation_steps} samples validation prompts, and your data has none: pass --validation_prompts (or --validation_prompts_file) or --validation_fid_images, or drop --validation_steps"),
    ):  # fmt: skip
        if problem:
            error(message)
    if args.validation_fid_captions:
        try:
            draw_captions(args.validation_fid_captions, 1)
        except ValueError as problem:
            error(str(problem).replace("--captions", "--validation_fid_captions"))
    if args.push_to_hub:  # checked now (repo id, network, token), not after hours of training
        from diffusers_lmlp.hub.upload import check_repo_id, require_token

        try:
            check_repo_id(args.hub_model_id or Path(args.output_dir).name, "--hub_model_id")
            if constants.HF_HUB_OFFLINE:
                error("--push_to_hub uploads at the end of training, but HF_HUB_OFFLINE=1 forbids any request to the "
                      f"Hub: unset it, or upload later with `python -m diffusers_lmlp.hub push {args.output_dir} "
                      "<user>/<name>`")  # fmt: skip
            require_token(args.hub_token, option="--hub_token")
        except ValueError as problem:
            error(str(problem))
    output_dir = Path(args.output_dir)
    held = list_checkpoints(output_dir) if output_dir.is_dir() else []
    held = held and f"the checkpoints of an earlier run (the last: {held[-1].name})"
    if (output_dir / SUMMARY_FILE).is_file():
        held = "a finished run (training_summary.json)"
    if held and not (args.overwrite_output_dir or resume):
        error(f"--output_dir {args.output_dir} already holds {held}. Pass --resume_from_checkpoint latest to continue "
              "it, --overwrite_output_dir to train anew over it, or another --output_dir")  # fmt: skip


def settled_model(parser: argparse.ArgumentParser, args: argparse.Namespace, preset_overrides: dict) -> dict:
    """The new backbone's family and configuration, and `--model_overrides` checked against it, on the preset's."""
    model = {} if args.pretrained_model_name_or_path else settled_model_type(parser, args)
    model_class = FAMILIES[model.get("model_type", args.model_type) or "lmlp"].model_class
    try:
        check_config_values(preset_overrides, model_class, f"--preset {args.preset}'s model_overrides")
        overrides = {**preset_overrides, **parse_overrides(args.model_overrides, model_class)}
    except ValueError as error:
        parser.error(str(error))
    return {**model, "model_overrides": overrides}


def settled_model_type(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    """`model_type`, `model_config`, `model_config_values` and `model_skeleton` of a new model: the family is
    --model_type, else the configuration's, else lmlp; a preset's configuration of another family lends a skeleton."""
    named, config = named_configs(), args.model_config
    if config is not None and config.endswith(".json"):
        try:
            values, config_family = read_model_config_file(Path(config))
            if config_family is not None and args.model_type not in (None, config_family):
                raise ValueError(f"--model_config {config} is a --model_type {config_family} config (its _class_name)")
            model_type = args.model_type or config_family or "lmlp"
            check_config_values(values, FAMILIES[model_type].model_class, f"--model_config {config}")
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
    """`--model_overrides` `KEY=VALUE` pairs as config values (JSON, else a string), checked against `model_class`."""
    overrides = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep:
            raise ValueError(f"--model_overrides takes KEY=VALUE pairs, got {pair!r}; {accepted_keys(model_class)}")
        value = text  # unless it is JSON
        with contextlib.suppress(json.JSONDecodeError):
            value = json.loads(text)
        check_config_values({key: value}, model_class, f"--model_overrides {pair}", shown={key: text})
        overrides[key] = value
    return overrides


def accepted_keys(model_class: type) -> str:
    keys = sorted(name for name in inspect.signature(model_class.__init__).parameters if name != "self")
    return f"the accepted keys of {model_class.__name__} are {', '.join(keys)}"


def check_config_values(values: dict, model_class: type, source: str, shown: dict | None = None) -> None:
    """Refuse config values `model_class` does not take (unknown keys, values not of the annotated type; a bool is no
    int, an int is a float), naming `source`; `shown`: how the user wrote each value."""
    parameters = inspect.signature(model_class.__init__, eval_str=True).parameters
    for key, value in values.items():
        if key.startswith("_"):
            continue
        if key not in parameters or key == "self":
            raise ValueError(f"{source}: unknown config key {key!r}; {accepted_keys(model_class)}")
        kinds = typing.get_args(parameters[key].annotation) or (parameters[key].annotation,)  # int | None → both
        if isinstance(value, bool):
            fits = bool in kinds
        else:
            fits = isinstance(value, kinds) or (isinstance(value, int) and float in kinds)
        if not (fits or inspect.Parameter.empty in kinds):
            names = " or ".join("null" if kind is type(None) else kind.__name__ for kind in kinds)
            raise ValueError(f"{source}: {key} takes {names}, got {(shown or {}).get(key, json.dumps(value))!r}")


def read_model_config_file(path: Path) -> tuple[dict, str | None]:
    """The config values of a `--model_config` JSON file, and the family its `_class_name` names if any."""
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise ValueError(f"--model_config {path}: cannot read it ({error.strerror or error})") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"--model_config {path} is not valid JSON: {error}") from None
    if not isinstance(values, dict):
        kind = type(values).__name__
        raise ValueError(f"--model_config {path} must hold a JSON object of config values, got {kind}")
    class_name = values.get("_class_name")
    try:
        family = family_of(class_name).name if isinstance(class_name, str) else None
    except ValueError as error:
        raise ValueError(f"--model_config {path}: {error}") from None
    return {k: v for k, v in values.items() if not k.startswith("_")}, family


def component_sources(args: argparse.Namespace) -> dict:
    """`text_encoder_source` and `vae_source`; a base pipeline's missing folder or file is named now."""
    option, base = "--pretrained_model_name_or_path", args.pretrained_model_name_or_path
    if base and Location(base, option).local:
        base = Path(base)
        if not (base / "model_index.json").is_file():
            raise ValueError(f"{option} {base} is not a saved pipeline: it has no model_index.json")
        for name, files in (*((n, ("config.json",)) for n in ("transformer", "vae", "text_encoder")),
                            ("tokenizer", TOKENIZER_FILES)):  # fmt: skip
            if not (base / name).is_dir():
                raise ValueError(f"{option} {base} has no {name}/ folder: the {name} is missing")
            if not any((base / name / file).is_file() for file in files):
                raise ValueError(f"{option} {base}: the {name} folder {base / name} has no {' or '.join(files)}")
    defaults = not base and not args.world
    text = args.pretrained_text_encoder or (COCO_TEXT_ENCODER_REPO if defaults else None)
    vae = args.pretrained_vae or (COCO_VAE_REPO if defaults else None)
    text_source = resolve_text_encoder(text, args.text_encoder_subfolder) if text else None
    return dict(text_encoder_source=text_source, vae_source=resolve_vae(vae, args.vae_subfolder) if vae else None)


CONSOLE_SCRIPT = "diffusers-lmlp-train"  # setup.py installs the command under this name
DESCRIPTION = """Train a text-to-image backbone of any of the package's block families (--model_type) with 🤗 accelerate,
from a laptop CPU to many GPUs.

    accelerate launch -m diffusers_lmlp.train                        # the embedded shapes world
    accelerate launch -m diffusers_lmlp.train --preset coco-f2 ...   # the L-MLP paper's COCO run
    # the same: `diffusers-lmlp-train` (one process), or examples/train_text_to_image.py in a checkout

Without data it trains a small UL-MLP on the shapes world, then scores its samples; --lora_rank fine-tunes LoRA
adapters of a saved pipeline. Options follow diffusers' train_text_to_image.py; a resumed run continues exactly.
"""
# `--lr_scheduler`: diffusers' `get_scheduler` names.
LR_SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
                 "piecewise_constant")  # fmt: skip


def option(default=None, help: str = "", **parser_kwargs):
    """A `TrainingConfig` field that `build_parser` makes `--<field>` with `add_argument`'s keywords (`group`: new)."""
    value = dict(default_factory=dict) if default == {} else dict(default=default)
    return field(**value, metadata=dict(help=help, **parser_kwargs))


INT, POSITIVE = number(int, 0), number(int, 1)


@dataclass(frozen=True)
class TrainingConfig:
    """The trainer's settings: the options, then what `parse_args` settles. A preset is an instance of defaults."""

    preset: str | None = None
    model_type: str | None = option(None, "the block family (default: --model_config's, else lmlp; or the base pipeline's)", group="model", choices=sorted(FAMILIES))  # fmt: skip
    model_config: str | None = option(None, f"a named configuration ({', '.join(named_configs())}) or a JSON file of config values (default: the family's, the papers' COCO model)")  # fmt: skip
    model_overrides: dict = option({}, "config values of a new model, e.g. num_layers=12; added to the preset's (the shapes preset sets pooled_text_projection=true)", nargs="*", metavar="KEY=VALUE")  # fmt: skip
    pretrained_model_name_or_path: str | None = option(None, "a saved LMLPPipeline (a folder or Hub id) to fine-tune, or to fine-tune with LoRA (--lora_rank)")  # fmt: skip
    revision: str | None = option(None, "the Hub revision (branch, tag or commit) of --pretrained_model_name_or_path")
    variant: str | None = option(None, "the weights variant of the base backbone, e.g. fp16")
    lora_rank: int | None = option(None, "train a LoRA adapter of this rank instead of the whole backbone; saved as pytorch_lora_weights.safetensors with a card", type=POSITIVE, group="LoRA (fine-tune adapters of --pretrained_model_name_or_path's backbone)")  # fmt: skip
    lora_alpha: float | None = option(None, "the update is scaled by alpha / rank (default: rank)", type=number(float, above=0))  # fmt: skip
    lora_dropout: float = option(0.0, "dropout on the adapter's input", type=number(float, 0, below=1))
    lora_target_modules: list[str] | None = option(None, "the layers to adapt, by name or name suffix (e.g. left right merge); default: every nn.Linear of every block", nargs="+", metavar="NAME")  # fmt: skip
    pretrained_vae: str | None = option(None, f"Hub id or folder of an AutoencoderKL: standalone (config.json at its root) or a pipeline's vae/ (default: {COCO_VAE_REPO}, or the shapes VAE without data)", group="frozen components")  # fmt: skip
    vae_subfolder: str | None = option(None, "the VAE's folder in --pretrained_vae ('' for its root; default: detected)")  # fmt: skip
    pretrained_text_encoder: str | None = option(None, f"Hub id or folder of a CLIP tokenizer and text model: a CLIP repo ({COCO_TEXT_ENCODER_REPO}, the default) or a pipeline with text_encoder/ and tokenizer/")  # fmt: skip
    text_encoder_subfolder: str | None = option(None, "the text model's folder in --pretrained_text_encoder ('' for its root; the tokenizer is read from tokenizer/ if there is one, else beside it; default: detected)")  # fmt: skip
    latent_scale: float | None = option(None, "latent scaling factor (default: the VAE config's)", type=float)
    dataset_name: str | None = option(None, "a datasets Hub id, a local dataset folder, or a save_to_disk folder", group="data")  # fmt: skip
    dataset_config_name: str | None = option(None, "the configuration of --dataset_name, if it has several")
    streaming: bool = option(False, "read --dataset_name as a stream instead of downloading it whole")
    train_data_dir: str | None = option(None, "a local folder: an imagefolder (metadata.jsonl/.csv/.parquet) or the COCO-2014 folder")  # fmt: skip
    data_layout: str = option("auto", "how --train_data_dir is laid out: auto (detected), imagefolder, or coco2014 (annotations/captions_train2014.json and train2014/; one of an image's captions at each use)", choices=DATA_LAYOUTS)  # fmt: skip
    shapes_split: str = option("train", "without data, the shapes world's combinations to train on: train (292), or heldout (the 32 the shipped model never saw)", choices=("train", "heldout"))  # fmt: skip
    shapes_num_images: int | None = option(None, "without data, how many shapes images to render and train on (default: 8000 of train, 800 of heldout)", type=POSITIVE)  # fmt: skip
    image_column: str = option("image", "the column of the images")
    caption_column: str = option("text", "the column of the captions: a caption or a list of them per image")
    max_train_samples: int | None = option(None, "train on the first N samples only", type=POSITIVE)
    resolution: int = option(256, "the side of the square training images in pixels, after a centre crop: the backbone's sample_size × the VAE's factor", type=POSITIVE)  # fmt: skip
    random_flip: bool = option(False, "mirror each image left to right at random")
    caption_dropout: float = option(0.1, 'probability of training on "" instead', type=number(float, 0, below=1))
    cache_features: bool = option(False, "encode VAE moments and text states once, into a feature store under --cache_dir (the presets' default)", action=argparse.BooleanOptionalAction)  # fmt: skip
    cache_text_dtype: str | None = option(None, "the feature store's text states (default: float32; float16 halves the store)", choices=sorted(TEXT_DTYPES))  # fmt: skip
    cache_dir: str | None = option(None, "where datasets and the feature store are kept (default: <output_dir>/../.lmlp-cache); on several machines, one all of them see")  # fmt: skip
    dataloader_num_workers: int = option(0, "worker processes that read or decode the data ahead of the steps; the batches are the same with any number", type=number(int, 0, why=" (0 reads the data in the training process)"))  # fmt: skip
    seed: int = option(0, "seeds the initial weights and every draw of the run: a run is reproducible from it, and resumes exactly", group="optimisation", type=number(int, 0, below=2**32, why=" (numpy's 32-bit seeds; every draw of the run comes from it)"))  # fmt: skip
    train_batch_size: int = option(16, "per device, per accumulation step", type=POSITIVE)
    max_train_steps: int = option(10_000, "optimizer steps to train for", type=POSITIVE)
    gradient_accumulation_steps: int = option(1, "micro-batches per optimizer step", type=POSITIVE)
    gradient_checkpointing: bool = option(False, "recompute each block's activations in the backward pass: less memory, one more forward per step")  # fmt: skip
    learning_rate: float = option(2e-4, "AdamW's peak learning rate", type=number(float, above=0))
    adam_beta1: float = option(0.9, "AdamW's beta1", type=float)
    adam_beta2: float = option(0.9, "AdamW's beta2", type=float)
    adam_weight_decay: float = option(0.03, "AdamW's decoupled weight decay", type=float)
    adam_epsilon: float = option(1e-8, "AdamW's epsilon", type=float)
    max_grad_norm: float | None = option(None, "clip gradients to this norm (off by default)", type=float)
    lr_scheduler: str = option("constant_with_warmup", "the schedule after --lr_warmup_steps of linear warm-up", choices=LR_SCHEDULERS)  # fmt: skip
    lr_warmup_steps: int = option(5000, "steps of linear warm-up from 0", type=INT)
    snr_gamma: float | None = option(None, "Min-SNR loss weighting (5.0 is the usual value)", type=float)
    noise_offset: float = option(0.0, "scale of a per-channel offset added to the noise", type=float)
    load_balance_weight: float = option(0.0, "MoE-MLP balancing loss (paper: 0.01)", type=number(float, 0))
    symmetry_breaking_weight: float = option(0.0, "AsymMixer's penalty λ·Σ‖W̃‖²_F", type=number(float, 0))
    use_ema: bool = option(False, "keep an exponential moving average of the weights, saved as the pipeline's", action=argparse.BooleanOptionalAction)  # fmt: skip
    ema_decay: float = option(0.9999, "the EMA's decay per step", type=float)
    num_threads: int | None = option(None, "CPU threads of a one-process CPU run (default: your OMP_NUM_THREADS, else every core)", type=POSITIVE)  # fmt: skip
    mixed_precision: str | None = option(None, "autocast the backbone's forward (default: accelerate's config); auto is bf16 where it is native, else float32", choices=["no", "fp16", "bf16", "auto"])  # fmt: skip
    torch_compile: str | None = option(None, "compile the backbone for training (default: accelerate's --dynamo_backend); auto compiles where a trial works and the run has >= 1000 steps", choices=["yes", "no", "auto"])  # fmt: skip
    allow_tf32: bool = option(False, "let float32 matmuls use TF32 on Ampere and newer GPUs; no effect on CPU")
    output_dir: str = option("lmlp-model", "where the pipeline, checkpoints, samples and logs are written", group="output, logging, validation")  # fmt: skip
    overwrite_output_dir: bool = option(False, "train from step 0 into an --output_dir that holds a run (its checkpoints and summary are removed)")  # fmt: skip
    logging_dir: str = option("logs", "the trackers' folder, inside --output_dir")
    logging_steps: int = option(1, "send the trackers the mean loss and gradient norm of every N steps", type=POSITIVE)
    report_to: str = option("tensorboard", '"tensorboard", "wandb", "all" or "none"')
    tracker_project_name: str = option("lmlp-text-to-image", "the project name in tensorboard or wandb")
    validation_prompts: list[str] | None = option(None, "prompts sampled every --validation_steps and at the end", nargs="*", exclusive=True)  # fmt: skip
    validation_prompts_file: str | None = option(None, "a UTF-8 file of validation prompts, one per line (# comments)", metavar="PATH", exclusive=True)  # fmt: skip
    validation_steps: int = option(1000, "validate every N steps", type=int)
    validation_inference_steps: int = option(25, "sampler steps of the validation images", type=POSITIVE)
    validation_guidance_scale: float = option(GUIDANCE_SCALE, "guidance scale of the validation images (diffusers' g; the papers' s = g - 1)", type=float)  # fmt: skip
    final_evaluation_inference_steps: int = option(NUM_INFERENCE_STEPS, "sampler steps of the world's final evaluation", type=POSITIVE)  # fmt: skip
    validation_fid_images: int = option(0, "at every validation, sample this many images and log their FID", type=number(int, 0, why=" (0: no FID during training)"))  # fmt: skip
    validation_fid_captions: str | None = option(None, "the captions FID samples, as the evaluation's --captions takes them (default on the shapes world: shapes:train)", metavar="SOURCE")  # fmt: skip
    validation_fid_reference: str | None = option(None, "what that FID compares with: an .npz of mu/sigma or a folder of real images", metavar="PATH")  # fmt: skip
    checkpointing_steps: int = option(1000, "write a checkpoint every N steps, and at the end", type=POSITIVE)
    checkpoints_total_limit: int | None = option(None, "keep the newest N checkpoints (and one more until the steps after it prove healthy)", type=number(int, 1, why=" (or left out to keep all)"))  # fmt: skip
    resume_from_checkpoint: str | None = option(None, '"latest" or a checkpoint folder')
    push_to_hub: bool = option(False, "upload the finished pipeline (or LoRA) to the Hub")
    hub_model_id: str | None = option(None, "the Hub repo to push to (default: --output_dir's name)")
    hub_token: str | None = option(None, "used for the upload only: never logged, tracked or written")
    # settled by `parse_args`
    world: str | None = None  # the embedded world trained on and scored, without data
    model_config_from_preset: bool = False
    mixed_precision_from_preset: bool = False
    model_config_values: dict | None = None  # a --model_config JSON file's values
    model_skeleton: dict = field(default_factory=dict)  # lent by a preset's named configuration of another family
    text_encoder_source: TextEncoderSource | None = None
    vae_source: VaeSource | None = None


# The shapes and emoji worlds' recipes (docs/shapes-runs.md, docs/emoji.md): a small UL-MLP whose pooled text state
# is added to every image token, bf16 and torch.compile where they pay, cosine decay, Min-SNR weighting and a short EMA.
# `--preset NAME`: the PRESETS' defaults; explicit arguments still win.
SMALL_WORLD = dict(model_overrides={"pooled_text_projection": True}, mixed_precision="auto", torch_compile="auto",
                   resolution=32, lr_scheduler="cosine", snr_gamma=1.0, adam_beta2=0.99, adam_weight_decay=0.05,
                   use_ema=True, cache_features=True, checkpoints_total_limit=2, logging_steps=10,
                   validation_inference_steps=NUM_INFERENCE_STEPS, validation_guidance_scale=GUIDANCE_SCALE)  # fmt: skip
# fmt: off
PRESETS = {
    "shapes": TrainingConfig(**SMALL_WORLD, model_config="shapes-S", train_batch_size=64, max_train_steps=10400,
                             learning_rate=3e-3, lr_warmup_steps=100, ema_decay=0.99, checkpointing_steps=1300,
                             validation_steps=1300, output_dir="lmlp-shapes"),
    # The L-MLP paper's MS-COCO run: F2-deep, SD VAE, CLIP L/14, batch 256 (32 per GPU on 8 GPUs), 1M steps.
    "coco-f2": TrainingConfig(model_config="F2-deep", pretrained_vae=COCO_VAE_REPO,
                              pretrained_text_encoder=COCO_TEXT_ENCODER_REPO, latent_scale=0.23010, resolution=256,
                              train_batch_size=32, max_train_steps=1_000_000, learning_rate=2e-4, lr_warmup_steps=5000,
                              use_ema=True, ema_decay=0.9999, cache_features=True, mixed_precision="fp16",
                              checkpointing_steps=10_000, validation_steps=5000, output_dir="lmlp-coco-f2"),
    "emoji": TrainingConfig(**SMALL_WORLD, model_config="emoji-S", train_batch_size=128, max_train_steps=4000,
                            learning_rate=2e-3, lr_warmup_steps=200, ema_decay=0.999, cache_text_dtype="float16",
                            checkpointing_steps=1000, validation_steps=500, output_dir="lmlp-emoji"),
    # LoRA: teach the shipped shapes model the 32 combinations held out of its training; scored before and after.
    "shapes-lora": TrainingConfig(
        pretrained_model_name_or_path=str(SHAPES_PIPELINE_PATH), shapes_split="heldout", lora_rank=8, resolution=32,
        train_batch_size=64, max_train_steps=400, learning_rate=1e-3, adam_beta2=0.99, adam_weight_decay=0.0,
        lr_warmup_steps=20, cache_features=True, checkpointing_steps=200, checkpoints_total_limit=1,
        validation_steps=200, logging_steps=10, validation_inference_steps=NUM_INFERENCE_STEPS,
        validation_guidance_scale=GUIDANCE_SCALE, output_dir="lmlp-shapes-lora"),
}
# fmt: on
WORLD_PRESETS = {"shapes": "shapes", "shapes-lora": "shapes", "emoji": "emoji"}  # trained on and scored, without data


def build_parser() -> argparse.ArgumentParser:
    """The trainer's options (`TrainingConfig`'s fields), with the diffusers example's names where it has them."""
    parser = argparse.ArgumentParser(
        prog=program_name(CONSOLE_SCRIPT, "diffusers_lmlp.train"), description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter
    )  # fmt: skip
    parser.add_argument("--preset", choices=sorted(PRESETS), help="recipe defaults (without data: shapes, or "
                        "shapes-lora with --lora_rank)")  # fmt: skip
    group, prompts = parser, None
    for spec in fields(TrainingConfig):
        kwargs = dict(spec.metadata)
        if not kwargs:
            continue
        if "group" in kwargs:
            group = parser.add_argument_group(kwargs.pop("group"))
        target = group
        if kwargs.pop("exclusive", False):
            target = prompts = prompts or group.add_mutually_exclusive_group()
        if isinstance(spec.default, bool):
            kwargs.setdefault("action", "store_true")
        target.add_argument(f"--{spec.name}", **kwargs)
    parser.set_defaults(**option_defaults(parser, TrainingConfig()))
    return parser


def option_defaults(parser: argparse.ArgumentParser, config: TrainingConfig) -> dict:
    """`config`'s values as the parser's defaults; --model_overrides' pairs come on top of the config's values."""
    return {a.dest: getattr(config, a.dest) for a in parser._actions if a.dest != "help"} | {"model_overrides": []}


def parse_args(argv: list[str] | None = None) -> TrainingConfig:
    """Parse and check the options (default: `sys.argv[1:]`), exiting (2) with what to change when one is wrong."""
    parser = build_parser()
    # The options given (abbreviated or not): argparse sets a default only where the namespace lacks the attribute.
    unset = object()
    marked = argparse.Namespace(**{a.dest: unset for a in parser._actions if a.dest != argparse.SUPPRESS})
    given = {dest for dest, value in vars(parser.parse_known_args(argv, marked)[0]).items() if value is not unset}
    uses_data = bool({"dataset_name", "train_data_dir"} & given)
    known, unknown = parser.parse_known_args(argv)
    if theirs := [option for option in (a.split("=", 1)[0] for a in unknown) if option in DIFFUSERS_ONLY_OPTIONS]:
        why = (f"{o} is an option of diffusers' train_text_to_image.py: {DIFFUSERS_ONLY_OPTIONS[o]}" for o in theirs)
        parser.error("\n".join(why))
    # A preset changes defaults only: parse again with its defaults in place.
    preset = known.preset or (None if uses_data else ("shapes-lora" if known.lora_rank else "shapes"))
    base = PRESETS[preset] if preset else TrainingConfig()
    parser.set_defaults(**option_defaults(parser, base))
    args = parser.parse_args(argv)
    args.preset, args.world = preset, None if uses_data else WORLD_PRESETS.get(preset)
    args.model_config_from_preset = bool(preset) and "model_config" not in given
    args.mixed_precision_from_preset = bool(preset) and "mixed_precision" not in given
    try:
        if args.validation_prompts_file:  # read once, checked and kept
            args.validation_prompts = read_captions_file(args.validation_prompts_file, "--validation_prompts_file")
        validate_args(parser, args, given)
        sources = component_sources(args)
    except ValueError as error:
        parser.error(str(error))
    # A preset's model options stay unless a saved model is fine-tuned.
    keep_preset = "model_overrides" in given or not args.pretrained_model_name_or_path
    model = settled_model(parser, args, base.model_overrides if keep_preset else {})
    return TrainingConfig(**{**vars(args), **sources, **model})
