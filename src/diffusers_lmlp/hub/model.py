"""Publish a saved pipeline folder, or a LoRA adapter folder (the trainer's `--lora_rank` output), as a model repo:
what belongs in the upload, its card, the one commit (`.upload`)."""

import json
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from huggingface_hub import CommitInfo

from ..folders import PICKLE_SUFFIXES
from ..image_grid import make_image_grid
from ..models.families import family_of
from ..models.loading import is_local_path
from ..pipelines import LMLPPipeline
from ..pipelines.schedulers import check_scheduler
from . import upload
from .card import describe_pipeline, hub_id_or_none, save_card, usage_section, without_block
from .lora_card import lora_usage_section, public_base_model
from .remote_code import add_remote_code, check_component_names, name_package_classes, package_model_index


logger = logging.getLogger(__name__)

# Uploaded: safetensors weights, configs, tokenizer files, images and the card.
UPLOAD_SUFFIXES = (".safetensors", ".json", ".txt", ".png", ".jpg", ".jpeg")
SKIPPED_FOLDERS = ("checkpoint-*", "logs", "__pycache__", "*.tmp", ".*")
SAMPLE_GRID = "samples.png"
LOCAL_PATH_KEYS = ("_name_or_path", "name_or_path")  # where a saved config's component was loaded from
TRAINING_SUMMARY = "training_summary.json"
LORA_FILE = "pytorch_lora_weights.safetensors"
TOKENIZER_PROBE = "a red circle on a blue square, photographed at dusk"


def check_pipeline_folder(folder: str | os.PathLike) -> Path:
    """`folder` as a `Path`; raise unless it is a saved `LMLPPipeline` with plain `model_index.json` keys."""
    folder, index = Path(folder), Path(folder) / "model_index.json"
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder; pass the folder that LMLPPipeline.save_pretrained wrote.")
    if not index.is_file():
        raise ValueError(
            f"{folder} is not a saved pipeline: it has no model_index.json (a LoRA folder has {LORA_FILE})."
        )
    model_index = package_model_index(json.loads(index.read_text(encoding="utf-8")))  # maps --with-code entries back
    if (class_name := model_index.get("_class_name")) != LMLPPipeline.__name__:
        raise ValueError(f"{folder} holds a {class_name}, not an LMLPPipeline; this command publishes LMLPPipelines.")
    check_component_names(model_index, index)
    return folder


def is_lora_folder(folder: str | os.PathLike) -> bool:
    return (Path(folder) / LORA_FILE).is_file() and not (Path(folder) / "model_index.json").exists()


def check_lora_folder(folder: str | os.PathLike) -> Path:
    if not is_lora_folder(folder):
        raise ValueError(f"{folder} is not a LoRA adapter folder: it has no {LORA_FILE} (or it is a pipeline).")
    return Path(folder)


left_out_folder = upload.ignored(SKIPPED_FOLDERS, "matches {pattern}: training state, logs and caches stay local")


def left_out_file(path: str) -> str | None:
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


def size_limit(path: str):  # none for the weights
    if not path.endswith(".safetensors"):
        return upload.IMAGE_LIMIT if path.endswith(UPLOAD_SUFFIXES[3:]) else upload.TEXT_LIMIT


def load_staged(staged: Path, refused: dict[str, str], pipe: LMLPPipeline) -> LMLPPipeline:
    """The pipeline loaded from the staged copy. Raise if it does not load or, when files were `refused`, if it
    tokenizes unlike the source's `pipe` (transformers builds an empty tokenizer from a folder without its files)."""
    try:
        uploaded = LMLPPipeline.from_pretrained(staged)
        a, b = pipe.tokenizer, uploaded.tokenizer
        same = a is b if a is None or b is None else (
            a.get_vocab() == b.get_vocab() and a(TOKENIZER_PROBE).input_ids == b(TOKENIZER_PROBE).input_ids
        )  # fmt: skip
        problem = None if not refused or same else "its tokenizer differs"
    except Exception as err:  # whatever diffusers or transformers raise for a folder that lacks a file
        problem = f"loading it fails with {type(err).__name__}: {str(err).rstrip('.')}"
    if problem:
        listed = "; ".join(f"{path}: {reason}" for path, reason in refused.items())
        raise ValueError(
            f"Without the files refused for upload ({listed}), the uploaded pipeline would not work: {problem}. "
            "Replace links with the files themselves (cp -L), rename or clean the refused files."
            if refused
            else f"The staged copy of the pipeline does not load ({problem}): stage it again."
        )
    uploaded.set_progress_bar_config(disable=True)
    return uploaded


def leave_out_local_paths(folder: Path) -> None:
    """Take this machine's paths out of a staged pipeline's configs (diffusers' `_name_or_path`, old tokenizers'
    `name_or_path`); a Hub repo id stays, and no loader reads either key."""
    for path in [
        folder / "model_index.json",
        *sorted({*folder.glob("*/config.json"), *folder.glob("*/*_config.json")}),
    ]:
        config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
        if local := [key for key in LOCAL_PATH_KEYS if isinstance(config, dict) and is_local_path(config.get(key))]:
            kept = {k: v for k, v in config.items() if k not in local}
            path.write_text(json.dumps(kept, indent=2, sort_keys=True) + "\n", encoding="utf-8")
            logger.info(f"{path.relative_to(folder).as_posix()}: left out {', '.join(local)}, a path of this machine")


def _stage(folder: Path, repo_id: str, output_dir, base_model: str | None, fill: Callable) -> upload.StagedUpload:
    """Copy `folder` under the guards, `fill(target, refused, card text or None, summary)`, scan the result."""
    upload.check_repo_id(repo_id, "model repo id")
    if base_model:
        upload.check_repo_id(base_model, "base model")
    with upload.staging(output_dir, "lmlp-upload-", source=folder) as target:
        left_out, refused = upload.copy_tree(folder, target, left_out_folder, left_out_file, size_limit)
        card, summary = target / "README.md", target / TRAINING_SUMMARY
        existing = card.read_text(encoding="utf-8") if card.is_file() else None
        fill(target, refused, existing, json.loads(summary.read_text(encoding="utf-8")) if summary.is_file() else {})
        upload.check_final_form(target)
    return upload.StagedUpload(target, upload.list_files(target), left_out, refused)


def _grid_for_usage(target: Path, existing: str | None) -> str | None:
    """The sample grid, for a usage block of a card that does not show it yet."""
    shown = existing is not None and SAMPLE_GRID in without_block(existing, "usage")
    return SAMPLE_GRID if (target / SAMPLE_GRID).is_file() and not shown else None


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
) -> upload.StagedUpload:
    """Build the exact folder `push_pipeline` uploads, card included, in `output_dir` (new or empty; default: a
    temporary one). Once the source loads and passes `check_scheduler` only the staged copy is read, so the card, the
    sample grid and the code describe what is uploaded; an existing card keeps its own text."""
    folder = check_pipeline_folder(folder)
    for dataset in datasets or []:
        upload.check_repo_id(dataset, "dataset")

    def fill(target, refused, existing, summary):
        # A secret in a file loading reads: the pipeline would not load without it, and diffusers prints config values.
        components = json.loads((folder / "model_index.json").read_text(encoding="utf-8"))
        read = [p for p in refused if p == "model_index.json" or p.split("/")[0] in components]
        if secrets := [f"{p}: {refused[p]}" for p in read if refused[p].startswith("holds ")]:
            raise ValueError(f"The pipeline cannot be published: {'; '.join(secrets)}.")
        source_pipe = LMLPPipeline.from_pretrained(folder)
        check_scheduler(source_pipe.scheduler)  # a repo whose scheduler would draw wrong images is not published
        leave_out_local_paths(target)
        pipe = load_staged(target, refused, source_pipe)
        if sample_prompts:
            generator = torch.Generator().manual_seed(seed)
            images = pipe(list(sample_prompts), num_inference_steps=sample_steps, generator=generator).images
            make_image_grid(images, captions=list(sample_prompts)).save(target / SAMPLE_GRID)
        code_files = add_remote_code(target) if with_code else None
        if not with_code:
            name_package_classes(target)  # a source staged with the code before names its code files
        blocks, grid = {}, _grid_for_usage(target, existing)
        if existing is None:
            title = repo_id.split("/")[-1]
            blocks["description"] = describe_pipeline(
                pipe, title, summary=summary, sample_grid=grid, base_model=base_model
            )
            grid = None
        usage = usage_section(repo_id, summary=summary, code_files=code_files, tokenizer=pipe.tokenizer)
        blocks["usage"] = f"![samples]({grid})\n\n{usage}" if grid else usage
        metadata = {"license": license, "datasets": list(datasets) if datasets else None, "base_model": base_model}
        save_card(target, [family_of(pipe.transformer).tag], blocks, **metadata)

    return _stage(folder, repo_id, output_dir, base_model, fill)


def stage_lora(
    folder: str | os.PathLike,
    repo_id: str,
    output_dir: str | os.PathLike | None = None,
    license: str | None = None,
    base_model: str | None = None,
) -> upload.StagedUpload:
    """Build the exact folder that `push_lora` uploads, card included, as `stage_pipeline` does. A LoRA file whose keys
    are not all `transformer.` LoRA matrices is refused. `base_model` (the base pipeline's Hub repo) defaults to the
    summary's; a local folder is named by its name only and left out of the metadata."""
    folder = check_lora_folder(folder)

    def fill(target, refused, existing, summary):
        if LORA_FILE in refused:
            raise ValueError(f"{folder / LORA_FILE} cannot be uploaded: {refused[LORA_FILE]}.")
        if foreign := sorted(k for k in LMLPPipeline.lora_state_dict(str(target)) if not k.startswith("transformer.")):
            raise ValueError(
                f"{folder / LORA_FILE} has keys that are not the transformer's LoRA matrices: {foreign[:3]}"
            )
        if (base := base_model or summary.get("base_model")) is None:
            raise ValueError(f"{folder} does not say which pipeline the LoRA adapts (no base_model in its summary): "
                             "pass --base-model <its Hub repo id>.")  # fmt: skip
        public = public_base_model(base)
        if summary.get("base_model", public) != public:  # the staged summary names no folder of this machine
            summary["base_model"] = public
            (target / TRAINING_SUMMARY).write_text(json.dumps(summary, indent=2), encoding="utf-8")
        usage = lora_usage_section(repo_id, public, summary)
        grid = _grid_for_usage(target, existing)
        blocks = {"usage": f"![samples]({grid})\n\n{usage}" if grid else usage}
        save_card(target, ["lora"], blocks, license=license, base_model=hub_id_or_none(base))

    return _stage(folder, repo_id, output_dir, base_model, fill)


def push_pipeline(
    folder: str | os.PathLike,
    repo_id: str,
    token: str | None = None,
    private: bool | None = None,
    commit_message: str = "Upload LMLPPipeline",
    revision: str | None = None,
    create_pr: bool = False,
    **options,
) -> CommitInfo:
    """Publish a saved pipeline to `repo_id` (`"name"`: the token's user's): stage it (`stage_pipeline` with
    `options`), `create_repo(exist_ok=True)`, then one commit to `revision` or a pull request (`create_pr`)."""
    check_pipeline_folder(folder)
    commit = {"revision": revision, "create_pr": create_pr, "private": private, "token": token}
    return upload.publish_model_repo(folder, repo_id, stage_pipeline, options, commit_message, **commit)


def push_lora(
    folder: str | os.PathLike,
    repo_id: str,
    token: str | None = None,
    private: bool | None = None,
    commit_message: str = "Upload LoRA adapter",
    revision: str | None = None,
    create_pr: bool = False,
    license: str | None = None,
    base_model: str | None = None,
) -> CommitInfo:
    """Publish a LoRA adapter folder as `push_pipeline` does, staged by `stage_lora`."""
    check_lora_folder(folder)
    options = {"license": license, "base_model": base_model}
    commit = {"revision": revision, "create_pr": create_pr, "private": private, "token": token}
    return upload.publish_model_repo(folder, repo_id, stage_lora, options, commit_message, **commit)
