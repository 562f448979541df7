"""Publish the Gradio demo (`spaces/`) as a Hub Space that serves a published model.

The Space repo gets the demo folder (app.py, README.md, requirements.txt, ...) with this package's source vendored
next to app.py as `diffusers_lmlp/` (the package is not on PyPI, and a Space runs only what is in its repo). The
model it serves travels two ways:

- the Space variable `LMLP_MODEL` (read by app.py), set on every push with `HfApi.add_space_variable`; it can be
  changed later in the Space's settings without a commit;
- `models: [<model repo id>]` in the README front matter, which links the Space and the model on the Hub.
"""

import logging
import os
import tempfile
from fnmatch import fnmatch
from pathlib import Path

from huggingface_hub import CommitInfo, HfApi, SpaceCard
from huggingface_hub.errors import RepositoryNotFoundError

from .upload import (
    StagedUpload,
    check_repo_id,
    commit_staged,
    copy_tree,
    list_files,
    log_upload_report,
    require_token,
    staging_folder,
)


logger = logging.getLogger(__name__)

MODEL_VARIABLE = "LMLP_MODEL"
PACKAGE_DIR = Path(__file__).resolve().parents[1]
# The demo in a source checkout: <repo>/spaces next to <repo>/src/diffusers_lmlp.
DEFAULT_SPACE_DIR = PACKAGE_DIR.parents[1] / "spaces"
# Never uploaded from the demo folder: caches, local run outputs, and a `diffusers_lmlp` link or copy (the vendored
# package replaces it).
SKIPPED = ("__pycache__", ".*", "*.pyc", "flagged", PACKAGE_DIR.name)


def _left_out(path: str) -> str | None:
    """Why a file or folder of the demo folder (POSIX path relative to it) is not uploaded, or None."""
    pattern = next((pattern for pattern in SKIPPED if fnmatch(path.rsplit("/", 1)[-1], pattern)), None)
    if pattern is None:
        return None
    if pattern == PACKAGE_DIR.name:
        return "the package is vendored from this checkout instead"
    return f"matches {pattern!r}: caches, hidden files and local run outputs stay local"


def _left_out_of_package(path: str) -> str | None:
    """Why a file or folder of the package (POSIX path relative to it) is not vendored, or None."""
    name = path.rsplit("/", 1)[-1]
    return "a Python cache" if name == "__pycache__" or name.endswith(".pyc") else None


def stage_space(
    model_id: str, space_dir: str | os.PathLike | None = None, output_dir: str | os.PathLike | None = None
) -> StagedUpload:
    """Build the exact folder that `push_space` uploads: the demo, its front matter, and the vendored package.

    Args:
        model_id (`str`): The model repo the Space serves, `"owner/name"`.
        space_dir (`str` or `os.PathLike`, *optional*): The demo folder; defaults to the checkout's `spaces/`.
        output_dir (`str` or `os.PathLike`, *optional*): Where to stage: a new or empty folder. Defaults to a new
            temporary folder.

    Returns:
        `StagedUpload`: The staging folder, its files, and what of the demo folder was left out or refused (links,
        credential-like names: see `diffusers_lmlp.hub.upload`; the vendored package is checked the same way).
    """
    check_repo_id(model_id, "model repo id", namespace=True)
    space_dir = Path(space_dir) if space_dir is not None else DEFAULT_SPACE_DIR
    missing = [name for name in ("app.py", "README.md") if not (space_dir / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{space_dir} is not a Gradio Space folder (no {' or '.join(missing)}); pass --space-dir, the folder "
            "with app.py and README.md (the repo's spaces/)."
        )
    target = staging_folder(output_dir, "lmlp-space-", source=space_dir)
    left_out, refused = copy_tree(space_dir, target, _left_out, _left_out)
    _, package_refused = copy_tree(PACKAGE_DIR, target / PACKAGE_DIR.name, _left_out_of_package, _left_out_of_package)
    refused |= {f"{PACKAGE_DIR.name}/{path}": reason for path, reason in package_refused.items()}
    for name in ("app.py", "README.md"):
        if name in refused:
            raise ValueError(f"{space_dir / name} cannot be uploaded: {refused[name]}. Put the file itself there.")

    # Read from the staged copy, which passed the checks (not a link).
    card = SpaceCard.load(target / "README.md")
    card.data.models = [model_id]
    card.save(target / "README.md")
    return StagedUpload(target, list_files(target), left_out, dict(sorted(refused.items())))


def push_space(
    space_id: str,
    model_id: str,
    space_dir: str | os.PathLike | None = None,
    token: str | None = None,
    private: bool | None = None,
    commit_message: str = "Upload the diffusers-lmlp demo",
) -> CommitInfo:
    """Publish the demo as a Gradio Space serving `model_id`: create it, set `LMLP_MODEL`, then one commit.

    The model repo must exist already (publish it first with `push_pipeline`).

    Args:
        space_id (`str`): The Space repo, `"owner/name"`.
        model_id (`str`): The model repo it serves, `"owner/name"`.
        space_dir (`str` or `os.PathLike`, *optional*): The demo folder; defaults to the checkout's `spaces/`.
        token (`str`, *optional*): A Hub token with write access; defaults to the one huggingface_hub finds.
        private (`bool`, *optional*): Create the Space private (an existing Space keeps its visibility).
        commit_message (`str`, *optional*): The commit's title.

    Returns:
        `CommitInfo`: The commit.
    """
    check_repo_id(space_id, "Space id", namespace=True)
    check_repo_id(model_id, "model repo id", namespace=True)
    api = HfApi(token=require_token(token))
    with tempfile.TemporaryDirectory(prefix="lmlp-space-") as tmp:
        staged = stage_space(model_id, space_dir, Path(tmp) / "upload")
        log_upload_report(staged, Path(space_dir) if space_dir is not None else DEFAULT_SPACE_DIR)
        try:
            model = api.model_info(model_id)
        except RepositoryNotFoundError:
            raise ValueError(
                f"The model repo {model_id} does not exist, or this token cannot see it; publish the model first "
                "(python -m diffusers_lmlp.hub push FOLDER OWNER/NAME)."
            ) from None
        if model.private:
            logger.warning(f"{model_id} is private: the Space can load it only with an HF_TOKEN secret that reads it.")
        api.create_repo(space_id, repo_type="space", space_sdk="gradio", private=private, exist_ok=True)
        api.add_space_variable(space_id, MODEL_VARIABLE, model_id)
        return commit_staged(api, space_id, staged.folder, commit_message, repo_type="space")
