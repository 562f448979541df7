"""The guards every upload shares, and the one commit.

Staging (`copy_tree`) copies each file once into a staging folder, and every later step (scan, checks, card, commit)
reads that copy. It never uploads a symbolic or hard link (none is followed), a non-regular file, a file or folder
named like a credential (`looks_like_credential`), a file over its size limit, or a file or name holding a secret in
any form a reader gets out of it (`readable_forms`: UTF-16 text, decoded escapes, image text chunks, a safetensors
header); the finished folder is scanned once more (`check_final_form`). The dry run and the push stage alike.
"""

import json
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
from PIL import Image


logger = logging.getLogger(__name__)

# A name looks like a credential when a word of it (split at non-alphanumerics and camelCase) is in CREDENTIAL_WORDS
# or ends with a CREDENTIAL_ENDINGS entry ("mytoken"), two adjacent words are a CREDENTIAL_WORD_PAIRS, or it ends with
# a CREDENTIAL_SUFFIXES. "tokens"/"tokenizer" do not end with "token"; "env" and "cookie" count as whole words only.
CREDENTIAL_ENDINGS = ("token", "secret", "secrets", "password", "passwords", "passwd", "credential", "credentials",
                      "apikey", "apikeys", "auth")  # fmt: skip
CREDENTIAL_WORDS = frozenset(
    {*CREDENTIAL_ENDINGS, "env", "netrc", "pypirc", "npmrc", "pgpass", "htpasswd", "cookie", "cookies"}
)
CREDENTIAL_WORD_PAIRS = frozenset(
    {("api", "key"), ("api", "keys"), ("access", "key"), ("access", "keys"), ("private", "key"),
     ("service", "account"), ("id", "rsa"), ("id", "dsa"), ("id", "ecdsa"), ("id", "ed25519")}
)  # fmt: skip
CREDENTIAL_SUFFIXES = (".pem", ".key", ".p12", ".pfx", ".jks", ".keystore", ".ppk", ".kdbx")
# Words of a name: capital runs ("HF" in "HFToken"), words with their trailing digits ("ed25519"), or digits.
_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+[0-9]*|[0-9]+")
# Secrets: formats with a fixed prefix and a long random part, so vocabularies and configs do not match. The
# lookbehind after the prefix keeps it from continuing a longer word. Keys name the secret; it is never shown.
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
# Escapes that a reader decodes into the character: JSON's and Python's \u005f and \x5f, and URLs' %5F.
_ESCAPE = re.compile(rb"\\u([0-9a-fA-F]{4})|\\x([0-9a-fA-F]{2})|%([0-9a-fA-F]{2})")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")

# A size limit: (the most bytes a file, or all files together, may have; what it is for, for the message).
SizeLimit = tuple[int, str]
# Limits for everything but the weights (which have none), far above real tokenizer files and sample grids.
TEXT_LIMIT: SizeLimit = (16_000_000, "for .json, .txt and .md files")
IMAGE_LIMIT: SizeLimit = (32_000_000, "for images")
NAMED_AFTER_A_SECRET = "its name holds a secret (not shown here): rename it"
LINK = "links are never followed"


@dataclass
class StagedUpload:
    """A staging `folder` holding exactly what would be uploaded (`files`: sorted repo paths), and the source paths
    `left_out` (not part of this kind of upload) and `refused` (never uploaded), each with its reason; folders end
    with `/`."""

    folder: Path
    files: list[str]
    left_out: dict[str, str]
    refused: dict[str, str]


def check_repo_id(repo_id: str, what: str = "repo id", namespace: bool = False) -> None:
    """Raise a `ValueError` naming `what` unless `repo_id` is a valid Hub repo id (with its owner, if `namespace`)."""
    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise ValueError(f"{what} {repo_id!r} is not a valid Hub repo id ('owner/name'): {err}") from None
    if namespace and "/" not in repo_id:
        raise ValueError(f"{what} {repo_id!r} needs its owner: write 'owner/{repo_id}'.")


def require_token(token: str | None, option: str = "--token (token=...)") -> str:
    """`token`, else the one huggingface_hub finds; raise, naming `option`, if none, or if the given one is blank or
    has spaces around it (which the Hub would reject only at the upload)."""
    if token is not None and (not token.strip() or token != token.strip()):
        problem = "is blank" if not token.strip() else "has spaces or a line break around it"
        raise ValueError(f"The token given with {option} {problem}: pass the token itself (hf_...).")
    if not (token := token or get_token()):
        raise ValueError(
            f"No Hugging Face token: pass {option}, set HF_TOKEN, or run `hf auth login` first (or use --dry-run to "
            "see what would be uploaded)."
        )
    return token


@contextmanager
def staging(output_dir: str | os.PathLike | None, prefix: str, source: Path) -> Iterator[Path]:
    """An empty folder to stage `source` in: `output_dir` (created if missing, else it must be empty; not inside
    `source`), or a new temporary one; emptied again if staging fails, so a failed dry run leaves nothing behind."""
    existed = output_dir is not None and Path(output_dir).is_dir()
    if output_dir is None:
        target = Path(tempfile.mkdtemp(prefix=prefix))
    else:
        target = Path(output_dir)
        if target.resolve().is_relative_to(source.resolve()):
            raise ValueError(f"The output folder {target} is inside {source}, which it copies; pick one outside it.")
        if target.exists() and (not target.is_dir() or any(target.iterdir())):
            raise FileExistsError(f"{target} already exists and is not an empty folder; pick a new --output-dir.")
        target.mkdir(parents=True, exist_ok=True)
    try:
        yield target
    except BaseException:
        if not existed:
            shutil.rmtree(target, ignore_errors=True)
            raise
        for child in target.iterdir():  # it was empty: empty it again
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
        raise


def looks_like_credential(name: str) -> bool:
    """Whether a file or folder name (`"hf_token.txt"`, `".env"`, `"id_rsa"`) looks like a credential."""
    words = [word.lower() for word in _WORD.findall(name)]
    return (
        any(word in CREDENTIAL_WORDS or word.endswith(CREDENTIAL_ENDINGS) for word in words)
        or any(pair in CREDENTIAL_WORD_PAIRS for pair in zip(words, words[1:]))
        or name.lower().endswith(CREDENTIAL_SUFFIXES)
    )


def refused_file(info: os.stat_result, path: Path, limit: SizeLimit | None) -> str | None:
    """Why a file (`info`: its `os.lstat`) is never uploaded, or None."""
    if stat.S_ISLNK(info.st_mode):
        return f"a symbolic link to {os.readlink(path)}; {LINK}"
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


def _identity(info: os.stat_result) -> tuple[int, ...]:
    return info.st_dev, info.st_ino, info.st_nlink, info.st_size, info.st_mtime_ns


def copy_regular_file(source: Path, target: Path, expected: os.stat_result) -> None:
    """Copy `source` to the new file `target` without following a link; raise `OSError` unless it is still the file
    checked (`expected`, its `os.lstat`) before and after the copy."""
    with open(os.open(source, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)), "rb") as src:
        if _identity(os.fstat(src.fileno())) != _identity(expected):
            raise OSError(f"{source} changed while it was staged for upload; stage again.")
        with open(target, "xb") as dst:
            shutil.copyfileobj(src, dst)
            copied = dst.tell()
        if _identity(os.fstat(src.fileno())) != _identity(expected) or copied != expected.st_size:
            raise OSError(f"{source} changed while it was copied for upload; stage again.")


def _unescaped(data: bytes) -> bytes:
    return _ESCAPE.sub(lambda m: chr(int(next(g for g in m.groups() if g), 16)).encode("utf-8", "replace"), data)


def readable_forms(path: Path) -> list[tuple[bytes, str | None]]:
    """The texts a reader can get out of a file, each with where it is (None: the file's own bytes): the bytes (of a
    safetensors file, its JSON header), with NULs dropped (UTF-16/32), with escapes decoded, and an image's text
    chunks. Raise `ValueError` for a `.safetensors` or image file that cannot be read as one."""
    forms: list[tuple[bytes, str | None]] = []
    where = None
    if path.name.endswith(".safetensors"):  # the header only: the tensors are numbers, and may be gigabytes
        with open(path, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            data = f.read(length) if length <= path.stat().st_size - 8 else b""
        try:
            if len(data) != length or not isinstance(json.loads(data), dict):
                raise ValueError
        except ValueError:
            raise ValueError(
                "is not a safetensors file (its header is not an 8-byte length and a JSON object)"
            ) from None
        where = "in its header"
    elif path.name.lower().endswith(IMAGE_SUFFIXES):
        data = path.read_bytes()
        try:
            with Image.open(path) as image:
                image.load()  # PNG text chunks after the pixels are read with them
                chunks = [v if isinstance(v, bytes) else str(v).encode("utf-8") for v in image.info.values()]
        except Exception:  # PIL raises many kinds for a damaged or disguised file, and for decompression bombs
            raise ValueError("cannot be read as the image its name says") from None
        forms.append((b"\n".join(chunks), "in its image text chunks"))
    else:
        data = path.read_bytes()
    forms.insert(0, (data, where))
    if b"\0" in data:
        forms.append((data.replace(b"\0", b""), "in its UTF-16 or UTF-32 text"))
    forms += [(_unescaped(text), f"{place or 'in its text'}, once its escapes are decoded") for text, place in list(forms)
              if _ESCAPE.search(text)]  # fmt: skip
    return forms


def secret_in(data: bytes) -> tuple[str, re.Match] | None:
    """The first secret in `data`: its kind (`SECRET_PATTERNS`) and where it matched."""
    return next(((kind, m) for kind, pattern in SECRET_PATTERNS.items() if (m := pattern.search(data))), None)


def redact(text: str) -> str:
    """`text` with every secret in it replaced by `<secret>`: for names that are printed."""
    data = text.encode("utf-8", "surrogateescape")
    for pattern in SECRET_PATTERNS.values():
        data = pattern.sub(b"<secret>", data)
    return data.decode("utf-8", "surrogateescape")


def find_secret(path: Path) -> str | None:
    """What secret a file holds and where (`readable_forms`), or why it cannot be read as its type; None when
    neither. The secret itself is never shown."""
    try:
        forms = readable_forms(path)
    except ValueError as error:
        return str(error)
    for data, where in forms:
        if found := secret_in(data):
            kind, match = found
            if where is None:
                line = data.count(b"\n", 0, match.start()) + 1
                try:
                    data.decode("utf-8")
                    where = f"on line {line}"
                except UnicodeDecodeError:  # not text: no lines to count
                    where = f"at byte {match.start():,}"
            return (
                f"holds {kind} {where}: remove it from the file (and revoke it, if it was ever shared); the secret is "
                "not shown here"
            )
    return None


def check_final_form(folder: Path) -> None:
    """Raise `ValueError` if a file of a finished staging folder holds a secret or cannot be read as its type."""
    if found := {path: reason for path in list_files(folder) if (reason := find_secret(folder / path))}:
        listed = "; ".join(f"{redact(path)}: {reason}" for path, reason in found.items())
        raise ValueError(f"Nothing was uploaded: the staged upload {listed}.")


def copy_tree(
    source: Path,
    target: Path,
    leave_out_dir: Callable[[str], str | None],
    leave_out_file: Callable[[str], str | None],
    size_limit: Callable[[str], SizeLimit | None] | None = None,
    total_limit: SizeLimit | None = None,
) -> tuple[dict[str, str], dict[str, str]]:
    """Copy what the upload's rules keep (`leave_out_dir`/`leave_out_file` give relative paths a reason to skip) from
    `source` into `target`, under the guards above; return the left-out and refused paths with reasons. Raise
    `ValueError` once the copied files pass `total_limit`."""
    left_out, refused = {}, {}
    total = 0
    for root, dirs, files in os.walk(source):  # os.walk lists a link to a folder in `dirs` but never enters it
        relative = Path(root).relative_to(source)
        kept = []
        for name in sorted(dirs):
            path = (relative / name).as_posix()
            if secret_in(_unescaped(name.encode("utf-8", "surrogateescape"))):
                refused[f"{redact(path)}/"] = NAMED_AFTER_A_SECRET
            elif reason := leave_out_dir(path):
                left_out[f"{path}/"] = reason
            elif (Path(root) / name).is_symlink():
                refused[f"{path}/"] = f"a symbolic link to a folder, {os.readlink(Path(root) / name)}; {LINK}"
            elif looks_like_credential(name):
                refused[f"{path}/"] = "the name looks like a credential"
            else:
                kept.append(name)
        dirs[:] = kept
        for name in sorted(files):
            path, file = (relative / name).as_posix(), Path(root) / name
            if secret_in(_unescaped(name.encode("utf-8", "surrogateescape"))):
                refused[redact(path)] = NAMED_AFTER_A_SECRET
                continue
            if reason := leave_out_file(path):
                left_out[path] = reason
                continue
            info = os.lstat(file)
            if reason := refused_file(info, file, size_limit(path) if size_limit else None):
                refused[path] = reason
                continue
            total += info.st_size
            if total_limit is not None and total > total_limit[0]:
                raise ValueError(
                    f"{source} holds more than {total_limit[0]:,} bytes to upload, the limit {total_limit[1]} (the "
                    f"limit was passed at {path}, {info.st_size:,} bytes). Leave large files out of the folder."
                )
            (target / relative).mkdir(parents=True, exist_ok=True)
            copy_regular_file(file, target / path, info)
            if reason := find_secret(target / path):
                (target / path).unlink()
                refused[path] = reason
    return dict(sorted(left_out.items())), dict(sorted(refused.items()))


def upload_report(staged: StagedUpload) -> str:
    """What of the source is not uploaded and why, one line each, refused files first; `""` when nothing."""
    lines = []
    for title, paths in (
        ("Refused, never uploaded:", staged.refused),
        ("Left out, not part of the upload:", staged.left_out),
    ):
        if paths:
            lines += [title, *(f"  {path}: {reason}" for path, reason in paths.items())]
    return redact("\n".join(lines))


def log_upload_report(staged: StagedUpload, source: Path) -> None:
    """Log `upload_report` for `source`: a warning when files were refused, else at info level."""
    if report := upload_report(staged):
        logger.log(
            logging.WARNING if staged.refused else logging.INFO, redact(f"Not uploaded from {source}:\n{report}")
        )


def list_files(folder: Path) -> list[str]:
    """Every file under `folder`, as sorted POSIX paths relative to it."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def commit_staged(api: HfApi, repo_id: str, folder: Path, commit_message: str, **kwargs) -> CommitInfo:
    """Upload every file of a staging folder to an existing repo in one `HfApi.create_commit` (`kwargs`: its
    `repo_type`, `revision`, `create_pr`). An explicit list of the vetted files, not `upload_folder`'s own walk."""
    operations = [CommitOperationAdd(path_in_repo=path, path_or_fileobj=folder / path) for path in list_files(folder)]
    return api.create_commit(repo_id, operations, commit_message=commit_message, **kwargs)


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
    """`stage(full repo id, folder)` into a temporary folder, log what was not uploaded, `create_repo` (exist ok),
    then one commit. A bare `repo_id` goes to the token's user."""
    api = HfApi(token=require_token(token))
    repo_id = repo_id if "/" in repo_id else f"{api.whoami()['name']}/{repo_id}"
    with tempfile.TemporaryDirectory(prefix="lmlp-upload-") as tmp:
        staged = stage(repo_id, Path(tmp) / "upload")
        log_upload_report(staged, Path(source))
        api.create_repo(repo_id, private=private, exist_ok=True)
        return commit_staged(api, repo_id, staged.folder, commit_message, revision=revision, create_pr=create_pr)
