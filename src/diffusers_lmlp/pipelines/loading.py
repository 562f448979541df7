"""What `LMLPPipeline.from_pretrained` checks and fetches before diffusers loads the components (a Hub snapshot with
nothing to unpickle), and the view a `--with-code` folder loads through."""

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import huggingface_hub
from huggingface_hub import snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    IncompleteSnapshotError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
)

from ..folders import PICKLE_SUFFIXES, TOKENIZER_FILES
from ..worlds import is_repo_id


HUB_ALLOW_PATTERNS = ["*.json", "*.txt", "*.safetensors"]  # nothing to unpickle


def _refuse_unpickling(kwargs: dict[str, Any]) -> None:
    """Refuse `use_safetensors` other than unset or `True` among `from_pretrained`'s arguments; then set it `True`."""
    if kwargs.get("use_safetensors") not in (None, True):
        raise ValueError(
            f"LMLPPipeline loads safetensors only, got use_safetensors={kwargs['use_safetensors']!r}. Convert trusted "
            "pickled weights once with save_pretrained(..., safe_serialization=True)."
        )
    kwargs["use_safetensors"] = True


def _check_folder(folder: str, model_index: dict[str, Any], path: str, kwargs: dict[str, Any]) -> None:
    """Refuse `strict` (diffusers does not pass it on), a component `model_index.json` names without its folder or a
    tokenizer without its files (transformers would build an empty one), and a local folder of pickled weights only."""
    if "strict" in kwargs:
        transformer_class = model_index.get("transformer", [None, "<the transformer's class>"])[1]
        raise ValueError(
            "diffusers does not pass `strict` on to the backbone; load it with it and pass it in: transformer = "
            f'{transformer_class}.from_pretrained({path!r}, subfolder="transformer", strict={kwargs["strict"]!r}), '
            f"then LMLPPipeline.from_pretrained({path!r}, transformer=transformer)."
        )
    for component, entry in sorted(model_index.items()):
        if not isinstance(entry, list) or entry[0] is None or component in kwargs:
            continue
        directory = os.path.join(folder, component)
        if not os.path.isdir(directory):
            raise ValueError(
                f"{folder} has no {component}/ folder, but its model_index.json names the {component} ({entry[1]}); "
                f"copy its files into {directory}, or pass {component}=... to from_pretrained."
            )
        files = os.listdir(directory)
        if "Tokenizer" in entry[1] and not set(TOKENIZER_FILES) & set(files):
            raise ValueError(
                f"The tokenizer folder {directory} has neither {' nor '.join(TOKENIZER_FILES)}; save the tokenizer "
                "there, or pass tokenizer=... to from_pretrained."
            )
        pickled = sorted(f for f in files if f.endswith(PICKLE_SUFFIXES))
        if folder == path and pickled and not any(f.endswith(".safetensors") for f in files):
            raise ValueError(
                f"{directory} holds only pickled weights ({', '.join(pickled)}), and LMLPPipeline loads safetensors "
                "only. If you trust them, convert them once: DiffusionPipeline.from_pretrained(folder, "
                "use_safetensors=False).save_pretrained(...)."
            )


def _hub_snapshot(source: str | os.PathLike, kwargs: dict[str, Any]) -> str:
    """The local snapshot of the Hub repo `source`, fetched or cached, taking the Hub arguments out of `kwargs`; one
    clear error for a file, a path, an unknown repo or one neither cached nor reachable."""
    name = os.fspath(source)
    if os.path.exists(name):
        raise NotADirectoryError(f"{name} is a file; pass the pipeline's folder (the one with model_index.json).")
    missing = f"No such local folder: {name}"
    if isinstance(source, os.PathLike) or not is_repo_id(name):
        tilde = " (a ~ is not expanded: pass os.path.expanduser(path))" if name.startswith("~") else ""
        raise FileNotFoundError(f"{missing}{tilde}; the current directory is {os.getcwd()}.")
    missing += f" (there is no {os.path.abspath(name)})"
    cache_dir = kwargs.pop("cache_dir", None)
    local_files_only = kwargs.pop("local_files_only", None) or False
    try:
        return snapshot_download(
            name, revision=kwargs.pop("revision", None), cache_dir=cache_dir, token=kwargs.pop("token", None),
            force_download=kwargs.pop("force_download", False), local_files_only=local_files_only,
            allow_patterns=HUB_ALLOW_PATTERNS,
            ignore_patterns=None if kwargs.get("variant") else ["*.*.safetensors"],  # e.g. model.fp16.safetensors
        )  # fmt: skip
    except RepositoryNotFoundError as error:
        if isinstance(error, GatedRepoError):  # it exists, and its error says how to get access
            raise
        raise FileNotFoundError(
            f"{missing}, and no Hub repo you can access has that id; for a private repo, pass token=..."
        ) from None
    except LocalEntryNotFoundError as error:
        cache = cache_dir or huggingface_hub.constants.HF_HUB_CACHE
        offline = huggingface_hub.constants.HF_HUB_OFFLINE or local_files_only
        why = "incomplete" if isinstance(error, IncompleteSnapshotError) else "missing"
        download = f"hf download {name}" + (f" --cache-dir {cache_dir}" if cache_dir else "")
        raise LocalEntryNotFoundError(
            f"{missing}, and the Hub repo's copy in the cache {cache} is {why}"
            f"{' (offline)' if offline else ', and the Hub could not be reached'}: run `{download}` where the Hub "
            "can be reached, or pass a local folder."
        ) from None


@contextmanager
def _folder_view(folder: str, model_index: dict[str, Any]) -> Iterator[str]:
    """A temporary folder linking every file of `folder` but `model_index.json`, written as `model_index`."""
    with tempfile.TemporaryDirectory(prefix="lmlp-pipeline-") as view:
        for name in os.listdir(folder):
            if name != "model_index.json":
                os.symlink(os.path.abspath(os.path.join(folder, name)), os.path.join(view, name))
        with open(os.path.join(view, "model_index.json"), "w", encoding="utf-8") as f:
            json.dump(model_index, f)
        yield view
