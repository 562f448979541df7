"""Publish the Gradio demo (`DEFAULT_SPACE_DIR`) as a Space serving the model repos in `LMLP_MODEL` and `models:`.
diffusers-lmlp is not on PyPI, so the Space gets this install's package source (`.py` files) beside `app.py`: it runs
no model repo's code, and serves repos pushed with or without it."""

import logging
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

from huggingface_hub import CommitInfo, HfApi, SpaceCard
from huggingface_hub.errors import RepositoryNotFoundError

from . import upload
from .remote_code import PACKAGE


logger = logging.getLogger(__name__)

MODEL_VARIABLE = "LMLP_MODEL"
SPACE_NAME = "lmlp-demo"
SPACE_FILE_LIMIT = (10_000_000, "for a file of a Space (weights and data belong in model or dataset repos)")
SPACE_TOTAL_LIMIT = (50_000_000, "for a Space (weights and data belong in model or dataset repos)")


def find_space_dir() -> Path:
    """The demo folder: the wheel's `diffusers_lmlp/space/lmlp_demo/`, else a checkout's `spaces/lmlp-demo/`."""
    package = Path(__file__).resolve().parents[1]
    installed = package / "space" / SPACE_NAME.replace("-", "_")
    return installed if (installed / "app.py").is_file() else package.parents[1] / "spaces" / SPACE_NAME


DEFAULT_SPACE_DIR = find_space_dir()
# Never uploaded from the demo folder: caches, local run outputs, an old copy of the package (this install's is).
SKIPPED = ("__pycache__", ".*", "*.pyc", "flagged", PACKAGE)
_left_out = upload.ignored(SKIPPED, "matches {pattern}: caches, run outputs and old copies of the package stay local")
# Of the package, only the source: not the shipped models and data, nor the wheel's copy of the demo.
_not_source = upload.ignored(("__pycache__", ".*", "assets", SPACE_NAME.replace("-", "_")), "not source")


def vendor_package(target: Path) -> None:
    """Copy this install's package source (`.py` files only) to `target/diffusers_lmlp`, under the upload's guards."""
    package = Path(__file__).resolve().parents[1]
    not_python = lambda path: None if path.endswith(".py") else "not source"  # noqa: E731
    _, refused = upload.copy_tree(package, target / PACKAGE, _not_source, not_python, lambda path: SPACE_FILE_LIMIT)
    if refused:
        raise ValueError(f"The package at {package} cannot be vendored into the Space: {refused}.")


def stage_space(
    model_id: str | Sequence[str],
    space_dir: str | os.PathLike | None = None,
    output_dir: str | os.PathLike | None = None,
) -> upload.StagedUpload:
    """Build the exact folder `push_space` uploads: the demo in `space_dir` with its `models:` set to `model_id` (the
    first opening) and the package source; raise over `SPACE_TOTAL_LIMIT` or if app.py or README.md is refused."""
    model_ids = _model_ids(model_id)
    space_dir = Path(space_dir) if space_dir is not None else DEFAULT_SPACE_DIR
    if missing := [name for name in ("app.py", "README.md") if not (space_dir / name).is_file()]:
        raise FileNotFoundError(
            f"{space_dir} is not a Gradio Space folder (no {' or '.join(missing)}); pass --space-dir, a folder with "
            f"app.py and README.md (the project's demo is {DEFAULT_SPACE_DIR})."
        )
    with upload.staging(output_dir, "lmlp-space-", source=space_dir) as target:
        limit = lambda path: SPACE_FILE_LIMIT  # noqa: E731
        left_out, refused = upload.copy_tree(space_dir, target, _left_out, _left_out, limit, SPACE_TOTAL_LIMIT)
        if needed := [name for name in ("app.py", "README.md") if name in refused]:
            raise ValueError(f"{space_dir / needed[0]} cannot be uploaded: {refused[needed[0]]}.")
        vendor_package(target)
        card = SpaceCard.load(target / "README.md")
        card.data.models = model_ids
        card.save(target / "README.md")
        upload.check_final_form(target)
    return upload.StagedUpload(target, upload.list_files(target), left_out, refused)


def push_space(
    space_id: str,
    model_id: str | Sequence[str],
    space_dir: str | os.PathLike | None = None,
    token: str | None = None,
    private: bool | None = None,
    commit_message: str = "Upload the diffusers-lmlp demo",
) -> CommitInfo:
    """Publish the demo as a Gradio Space `space_id` serving `model_id` (see `stage_space`): create it, set
    `LMLP_MODEL`, then one commit. Each model repo must exist (`push_pipeline`)."""
    upload.check_repo_id(space_id, "Space id", namespace=True)
    model_ids = _model_ids(model_id)
    api = HfApi(token=upload.require_token(token))
    with tempfile.TemporaryDirectory(prefix="lmlp-space-") as tmp:
        staged = stage_space(model_ids, space_dir, Path(tmp) / "upload")
        upload.log_upload_report(staged, Path(space_dir) if space_dir is not None else DEFAULT_SPACE_DIR)
        for model_id in model_ids:
            require_model(api, model_id)
        api.create_repo(space_id, repo_type="space", space_sdk="gradio", private=private, exist_ok=True)
        api.add_space_variable(space_id, MODEL_VARIABLE, ",".join(model_ids))
        return upload.commit_staged(api, space_id, staged.folder, commit_message, repo_type="space")


def _model_ids(model_id: str | Sequence[str]) -> list[str]:
    model_ids = [model_id] if isinstance(model_id, str) else list(model_id)
    for model in model_ids:
        upload.check_repo_id(model, "model repo id", namespace=True)
    return model_ids


def require_model(api: HfApi, model_id: str) -> None:
    """Refuse a model repo that does not exist; warn when it is private."""
    try:
        model = api.model_info(model_id)
    except RepositoryNotFoundError:
        raise ValueError(
            f"The model repo {model_id} does not exist, or this token cannot see it; publish the model first: "
            f"python -m diffusers_lmlp.hub push FOLDER {model_id}."
        ) from None
    if model.private:
        logger.warning(f"{model_id} is private: the Space can load it only with an HF_TOKEN secret that reads it.")
