"""Publish a LoRA adapter folder (what the trainer writes with `--lora_rank`) as a Hub model repo.

The upload follows the pipeline push's rules (`diffusers_lmlp.hub.model`); its card is the folder's own with the
`usage` block naming the repo (`diffusers_lmlp.hub.lora_card`).
"""

import json
import os
from pathlib import Path

from huggingface_hub import CommitInfo

from ..pipelines import LMLPPipeline
from .card import hub_id_or_none, update_card, without_block
from .lora_card import lora_usage_section, public_base_model
from .model import SAMPLE_GRID, TRAINING_SUMMARY, left_out_file, left_out_folder, size_limit
from .upload import (
    StagedUpload,
    check_final_form,
    check_repo_id,
    copy_tree,
    list_files,
    publish_model_repo,
    staging,
)


LORA_FILE = "pytorch_lora_weights.safetensors"


def is_lora_folder(folder: str | os.PathLike) -> bool:
    """Whether `folder` holds a LoRA adapter (`pytorch_lora_weights.safetensors`) rather than a saved pipeline."""
    folder = Path(folder)
    return (folder / LORA_FILE).is_file() and not (folder / "model_index.json").exists()


def stage_lora(
    folder: str | os.PathLike,
    repo_id: str,
    output_dir: str | os.PathLike | None = None,
    license: str | None = None,
    base_model: str | None = None,
) -> StagedUpload:
    """Build the exact folder that `push_lora` uploads, card included; the source folder is not changed. A staged
    LoRA file whose keys are not all `transformer.` LoRA matrices is refused.

    Args:
        folder (`str` or `os.PathLike`): The adapter folder (`pytorch_lora_weights.safetensors`, card, summary, ...).
        repo_id (`str`): The model repo it is for (the card's usage snippet loads it).
        output_dir (`str` or `os.PathLike`, *optional*): A new or empty folder to stage in; default: a temporary one.
        license (`str`, *optional*): The card's license (default: the card's own, else apache-2.0).
        base_model (`str`, *optional*): The base pipeline's Hub repo; defaults to the summary's `base_model` (a local
            folder is named by its name only and left out of the metadata).

    Returns:
        `StagedUpload`: The staging folder, its files, and what of the source was left out or refused.
    """
    folder = Path(folder)
    if not is_lora_folder(folder):
        raise ValueError(f"{folder} is not a LoRA adapter folder: it has no {LORA_FILE} (or it is a pipeline).")
    check_repo_id(repo_id, "model repo id")
    if base_model:
        check_repo_id(base_model, "base model")

    with staging(output_dir, "lmlp-upload-", source=folder) as target:
        left_out, refused = copy_tree(folder, target, left_out_folder, left_out_file, size_limit)
        if LORA_FILE in refused:
            raise ValueError(f"{folder / LORA_FILE} cannot be uploaded: {refused[LORA_FILE]}.")
        state_dict = LMLPPipeline.lora_state_dict(str(target))
        foreign = sorted(key for key in state_dict if not key.startswith("transformer."))
        if foreign:
            raise ValueError(
                f"{folder / LORA_FILE} has keys that are not the transformer's LoRA matrices: {foreign[:3]}"
            )
        summary_path = target / TRAINING_SUMMARY
        summary = json.loads(summary_path.read_text(encoding="utf-8")) if summary_path.is_file() else {}
        base_model = base_model or summary.get("base_model")
        if base_model is None:
            raise ValueError(
                f"{folder} does not say which pipeline the LoRA adapts (no base_model in {TRAINING_SUMMARY}): pass "
                "--base-model <its Hub repo id>."
            )
        public = public_base_model(base_model)
        if summary.get("base_model", public) != public:  # the staged summary names no folder of this machine
            summary["base_model"] = public
            summary_path.write_text(json.dumps(summary, indent=2), encoding="utf-8")
        card_path = target / "README.md"
        existing = card_path.read_text(encoding="utf-8") if card_path.is_file() else None
        usage = lora_usage_section(repo_id, public, summary)
        shown = existing is not None and SAMPLE_GRID in without_block(existing, "usage")
        if (target / SAMPLE_GRID).is_file() and not shown:
            usage = f"![samples]({SAMPLE_GRID})\n\n{usage}"
        card = update_card(
            existing, ["lora"], {"usage": usage}, license=license, base_model=hub_id_or_none(base_model)
        )
        card.save(card_path)
        check_final_form(target)
    return StagedUpload(target, list_files(target), left_out, refused)


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
    """Publish a LoRA adapter folder: stage it (`stage_lora`), `create_repo(exist_ok=True)`, then one commit.

    Args:
        folder (`str` or `os.PathLike`): The adapter folder.
        repo_id (`str`): The model repo, `"owner/name"` or `"name"` (then the token's user owns it).
        token (`str`, *optional*): A Hub token with write access; defaults to the one huggingface_hub finds.
        private (`bool`, *optional*): Create the repo private (an existing repo keeps its visibility).
        commit_message (`str`, *optional*, defaults to `"Upload LoRA adapter"`): The commit's title.
        revision (`str`, *optional*): An existing branch to commit to (default `main`).
        create_pr (`bool`, *optional*, defaults to `False`): Open a pull request instead of committing directly.
        license (`str`, *optional*): See `stage_lora`.
        base_model (`str`, *optional*): See `stage_lora`.

    Returns:
        `CommitInfo`: The commit (`commit_url`, and `pr_url` with `create_pr`).
    """
    if not is_lora_folder(folder):
        raise ValueError(f"{folder} is not a LoRA adapter folder: it has no {LORA_FILE} (or it is a pipeline).")
    check_repo_id(repo_id, "model repo id")
    return publish_model_repo(
        folder,
        repo_id,
        lambda repo, target: stage_lora(folder, repo, target, license=license, base_model=base_model),
        token=token,
        private=private,
        commit_message=commit_message,
        revision=revision,
        create_pr=create_pr,
    )
