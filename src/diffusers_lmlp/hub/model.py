"""Publish a saved pipeline folder as a Hub model repo: what belongs in the upload, its card, the one commit."""

import json
import logging
import os
from collections.abc import Sequence
from fnmatch import fnmatch
from pathlib import Path

import torch
from huggingface_hub import CommitInfo

from ..folders import PICKLE_SUFFIXES
from ..image_grid import make_image_grid
from ..models.families import family_of
from ..models.saving import is_local_path
from ..pipelines import LMLPPipeline
from ..pipelines.schedulers import check_scheduler
from .card import describe_pipeline, update_card, usage_section, without_block
from .remote_code import add_remote_code, check_component_names, name_package_classes, package_model_index
from .upload import (
    IMAGE_LIMIT,
    TEXT_LIMIT,
    SizeLimit,
    StagedUpload,
    check_final_form,
    check_repo_id,
    copy_tree,
    list_files,
    publish_model_repo,
    staging,
)


logger = logging.getLogger(__name__)

# Uploaded: safetensors weights, configs, tokenizer files, images and the card. Never pickles, code (only what
# `--with-code` generates, `.remote_code`), training state or logs; never links or credentials (`.upload`).
UPLOAD_SUFFIXES = (".safetensors", ".json", ".txt", ".png", ".jpg", ".jpeg")
SKIPPED_FOLDERS = ("checkpoint-*", "logs", "__pycache__", "*.tmp", ".*")
SAMPLE_GRID = "samples.png"
# The keys of a saved config that record where its component was loaded from (`leave_out_local_paths`).
LOCAL_PATH_KEYS = ("_name_or_path", "name_or_path")
TRAINING_SUMMARY = "training_summary.json"
# A prompt whose tokens show whether a staged tokenizer splits text as the source's does.
TOKENIZER_PROBE = "a red circle on a blue square, photographed at dusk"


def check_pipeline_folder(folder: str | os.PathLike) -> Path:
    """`folder` as a `Path`; raise, saying what is wrong, unless it is a saved `LMLPPipeline` whose
    `model_index.json` names its components by plain names (`check_component_names`)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder; pass the folder that LMLPPipeline.save_pretrained wrote.")
    index = folder / "model_index.json"
    if not index.is_file():
        raise ValueError(
            f"{folder} is not a saved pipeline: it has no model_index.json. Pass the folder that "
            "LMLPPipeline.save_pretrained (or the trainer's --output_dir) wrote; a LoRA folder has pytorch_lora_weights.safetensors instead."
        )
    # A folder pushed with --with-code names its pipeline ["<file stem>", "LMLPPipeline"] (see `.remote_code`).
    model_index = package_model_index(json.loads(index.read_text(encoding="utf-8")))
    class_name = model_index.get("_class_name")
    if class_name != LMLPPipeline.__name__:
        raise ValueError(f"{folder} holds a {class_name}, not an LMLPPipeline; this command publishes LMLPPipelines.")
    check_component_names(model_index, index)
    return folder


def left_out_folder(path: str) -> str | None:
    """Why a folder of a pipeline folder (POSIX path relative to it) is not uploaded, or None if its files may be."""
    name = path.rsplit("/", 1)[-1]
    pattern = next((pattern for pattern in SKIPPED_FOLDERS if fnmatch(name, pattern)), None)
    return f"matches {pattern!r}: training state, logs, caches and hidden folders stay local" if pattern else None


def left_out_file(path: str) -> str | None:
    """Why a file of a pipeline folder (POSIX path relative to it) is not uploaded, or None if it belongs."""
    name = path.rsplit("/", 1)[-1]
    if path == "README.md":
        return None
    if name.startswith("."):
        return "a hidden file"
    if name.endswith(PICKLE_SUFFIXES):
        return "pickled (only safetensors weights are uploaded, so that loading never unpickles)"
    if name.endswith(".py"):
        return "code: a push uploads none of the folder's own (--with-code adds code generated from the package)"
    if not name.endswith(UPLOAD_SUFFIXES):
        return f"not weights, a config, a tokenizer file or an image ({', '.join(UPLOAD_SUFFIXES)})"
    return None


def size_limit(path: str) -> SizeLimit | None:
    """The size limit of a file of the upload (POSIX path relative to the folder); None for the weights."""
    if path.endswith(".safetensors"):
        return None
    return IMAGE_LIMIT if path.endswith((".png", ".jpg", ".jpeg")) else TEXT_LIMIT


def same_tokenizer(a, b) -> bool:
    """Whether two tokenizers (either may be None) have the same vocabulary and split a probe prompt the same way."""
    if a is None or b is None:
        return a is b
    return a.get_vocab() == b.get_vocab() and a(TOKENIZER_PROBE).input_ids == b(TOKENIZER_PROBE).input_ids


def load_staged(staged: Path, refused: dict[str, str], pipe: LMLPPipeline) -> LMLPPipeline:
    """The pipeline loaded from the staged copy, its progress bar off. Raise if it does not load or, when files were
    `refused`, if it tokenizes unlike the source's `pipe`: a refused file may be one it needs, and transformers builds
    an empty tokenizer from a folder without its tokenizer.json."""
    try:
        uploaded = LMLPPipeline.from_pretrained(staged)
        problem = (
            None if not refused or same_tokenizer(pipe.tokenizer, uploaded.tokenizer) else "its tokenizer differs"
        )
    except Exception as err:  # whatever diffusers or transformers raise for a folder that lacks a file
        problem = f"loading it fails with {type(err).__name__}: {str(err).rstrip('.')}"
    if problem and refused:
        listed = "; ".join(f"{path}: {reason}" for path, reason in refused.items())
        raise ValueError(
            f"Without the files refused for upload ({listed}), the uploaded pipeline would not work: {problem}. "
            "Replace links with the files themselves (cp -L), rename files that are not credentials, and remove "
            "secrets from files."
        )
    if problem:
        raise ValueError(
            f"The staged copy of the pipeline does not load ({problem}): did the folder change while it "
            "was staged? Stage it again."
        )
    uploaded.set_progress_bar_config(disable=True)
    return uploaded


def stage_pipeline(
    folder: str | os.PathLike,
    repo_id: str,
    output_dir: str | os.PathLike | None = None,
    license: str | None = None,
    base_model: str | None = None,
    datasets: Sequence[str] | None = None,
    sample_prompts: Sequence[str] | None = None,
    sample_steps: int = 25,
    seed: int = 0,
    with_code: bool = False,
) -> StagedUpload:
    """Build the exact folder that `push_pipeline` uploads, card included; the source folder is not changed.

    The pipeline must load and pass `check_scheduler` first; then only the staged copy (with the refusals of
    `diffusers_lmlp.hub.upload`) is read, so the card, sample grid and code describe what is uploaded. An existing
    card keeps its text; its metadata and usage block are updated.

    Args:
        folder (`str` or `os.PathLike`): The saved pipeline.
        repo_id (`str`): The model repo it is for (the card's usage snippet loads it).
        output_dir (`str` or `os.PathLike`, *optional*): A new or empty folder to stage in; default: a temporary one.
        license (`str`, *optional*): The card's license (default: the card's own, else apache-2.0).
        base_model (`str`, *optional*): The Hub model it was fine-tuned from.
        datasets (`Sequence[str]`, *optional*): Hub datasets it was trained on.
        sample_prompts (`Sequence[str]`, *optional*): Prompts for a captioned `samples.png`, replacing the folder's.
        sample_steps (`int`, *optional*, defaults to 25): Sampling steps for the grid.
        seed (`int`, *optional*, defaults to 0): Seed of the grid's noise.
        with_code (`bool`, *optional*, defaults to `False`): Add code generated from the installed package, so that
            `trust_remote_code=True` loads the repo without it (`diffusers_lmlp.hub.remote_code`).

    Returns:
        `StagedUpload`: The staging folder, its files, and what of the source was left out or refused.
    """
    folder = check_pipeline_folder(folder)
    check_card_repo_ids(repo_id, base_model, datasets)
    with staging(output_dir, "lmlp-upload-", source=folder) as target:
        left_out, refused = copy_tree(folder, target, left_out_folder, left_out_file, size_limit)
        refuse_secrets_loading_reads(folder, refused)
        source_pipe = LMLPPipeline.from_pretrained(folder)
        check_scheduler(source_pipe.scheduler)  # a repo whose scheduler would draw wrong images is not published
        # From here on only the staged copy is read: what is checked and described is what is uploaded.
        leave_out_local_paths(target)
        pipe = load_staged(target, refused, source_pipe)
        if sample_prompts:
            write_sample_grid(pipe, target, sample_prompts, sample_steps, seed)
        if with_code:
            code_files = add_remote_code(target)
        else:
            code_files = None
            name_package_classes(target)
        write_card(target, pipe, repo_id, code_files, license=license, base_model=base_model, datasets=datasets)
        check_final_form(target)
    return StagedUpload(target, list_files(target), left_out, refused)


def refuse_secrets_loading_reads(folder: Path, refused: dict[str, str]) -> None:
    """Raise if a file that loading the pipeline reads (`model_index.json`, its components' folders) holds a secret:
    the pipeline would not load without it, and diffusers prints the config values it does not expect."""
    components = json.loads((folder / "model_index.json").read_text(encoding="utf-8"))
    read = [path for path in refused if path == "model_index.json" or path.split("/")[0] in components]
    if secrets := {path: refused[path] for path in read if refused[path].startswith("holds ")}:
        listed = "; ".join(f"{path}: {reason}" for path, reason in secrets.items())
        raise ValueError(f"The pipeline cannot be published: {listed}.")


def leave_out_local_paths(folder: Path) -> None:
    """Take this machine's paths out of a staged pipeline's configs: diffusers' `_name_or_path` (in folders that
    `LMLPPipeline.save_pretrained` did not write) and old transformers tokenizers' `name_or_path`. A Hub repo id
    stays; no loader reads either key."""
    configs = [
        folder / "model_index.json",
        *sorted(folder.glob("*/config.json")),
        *sorted(folder.glob("*/*_config.json")),
    ]
    for path in configs:
        config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
        local = [key for key in LOCAL_PATH_KEYS if isinstance(config, dict) and is_local_path(config.get(key))]
        if local:
            path.write_text(
                json.dumps({k: v for k, v in config.items() if k not in local}, indent=2, sort_keys=True) + "\n",
                encoding="utf-8",
            )
            logger.info(f"{path.relative_to(folder).as_posix()}: left out {', '.join(local)}, a path of this machine")


def check_card_repo_ids(repo_id: str, base_model: str | None, datasets: Sequence[str] | None) -> None:
    """Raise unless the model repo, the base model and the datasets the card names are valid repo ids."""
    check_repo_id(repo_id, "model repo id")
    if base_model:
        check_repo_id(base_model, "base model")
    for dataset in datasets or []:
        check_repo_id(dataset, "dataset")


def write_sample_grid(pipe: LMLPPipeline, target: Path, prompts: Sequence[str], steps: int, seed: int) -> None:
    """Sample one image per prompt and save them as a captioned grid, `SAMPLE_GRID`, in the staged folder."""
    images = pipe(list(prompts), num_inference_steps=steps, generator=torch.Generator().manual_seed(seed)).images
    make_image_grid(images, captions=list(prompts)).save(target / SAMPLE_GRID)


def write_card(
    target: Path,
    pipe: LMLPPipeline,
    repo_id: str,
    code_files: list[str] | None,
    license: str | None,
    base_model: str | None,
    datasets: Sequence[str] | None,
) -> None:
    """Write the staged folder's `README.md`: its own card with the metadata and usage block updated, or a new one
    described from `pipe` and `TRAINING_SUMMARY`; `code_files` are the generated files of a push with the code."""
    card_path = target / "README.md"
    existing = card_path.read_text(encoding="utf-8") if card_path.is_file() else None
    grid = SAMPLE_GRID if (target / SAMPLE_GRID).is_file() else None
    summary_path = target / TRAINING_SUMMARY
    summary = json.loads(summary_path.read_text(encoding="utf-8")) if summary_path.is_file() else None
    if existing is None:
        description = describe_pipeline(
            pipe, repo_id.split("/")[-1], summary=summary, sample_grid=grid, base_model=base_model
        )
        usage = usage_section(repo_id, summary=summary, code_files=code_files, tokenizer=pipe.tokenizer)
        blocks = {"description": description, "usage": usage}
    else:
        unshown = None if grid is not None and grid in without_block(existing, "usage") else grid
        blocks = {
            "usage": usage_section(
                repo_id, sample_grid=unshown, summary=summary, code_files=code_files, tokenizer=pipe.tokenizer
            )
        }
    card = update_card(
        existing,
        [family_of(pipe.transformer).tag],
        blocks,
        license=license,
        datasets=list(datasets) if datasets else None,
        base_model=base_model,
    )
    card.save(target / "README.md")


def push_pipeline(
    folder: str | os.PathLike,
    repo_id: str,
    token: str | None = None,
    private: bool | None = None,
    commit_message: str = "Upload LMLPPipeline",
    revision: str | None = None,
    create_pr: bool = False,
    with_code: bool = False,
    **card_options,
) -> CommitInfo:
    """Publish a saved pipeline: stage it (`stage_pipeline`), `create_repo(exist_ok=True)`, then one commit.

    Args:
        folder (`str` or `os.PathLike`): The saved pipeline.
        repo_id (`str`): The model repo, `"owner/name"` or `"name"` (then the token's user owns it).
        token (`str`, *optional*): A Hub token with write access; defaults to the one huggingface_hub finds.
        private (`bool`, *optional*): Create the repo private (an existing repo keeps its visibility).
        commit_message (`str`, *optional*, defaults to `"Upload LMLPPipeline"`): The commit's title.
        revision (`str`, *optional*): An existing branch to commit to (default `main`).
        create_pr (`bool`, *optional*, defaults to `False`): Open a pull request instead of committing directly.
        with_code (`bool`, *optional*, defaults to `False`): Also upload generated code (see `stage_pipeline`).
        **card_options: `license`, `base_model`, `datasets`, `sample_prompts`, `sample_steps`, `seed`, as for
            `stage_pipeline`.

    Returns:
        `CommitInfo`: The commit (`commit_url`, and `pr_url` with `create_pr`).
    """
    check_pipeline_folder(folder)
    check_repo_id(repo_id, "model repo id")
    return publish_model_repo(
        folder,
        repo_id,
        lambda repo, target: stage_pipeline(folder, repo, target, with_code=with_code, **card_options),
        token=token,
        private=private,
        commit_message=commit_message,
        revision=revision,
        create_pr=create_pr,
    )
