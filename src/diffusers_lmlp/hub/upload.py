"""The steps every upload shares: checking repo ids and the token, staging files, and the one commit.

Each kind of upload has its own rules for what belongs in it (a model repo takes weights, configs, tokenizer files
and images; a Space takes the demo folder). On top of them, one rule for every upload keeps things on the machine
that must never leave it. `copy_tree` refuses, whatever the upload's own rules say:

- symbolic links, to files or folders, wherever they point (inside the folder or outside it): no link is ever
  followed, so nothing outside the folder can be uploaded through one (to upload a linked file, replace the link
  with a copy, `cp -L`);
- hard links (a file with more than one name): the other name may be anywhere on the disk, so a hard link is a way
  to upload a file from outside the folder just as a symbolic link is;
- anything that is not a regular file: FIFOs, sockets, devices;
- files and folders whose names look like credentials (`looks_like_credential`);
- files over the upload's size limit, when it has one (a model repo limits every file but the weights);
- files whose bytes hold a secret (`find_secret`: Hugging Face, AWS, GitHub, OpenAI, Anthropic, Google and Slack
  tokens, private keys), whatever their name. Every byte that would be uploaded is read, except the tensors of a
  safetensors file: its header is read, since its `__metadata__` is free text (training tools store their
  arguments there), but the tensor bytes are numbers, and reading gigabytes of them would only find chance matches.
  The report names the kind of secret and where it is, never the secret.

Each file is copied once, and everything after the copy reads the copy: the secret scan, the checks of each kind of
upload (the staged pipeline must load), the model card, and the commit. A file that changes in the source folder
after it was copied is uploaded as it was when copied, or, if it changed while it was being copied, not at all.

The dry run and the push stage through the same code, so they refuse the same files; both report them
(`upload_report`).
"""

import logging
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import CommitInfo, CommitOperationAdd, HfApi, get_token
from huggingface_hub.utils import HFValidationError, validate_repo_id


logger = logging.getLogger(__name__)

# A name looks like a credential when one of its words (split at anything but letters and digits, and at
# camelCase humps; case-insensitive) is one of CREDENTIAL_WORDS or ends with one of CREDENTIAL_ENDINGS (names written
# as one word: "mytoken", "HFTOKEN", "dbpassword"), two adjacent words are one of CREDENTIAL_WORD_PAIRS, or it ends
# with one of CREDENTIAL_SUFFIXES. A word must end with "token": "tokens" and "tokenizer" do not, so tokenizer.json,
# tokenizer_config.json, special_tokens_map.json and added_tokens.json are uploaded. Words that are credentials only
# as a whole ("env", "cookie") are not endings: "venv" and "fortunecookie" are not credentials.
CREDENTIAL_ENDINGS = (
    "token",
    "secret",
    "secrets",
    "password",
    "passwords",
    "passwd",
    "credential",
    "credentials",
    "apikey",
    "apikeys",
    "auth",
)
CREDENTIAL_WORDS = frozenset(
    {
        *CREDENTIAL_ENDINGS,
        "env",
        "netrc",
        "pypirc",
        "npmrc",
        "pgpass",
        "htpasswd",
        "cookie",
        "cookies",
    }
)
CREDENTIAL_WORD_PAIRS = frozenset(
    {
        ("api", "key"),
        ("api", "keys"),
        ("access", "key"),
        ("access", "keys"),
        ("private", "key"),
        ("service", "account"),
        ("id", "rsa"),
        ("id", "dsa"),
        ("id", "ecdsa"),
        ("id", "ed25519"),
    }
)
CREDENTIAL_SUFFIXES = (".pem", ".key", ".p12", ".pfx", ".jks", ".keystore", ".ppk", ".kdbx")
# Words of a name: runs of capitals not followed by a lower-case letter ("HF" in "HFToken"), a capitalised or
# lower-case word with its trailing digits ("ed25519"), or digits.
_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+[0-9]*|[0-9]+")
# Secrets recognised in a file's bytes: each pattern is a format with a fixed prefix and a long random part, so that
# text that is not a secret (a tokenizer's vocabulary, a config, a model card) does not match. A prefix must not
# continue a longer word (the lookbehind after it checks the byte before it; written after the prefix, so that the
# search jumps from one occurrence of the prefix to the next: 25 times faster). The key is how the report names the
# secret; the secret itself is never shown.
SECRET_PATTERNS: dict[str, re.Pattern[bytes]] = {
    "a Hugging Face token (hf_...)": re.compile(rb"hf_(?<![A-Za-z0-9]hf_)[A-Za-z0-9]{30,}"),
    "a Hugging Face organization token (api_org_...)": re.compile(
        rb"api_org_(?<![A-Za-z0-9]api_org_)[A-Za-z0-9]{30,}"
    ),
    "an AWS access key id (AKIA...)": re.compile(rb"(?:AKIA|ASIA)(?<![A-Za-z0-9]....)[A-Z0-9]{16}(?![A-Za-z0-9])"),
    "a GitHub token (ghp_...)": re.compile(rb"gh[pousr]_(?<![A-Za-z0-9]..._)[A-Za-z0-9]{36,}"),
    "a GitHub token (github_pat_...)": re.compile(rb"github_pat_(?<![A-Za-z0-9]github_pat_)[A-Za-z0-9_]{40,}"),
    # OpenAI keys carry "T3BlbkFJ" (base64 of "OpenAI") in their middle.
    "an OpenAI API key (sk-...)": re.compile(rb"sk-(?<![A-Za-z0-9]sk-)[A-Za-z0-9_-]{8,}T3BlbkFJ[A-Za-z0-9_-]{8,}"),
    "an Anthropic API key (sk-ant-...)": re.compile(
        rb"sk-ant-(?<![A-Za-z0-9]sk-ant-)[a-z]+[0-9]{2}-[A-Za-z0-9_-]{32,}"
    ),
    "a Google API key (AIza...)": re.compile(rb"AIza(?<![A-Za-z0-9]AIza)[0-9A-Za-z_-]{35}"),
    "a Slack token (xox...)": re.compile(rb"xox[abposr]-(?<![A-Za-z0-9]....-)[0-9]{6,}-[A-Za-z0-9-]{8,}"),
    "a private key (-----BEGIN ... PRIVATE KEY-----)": re.compile(rb"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY"),
}

# A size limit: (the most bytes a file, or all files together, may have; what it is for, e.g. "for .json, .txt and
# .md files").
SizeLimit = tuple[int, str]
# Size limits (bytes) for everything but the weights, which have none. Real files are far below them: CLIP's
# tokenizer.json as transformers 5 saves it is 3,642,074 bytes (its vocab.json 1,059,961, merges.txt 524,619); a 4×4
# grid of 512×512 samples is at most 12.6 MB as PNG (the size of the raw RGB).
TEXT_LIMIT: SizeLimit = (16_000_000, "for .json, .txt and .md files")
IMAGE_LIMIT: SizeLimit = (32_000_000, "for images")
NEWLINE = b"\n"


@dataclass
class StagedUpload:
    """A folder holding exactly what would be uploaded, and what of the source was not copied into it, and why.

    Args:
        folder (`Path`): The staging folder.
        files (`list[str]`): Every file in it, as POSIX paths relative to it (= paths in the repo), sorted.
        left_out (`dict[str, str]`): Files and folders (with a trailing `/`) of the source that are not part of this
            kind of upload (training state, logs, pickles, caches), each with the reason; sorted by path.
        refused (`dict[str, str]`): Files and folders (with a trailing `/`) of the source that this kind of upload
            would take but that are never uploaded (links, credentials, oversize files: see the module docstring),
            each with the reason; sorted by path.
    """

    folder: Path
    files: list[str]
    left_out: dict[str, str]
    refused: dict[str, str]


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


@contextmanager
def staging(output_dir: str | os.PathLike | None, prefix: str, source: Path) -> Iterator[Path]:
    """`staging_folder`, emptied again when staging fails: a failed dry run leaves no half-written folder behind
    (which would also stop the next run, since the output folder must be empty).

    Args:
        output_dir (`str` or `os.PathLike`, *optional*): See `staging_folder`.
        prefix (`str`): See `staging_folder`.
        source (`Path`): See `staging_folder`.

    Yields:
        `Path`: The empty staging folder, to fill.
    """
    existed = output_dir is not None and Path(output_dir).is_dir()
    target = staging_folder(output_dir, prefix, source)
    try:
        yield target
    except BaseException:
        if existed:  # it was empty: empty it again
            for child in target.iterdir():
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child)
                else:
                    child.unlink()
        else:
            shutil.rmtree(target, ignore_errors=True)
        raise


def looks_like_credential(name: str) -> bool:
    """Whether a file or folder name looks like it holds a credential (the rule is above `CREDENTIAL_WORDS`).

    Args:
        name (`str`): The name, without its folder (`"hf_token.txt"`, `".env"`, `"id_rsa"`).
    """
    words = [word.lower() for word in _WORD.findall(name)]
    return (
        any(word in CREDENTIAL_WORDS or word.endswith(CREDENTIAL_ENDINGS) for word in words)
        or any(pair in CREDENTIAL_WORD_PAIRS for pair in zip(words, words[1:]))
        or name.lower().endswith(CREDENTIAL_SUFFIXES)
    )


def refused_folder(path: Path) -> str | None:
    """Why a folder of an upload's source is never uploaded (a link, a credential-like name), or None.

    Args:
        path (`Path`): The folder, inside the source folder; a link is not followed.
    """
    if path.is_symlink():
        return f"a symbolic link to a folder, {os.readlink(path)}; links are never followed"
    if looks_like_credential(path.name):
        return "the name looks like a credential"
    return None


def refused_file(info: os.stat_result, path: Path, limit: SizeLimit | None) -> str | None:
    """Why a file of an upload's source is never uploaded (a link, not a regular file, a credential-like name, over
    the size limit), or None.

    Args:
        info (`os.stat_result`): The file's `os.lstat` (a link is not followed).
        path (`Path`): The file.
        limit (`SizeLimit`, *optional*): The upload's size limit for this file, if it has one.
    """
    if stat.S_ISLNK(info.st_mode):
        return f"a symbolic link to {os.readlink(path)}; links are never followed"
    if not stat.S_ISREG(info.st_mode):
        return "not a regular file (a FIFO, socket or device)"
    if info.st_nlink > 1:
        return (
            f"a hard link ({info.st_nlink} names for one file, which may be outside the folder); to upload it, make "
            "it a file of its own: cp FILE FILE.copy && mv FILE.copy FILE"
        )
    if looks_like_credential(path.name):
        return "the name looks like a credential"
    if limit is not None and info.st_size > limit[0]:
        return f"{info.st_size:,} bytes, over the limit of {limit[0]:,} bytes {limit[1]}"
    return None


def copy_regular_file(source: Path, target: Path, expected: os.stat_result) -> None:
    """Copy `source` to a new file `target` without following a link, and only if it is still the file checked.

    Opening with `O_NOFOLLOW` and comparing the opened file with the one checked (`expected`) closes the window in
    which the checked file could be swapped for a link (or given a second name); comparing again once it is copied
    (size and modification time) refuses a file that was written to while it was copied, whose copy could mix old
    and new bytes. The copy is what every later step reads.

    Raises:
        `OSError`: When the file changed between its check and the end of its copy.

    Args:
        source (`Path`): The file to copy.
        target (`Path`): Where to copy it; must not exist.
        expected (`os.stat_result`): `os.lstat(source)` as checked before.
    """
    fd = os.open(source, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with open(fd, "rb") as src:
        opened = os.fstat(src.fileno())
        if _identity(opened) != _identity(expected):
            raise OSError(f"{source} changed while it was staged for upload; stage again.")
        with open(target, "xb") as dst:
            shutil.copyfileobj(src, dst)
            copied = dst.tell()
        if _identity(os.fstat(src.fileno())) != _identity(expected) or copied != expected.st_size:
            raise OSError(f"{source} changed while it was copied for upload; stage again.")


def _identity(info: os.stat_result) -> tuple[int, ...]:
    """What must not change between a file's checks and the end of its copy: the file (device, inode), its number
    of names, its size and its modification time."""
    return info.st_dev, info.st_ino, info.st_nlink, info.st_size, info.st_mtime_ns


def find_secret(path: Path) -> str | None:
    """What secret a file holds, and where (`SECRET_PATTERNS`), or None; the secret itself is never part of the answer.

    Every byte of the file is read, but of a `.safetensors` file only its header (tensor names, shapes and the
    `__metadata__` text; see the module docstring).

    Args:
        path (`Path`): The file (the staged copy).

    Returns:
        `str` or `None`: E.g. "holds a Hugging Face token (hf_...) on line 3".
    """
    with open(path, "rb") as f:
        if path.name.endswith(".safetensors"):
            length = int.from_bytes(f.read(8), "little")
            data, where = f.read(min(length, path.stat().st_size)), "in its header"
        else:
            data, where = f.read(), None
    for kind, pattern in SECRET_PATTERNS.items():
        match = pattern.search(data)
        if match is None:
            continue
        if where is None:
            where = f"at byte {match.start():,}"
            try:
                data.decode("utf-8")
            except UnicodeDecodeError:
                pass  # not text: no lines to count
            else:
                where = f"on line {data.count(NEWLINE, 0, match.start()) + 1}"
        return (
            f"holds {kind} {where}: remove it from the file (and revoke it, if it was ever shared); the secret is "
            "not shown here"
        )
    return None


def copy_tree(
    source: Path,
    target: Path,
    leave_out_dir: Callable[[str], str | None],
    leave_out_file: Callable[[str], str | None],
    size_limit: Callable[[str], SizeLimit | None] | None = None,
    total_limit: SizeLimit | None = None,
) -> tuple[dict[str, str], dict[str, str]]:
    """Copy the files of `source` that belong in an upload into `target`; return what was left out and refused.

    A file or folder that the upload's rules leave out is not looked at further; every other one is checked by the
    rule every upload shares (the module docstring: links, hard links, non-regular files, credential-like names,
    size), and once copied, its copy is scanned for secrets (`find_secret`; a copy that holds one is deleted).

    Args:
        source (`Path`): The folder to copy from.
        target (`Path`): The folder to copy into (created as needed).
        leave_out_dir (`Callable[[str], str | None]`): Called with a folder's POSIX path relative to `source`; returns
            why the whole folder is not part of the upload, or None.
        leave_out_file (`Callable[[str], str | None]`): The same for a file.
        size_limit (`Callable[[str], SizeLimit | None]`, *optional*): Called with a file's relative path; returns
            its size limit, or None for none. Defaults to no limits.
        total_limit (`SizeLimit`, *optional*): The most bytes all the copied files may have together. Defaults to
            no limit.

    Returns:
        `tuple[dict[str, str], dict[str, str]]`: The files and folders (with a trailing `/`) left out by the upload's
        rules, and those refused by the shared rule, relative to `source`, each with its reason, sorted by path.

    Raises:
        `ValueError`: When the files come to more than `total_limit`, as soon as one does (nothing more is copied).
    """
    left_out, refused = {}, {}
    total = 0
    for root, dirs, files in os.walk(source):  # os.walk lists a link to a folder in `dirs` but never enters it
        relative = Path(root).relative_to(source)
        kept = []
        for name in sorted(dirs):
            path = (relative / name).as_posix()
            if reason := leave_out_dir(path):
                left_out[f"{path}/"] = reason
            elif reason := refused_folder(Path(root) / name):
                refused[f"{path}/"] = reason
            else:
                kept.append(name)
        dirs[:] = kept
        for name in sorted(files):
            path = (relative / name).as_posix()
            if reason := leave_out_file(path):
                left_out[path] = reason
                continue
            info = os.lstat(Path(root) / name)
            if reason := refused_file(info, Path(root) / name, size_limit(path) if size_limit else None):
                refused[path] = reason
                continue
            total += info.st_size
            if total_limit is not None and total > total_limit[0]:
                raise ValueError(
                    f"{source} holds more than {total_limit[0]:,} bytes to upload, the limit {total_limit[1]} (the "
                    f"limit was passed at {path}, {info.st_size:,} bytes). Leave large files out of the folder."
                )
            (target / relative).mkdir(parents=True, exist_ok=True)
            copy_regular_file(Path(root) / name, target / path, info)
            if reason := find_secret(target / path):
                (target / path).unlink()
                refused[path] = reason
    return dict(sorted(left_out.items())), dict(sorted(refused.items()))


def upload_report(staged: StagedUpload) -> str:
    """What of the source is not uploaded and why, one line each: the refused files first, then those left out.

    Args:
        staged (`StagedUpload`): The staged upload.

    Returns:
        `str`: The report, or `""` when everything was uploaded.
    """
    lines = []
    if staged.refused:
        lines.append("Refused, never uploaded:")
        lines += [f"  {path}: {reason}" for path, reason in staged.refused.items()]
    if staged.left_out:
        lines.append("Left out, not part of the upload:")
        lines += [f"  {path}: {reason}" for path, reason in staged.left_out.items()]
    return "\n".join(lines)


def log_upload_report(staged: StagedUpload, source: Path) -> None:
    """Log `upload_report`: a warning when files were refused, else at info level.

    Args:
        staged (`StagedUpload`): The staged upload.
        source (`Path`): The folder it was staged from, for the message.
    """
    report = upload_report(staged)
    if report:
        logger.log(logging.WARNING if staged.refused else logging.INFO, f"Not uploaded from {source}:\n{report}")


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


def publish_model_repo(
    source: str | os.PathLike,
    repo_id: str,
    stage: Callable[[str, Path], StagedUpload],
    token: str | None = None,
    private: bool | None = None,
    commit_message: str = "Upload",
    revision: str | None = None,
    create_pr: bool = False,
) -> CommitInfo:
    """Publish a folder as a model repo: stage it in a temporary folder, log what was left out, `create_repo` (exist
    ok), then one commit of the staged files.

    Args:
        source (`str` or `os.PathLike`): The folder published, for the log.
        repo_id (`str`): The model repo, `"owner/name"` or `"name"` (then the token's user owns it).
        stage (`Callable[[str, Path], StagedUpload]`): Stages the upload for the full repo id into the given folder.
        token (`str`, *optional*): A Hub token with write access; defaults to the one huggingface_hub finds.
        private (`bool`, *optional*): Create the repo private (an existing repo keeps its visibility).
        commit_message (`str`, *optional*): The commit's title.
        revision (`str`, *optional*): An existing branch to commit to (default `main`).
        create_pr (`bool`, *optional*, defaults to `False`): Open a pull request instead of committing directly.

    Returns:
        `CommitInfo`: The commit (`commit_url`, and `pr_url` with `create_pr`).
    """
    api = HfApi(token=require_token(token))
    repo_id = with_namespace(api, repo_id)
    with tempfile.TemporaryDirectory(prefix="lmlp-upload-") as tmp:
        staged = stage(repo_id, Path(tmp) / "upload")
        log_upload_report(staged, Path(source))
        api.create_repo(repo_id, private=private, exist_ok=True)
        return commit_staged(api, repo_id, staged.folder, commit_message, revision=revision, create_pr=create_pr)
