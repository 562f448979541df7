"""The guards every upload shares, and the one commit. `copy_tree` copies each file once into a staging folder that
every later step reads; it never takes a link, a non-regular file, a credential-like name, an oversized file, or a
secret in any form a reader gets out of a file (`readable_forms`). `check_final_form` scans the finished folder."""

import json
import logging
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

from huggingface_hub import CommitInfo, CommitOperationAdd, HfApi, get_token
from huggingface_hub.utils import HFValidationError, validate_repo_id
from PIL import Image


logger = logging.getLogger(__name__)

# A name looks like a credential when a word of it (split at non-alphanumerics and camelCase) is one of
# CREDENTIAL_WORDS or ends with one of CREDENTIAL_ENDINGS ("mytoken", not "tokenizer"), two adjacent words are a
# CREDENTIAL_WORD_PAIRS, or it ends with one of CREDENTIAL_SUFFIXES.
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
_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+[0-9]*|[0-9]+")
# Formats with a fixed prefix and a long random part; the lookbehind keeps the prefix from continuing a longer word.
SECRET_PATTERNS: dict[str, re.Pattern[bytes]] = {
    "a Hugging Face token (hf_...)": re.compile(rb"hf_(?<![A-Za-z0-9]hf_)[A-Za-z0-9]{30,}"),
    "a Hugging Face organization token (api_org_...)": re.compile(rb"api_org_(?<![A-Za-z0-9]api_org_)[A-Za-z0-9]{30,}"),
    "an AWS access key id (AKIA...)": re.compile(rb"(?:AKIA|ASIA)(?<![A-Za-z0-9]....)[A-Z0-9]{16}(?![A-Za-z0-9])"),
    "a GitHub token (ghp_...)": re.compile(rb"gh[pousr]_(?<![A-Za-z0-9]..._)[A-Za-z0-9]{36,}"),
    "a GitHub token (github_pat_...)": re.compile(rb"github_pat_(?<![A-Za-z0-9]github_pat_)[A-Za-z0-9_]{40,}"),
    "an OpenAI API key (sk-...)": re.compile(rb"sk-(?<![A-Za-z0-9]sk-)[A-Za-z0-9_-]{8,}T3BlbkFJ[A-Za-z0-9_-]{8,}"),
    "an Anthropic API key (sk-ant-...)": re.compile(rb"sk-ant-(?<![A-Za-z0-9]sk-ant-)[a-z]+[0-9]{2}-[A-Za-z0-9_-]{32,}"),
    "a Google API key (AIza...)": re.compile(rb"AIza(?<![A-Za-z0-9]AIza)[0-9A-Za-z_-]{35}"),
    "a Slack token (xox...)": re.compile(rb"xox[abposr]-(?<![A-Za-z0-9]....-)[0-9]{6,}-[A-Za-z0-9-]{8,}"),
    "a private key (-----BEGIN ... PRIVATE KEY-----)": re.compile(rb"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY"),
}  # fmt: skip
# Escapes a reader decodes: JSON's and Python's \u005f and \x5f, URLs' %5F.
_ESCAPE = re.compile(rb"\\u([0-9a-fA-F]{4})|\\x([0-9a-fA-F]{2})|%([0-9a-fA-F]{2})")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
SizeLimit = tuple[int, str]  # (the most bytes, what it is for)
TEXT_LIMIT: SizeLimit = (16_000_000, "for .json, .txt and .md files")
IMAGE_LIMIT: SizeLimit = (32_000_000, "for images")


@dataclass
class StagedUpload:
    """A staging `folder` of exactly the `files` uploaded; the source paths `left_out` and `refused`, with reasons."""

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
    """`token`, else the one huggingface_hub finds; raise, naming `option`, if none, or if it is blank or padded."""
    if token is not None and (not token.strip() or token != token.strip()):
        problem = "is blank" if not token.strip() else "has spaces or a line break around it"
        raise ValueError(f"The token given with {option} {problem}: pass the token itself (hf_...).")
    if not (token := token or get_token()):
        raise ValueError(f"No Hugging Face token: pass {option}, set HF_TOKEN, or run `hf auth login` (or --dry-run).")
    return token


@contextmanager
def staging(output_dir: str | os.PathLike | None, prefix: str, source: Path) -> Iterator[Path]:
    """An empty folder to stage `source` in (`output_dir`, or a temporary one), emptied again if staging fails."""
    target = Path(output_dir) if output_dir is not None else Path(tempfile.mkdtemp(prefix=prefix))
    existed = output_dir is not None and target.is_dir()
    if output_dir is not None:
        if target.resolve().is_relative_to(source.resolve()):
            raise ValueError(f"The output folder {target} is inside {source}, which it copies; pick one outside it.")
        if target.exists() and (not target.is_dir() or any(target.iterdir())):
            raise FileExistsError(f"{target} already exists and is not an empty folder; pick a new --output-dir.")
        target.mkdir(parents=True, exist_ok=True)
    try:
        yield target
    except BaseException:
        for child in target.iterdir():
            shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
        if not existed:
            target.rmdir()
        raise


def ignored(patterns: Sequence[str], reason: str) -> Callable[[str], str | None]:
    """A leave-out rule: `reason` (`{pattern}` in it names the pattern) for a path whose name matches a pattern."""

    def rule(path: str) -> str | None:
        pattern = next((p for p in patterns if fnmatch(path.rsplit("/", 1)[-1], p)), None)
        return None if pattern is None else reason.format(pattern=repr(pattern))

    return rule


def looks_like_credential(name: str) -> bool:
    """Whether a file or folder name (`"hf_token.txt"`, `".env"`, `"id_rsa"`) looks like a credential."""
    words = [word.lower() for word in _WORD.findall(name)]
    return (
        any(word in CREDENTIAL_WORDS or word.endswith(CREDENTIAL_ENDINGS) for word in words)
        or any(pair in CREDENTIAL_WORD_PAIRS for pair in zip(words, words[1:]))
        or name.lower().endswith(CREDENTIAL_SUFFIXES)
    )


def refused_entry(info: os.stat_result, path: Path, limit: SizeLimit | None) -> str | None:
    """Why a file or folder (`info`: its `os.lstat`) is never uploaded, or None."""
    if stat.S_ISLNK(info.st_mode):
        return (
            f"a symbolic link to {'a folder, ' if path.is_dir() else ''}{os.readlink(path)}; links are never followed"
        )
    if not stat.S_ISDIR(info.st_mode) and not stat.S_ISREG(info.st_mode):
        return "not a regular file (a FIFO, socket or device)"
    if not stat.S_ISDIR(info.st_mode) and info.st_nlink > 1:
        return (
            f"a hard link ({info.st_nlink} names for one file, maybe outside the folder): copy it to a file of its own"
        )
    if looks_like_credential(path.name):
        return "the name looks like a credential"
    if limit is not None and info.st_size > limit[0]:
        return f"{info.st_size:,} bytes, over the limit of {limit[0]:,} bytes {limit[1]}"
    return None


def copy_regular_file(source: Path, target: Path, expected: os.stat_result) -> None:
    """Copy `source` to `target` without following a link; raise `OSError` unless it stays the file `expected`."""
    identity = lambda info: (info.st_dev, info.st_ino, info.st_nlink, info.st_size, info.st_mtime_ns)  # noqa: E731
    with open(os.open(source, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)), "rb") as src, open(target, "xb") as dst:
        before = identity(os.fstat(src.fileno()))
        shutil.copyfileobj(src, dst)
        if {before, identity(os.fstat(src.fileno()))} != {identity(expected)} or dst.tell() != expected.st_size:
            raise OSError(f"{source} changed while it was copied for upload; stage again.")


def _unescaped(data: bytes) -> bytes:
    return _ESCAPE.sub(lambda m: chr(int(next(g for g in m.groups() if g), 16)).encode("utf-8", "replace"), data)


def readable_forms(path: Path) -> list[tuple[bytes, str | None]]:
    """The texts a reader gets out of a file, each with where (None: its bytes): the bytes (of a safetensors file, its
    header), without NULs (UTF-16/32), with escapes decoded, an image's text chunks. Raise `ValueError` for a fake."""
    if path.name.endswith(".safetensors"):  # the tensors are numbers, and may be gigabytes
        with open(path, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            data = f.read(length) if length <= path.stat().st_size - 8 else b""
        try:
            valid = len(data) == length and isinstance(json.loads(data), dict)
        except ValueError:
            valid = False
        if not valid:
            raise ValueError("is not a safetensors file (its header is not an 8-byte length and a JSON object)")
        forms = [(data, "in its header")]
    else:
        forms = [(data := path.read_bytes(), None)]
    if path.name.lower().endswith(IMAGE_SUFFIXES):
        try:
            with Image.open(path) as image:
                image.load()  # PNG text chunks after the pixels are read with them
                chunks = [v if isinstance(v, bytes) else str(v).encode() for v in image.info.values()]
        except Exception:  # PIL raises many kinds for a damaged or disguised file
            raise ValueError("cannot be read as the image its name says") from None
        forms.append((b"\n".join(chunks), "in its image text chunks"))
    if b"\0" in data:
        forms.append((data.replace(b"\0", b""), "in its UTF-16 or UTF-32 text"))
    escaped = [(text, place or "in its text") for text, place in forms if _ESCAPE.search(text)]
    return forms + [(_unescaped(text), f"{place}, once its escapes are decoded") for text, place in escaped]


def secret_in(data: bytes) -> tuple[str, re.Match] | None:
    return next(((kind, m) for kind, pattern in SECRET_PATTERNS.items() if (m := pattern.search(data))), None)


def redact(text: str) -> str:
    data = text.encode("utf-8", "surrogateescape")
    for pattern in SECRET_PATTERNS.values():
        data = pattern.sub(b"<secret>", data)
    return data.decode("utf-8", "surrogateescape")


def find_secret(path: Path) -> str | None:
    """What secret a file holds and where (never the secret), or why it cannot be read as its type; else None."""
    try:
        forms = readable_forms(path)
    except ValueError as error:
        return str(error)
    for data, where in forms:
        if found := secret_in(data):
            kind, match = found
            line = data.count(b"\n", 0, match.start()) + 1
            if where is None:
                try:
                    data.decode("utf-8")
                    where = f"on line {line}"
                except UnicodeDecodeError:  # not text: no lines to count
                    where = f"at byte {match.start():,}"
            return f"holds {kind} {where}: remove it from the file (and revoke it); the secret is not shown here"
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
    size_limit: Callable[[str], SizeLimit | None] = lambda path: None,
    total_limit: SizeLimit | None = None,
) -> tuple[dict[str, str], dict[str, str]]:
    """Copy from `source` into `target` what the upload's rules keep (`leave_out_*` give a relative path a reason to
    skip it) under the guards; return the left-out and refused paths with reasons. Raise once over `total_limit`."""
    left_out, refused, total = {}, {}, 0
    for root, dirs, files in os.walk(source):  # os.walk lists a link to a folder in `dirs` but never enters it
        relative = Path(root).relative_to(source)
        entries = [(name, True) for name in sorted(dirs)] + [(name, False) for name in sorted(files)]
        dirs.clear()
        for name, is_dir in entries:
            path, file = (relative / name).as_posix(), Path(root) / name
            shown = f"{path}/" if is_dir else path
            if secret_in(_unescaped(os.fsencode(name))):
                refused[redact(shown)] = "its name holds a secret (not shown here): rename it"
            elif reason := (leave_out_dir if is_dir else leave_out_file)(path):
                left_out[shown] = reason
            elif reason := refused_entry(info := os.lstat(file), file, None if is_dir else size_limit(path)):
                refused[shown] = reason
            elif is_dir:
                dirs.append(name)
            else:
                if total_limit is not None and (total := total + info.st_size) > total_limit[0]:
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
        lines += [title, *(f"  {path}: {reason}" for path, reason in paths.items())] if paths else []
    return redact("\n".join(lines))


def log_upload_report(staged: StagedUpload, source: Path) -> None:
    """Log `upload_report`: a warning when files were refused, else at info level."""
    if report := upload_report(staged):
        logger.log(
            logging.WARNING if staged.refused else logging.INFO, redact(f"Not uploaded from {source}:\n{report}")
        )


def list_files(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def commit_staged(api: HfApi, repo_id: str, folder: Path, commit_message: str, **kwargs) -> CommitInfo:
    """Upload every staged file in one `HfApi.create_commit`: the vetted files, not `upload_folder`'s own walk."""
    operations = [CommitOperationAdd(path_in_repo=path, path_or_fileobj=folder / path) for path in list_files(folder)]
    return api.create_commit(repo_id, operations, commit_message=commit_message, **kwargs)


def publish_model_repo(source, repo_id: str, stage: Callable, options: dict, message: str, token, private, **commit):
    """`stage(source, full repo id, temporary folder, **options)`, log what was not uploaded, `create_repo` (exist
    ok), then one commit (`commit`: `revision`, `create_pr`). A bare `repo_id` goes to the token's user."""
    check_repo_id(repo_id, "model repo id")
    api = HfApi(token=require_token(token))
    repo_id = repo_id if "/" in repo_id else f"{api.whoami()['name']}/{repo_id}"
    with tempfile.TemporaryDirectory(prefix="lmlp-upload-") as tmp:
        staged = stage(source, repo_id, Path(tmp) / "upload", **options)
        log_upload_report(staged, Path(source))
        api.create_repo(repo_id, private=private, exist_ok=True)
        return commit_staged(api, repo_id, staged.folder, message, **commit)
