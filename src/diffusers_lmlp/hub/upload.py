"""The steps every upload shares: checking repo ids and the token, staging files, and the one commit."""

import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import CommitInfo, CommitOperationAdd, HfApi, get_token
from huggingface_hub.utils import HFValidationError, validate_repo_id


@dataclass
class StagedUpload:
    """A folder holding exactly what would be uploaded.

    Args:
        folder (`Path`): The staging folder.
        files (`list[str]`): Every file in it, as POSIX paths relative to it (= paths in the repo), sorted.
        left_out (`list[str]`): Files and folders (with a trailing `/`) of the source that are not uploaded.
    """

    folder: Path
    files: list[str]
    left_out: list[str]


def check_repo_id(repo_id: str, what: str = "repo id", namespace: bool = False) -> None:
    """Raise a `ValueError` that names `what` if `repo_id` is not a valid Hub repo id.

    Args:
        repo_id (`str`): The id to check, `"name"` or `"owner/name"`.
        what (`str`, *optional*): What the id is for, for the message (`"model repo id"`).
        namespace (`bool`, *optional*, defaults to `False`): Require the `"owner/name"` form.
    """
    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise ValueError(f"{what} {repo_id!r} is not a valid Hub repo id ('owner/name'): {err}") from None
    if namespace and "/" not in repo_id:
        raise ValueError(f"{what} {repo_id!r} needs its owner: write 'owner/{repo_id}'.")


def require_token(token: str | None, option: str = "--token (token=...)") -> str:
    """The token to upload with: `token`, else the one huggingface_hub finds (`HF_TOKEN`, `hf auth login`).

    Args:
        token (`str`, *optional*): The token given by the caller.
        option (`str`, *optional*): How the caller passes a token, for the message.
    """
    token = token or get_token()
    if not token:
        raise ValueError(
            f"No Hugging Face token: pass {option}, set HF_TOKEN, or run `hf auth login` first. A token with write "
            "access is needed to upload (or use --dry-run to see what would be uploaded)."
        )
    return token


def with_namespace(api: HfApi, repo_id: str) -> str:
    """`repo_id` with its owner: a bare name goes to the token's user, as `create_repo` would do."""
    return repo_id if "/" in repo_id else f"{api.whoami()['name']}/{repo_id}"


def staging_folder(output_dir: str | os.PathLike | None, prefix: str, source: Path) -> Path:
    """An empty folder to stage an upload in.

    Args:
        output_dir (`str` or `os.PathLike`, *optional*): The folder to use: created if missing, else it must be
            empty; it must not be inside `source`. Defaults to a new temporary folder.
        prefix (`str`): Name prefix of the temporary folder.
        source (`Path`): The folder whose files are staged.

    Returns:
        `Path`: The empty folder.
    """
    if output_dir is None:
        return Path(tempfile.mkdtemp(prefix=prefix))
    output_dir = Path(output_dir)
    if output_dir.resolve().is_relative_to(source.resolve()):
        raise ValueError(f"The output folder {output_dir} is inside {source}, which it copies; pick one outside it.")
    if output_dir.exists() and (not output_dir.is_dir() or any(output_dir.iterdir())):
        raise FileExistsError(
            f"{output_dir} already exists and is not an empty folder; pick a new --output-dir so that it holds "
            "exactly what would be uploaded."
        )
    output_dir.mkdir(parents=True, exist_ok=True)
    return output_dir


def copy_tree(
    source: Path, target: Path, keep_dir: Callable[[str], bool], keep_file: Callable[[str], bool]
) -> list[str]:
    """Copy the files of `source` that pass the filters into `target`; return what was left out.

    Args:
        source (`Path`): The folder to copy from.
        target (`Path`): The folder to copy into (created as needed).
        keep_dir (`Callable[[str], bool]`): Called with a folder's path relative to `source`; False skips it all.
        keep_file (`Callable[[str], bool]`): Called with a file's path relative to `source`.

    Returns:
        `list[str]`: The files and folders (with a trailing `/`) left out, relative to `source`, sorted.
    """
    left_out = []
    for root, dirs, files in os.walk(source):
        relative = Path(root).relative_to(source)
        kept = [d for d in sorted(dirs) if keep_dir((relative / d).as_posix())]
        left_out += [f"{(relative / d).as_posix()}/" for d in dirs if d not in kept]
        dirs[:] = kept
        for name in sorted(files):
            path = (relative / name).as_posix()
            if not keep_file(path):
                left_out.append(path)
                continue
            (target / relative).mkdir(parents=True, exist_ok=True)
            shutil.copy2(Path(root) / name, target / path)
    return sorted(left_out)


def list_files(folder: Path) -> list[str]:
    """Every file under `folder`, as sorted POSIX paths relative to it."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def commit_staged(
    api: HfApi,
    repo_id: str,
    folder: Path,
    commit_message: str,
    repo_type: str | None = None,
    revision: str | None = None,
    create_pr: bool = False,
) -> CommitInfo:
    """Upload every file of a staging folder in one commit (`HfApi.create_commit`).

    Args:
        api (`HfApi`): The client, with its token.
        repo_id (`str`): The repo, which must exist.
        folder (`Path`): The staging folder; its layout is the layout in the repo.
        commit_message (`str`): The commit's title.
        repo_type (`str`, *optional*): `None` for a model, `"space"` for a Space.
        revision (`str`, *optional*): An existing branch to commit to (default `main`).
        create_pr (`bool`, *optional*, defaults to `False`): Open a pull request instead of committing directly.

    Returns:
        `CommitInfo`: The commit (`commit_url`, and `pr_url` with `create_pr`).
    """
    operations = [CommitOperationAdd(path_in_repo=path, path_or_fileobj=folder / path) for path in list_files(folder)]
    return api.create_commit(
        repo_id,
        operations,
        commit_message=commit_message,
        repo_type=repo_type,
        revision=revision,
        create_pr=create_pr,
    )
