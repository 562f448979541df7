"""Where the trainer's frozen components come from: `--pretrained_vae` and `--pretrained_text_encoder` take a local
folder or Hub id, as diffusers' training examples do, holding a standalone model (`config.json` at its root) or a
full pipeline (`vae/`, `text_encoder/`, `tokenizer/`); the layout is detected, from the HF cache when it can be.

The loaders fetch exactly the files the trainer reads with huggingface_hub (or find them offline) and load from that
snapshot, without diffusers' and transformers' own Hub lookups. A text encoder loads strictly: a missing or unknown
text-model tensor is refused; a full CLIP checkpoint's vision tower is expected.
"""

import contextlib
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub.utils import HFValidationError, validate_repo_id

from ..folders import TOKENIZER_FILES


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
