"""What `LMLPPipeline.from_pretrained` checks and fetches before diffusers loads the components.

A Hub repo id becomes a local snapshot of safetensors weights, configs and tokenizer files; a folder that would
unpickle, lacks a component's folder or names `strict` is refused with a message that says what to change; a
`--with-code` folder loads through a view whose `model_index.json` names the package's classes.
"""

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


# What `from_pretrained` fetches from a Hub repo: configs, tokenizer files and safetensors, nothing to unpickle.
HUB_ALLOW_PATTERNS = ["*.json", "*.txt", "*.safetensors"]


def _refuse_unpickling(kwargs: dict[str, Any]) -> None:
    """Raise unless `use_safetensors` is unset or `True` in the arguments of `from_pretrained`; then set it `True`."""
    if kwargs.get("use_safetensors") not in (None, True):
        raise ValueError(
            "LMLPPipeline loads safetensors weights only, so that loading never unpickles; got "
            f"use_safetensors={kwargs['use_safetensors']!r}. Convert pickled weights once, in a process that "
            "trusts them, by loading them and calling save_pretrained(..., safe_serialization=True)."
        )
    kwargs["use_safetensors"] = True


def _refuse_strict(kwargs: dict[str, Any], model_index: dict[str, Any], path: str) -> None:
    """Raise if `strict` is among the arguments of `from_pretrained`, saying how to pass it to the backbone."""
    if "strict" in kwargs:
        transformer_class = model_index.get("transformer", [None, "<the transformer's class>"])[1]
        raise ValueError(
            "strict is an argument of the backbone's from_pretrained, and diffusers' component loading does not "
            f"pass it on. Load the transformer with it and pass it to the pipeline: transformer = "
            f'{transformer_class}.from_pretrained({path!r}, subfolder="transformer", strict='
            f"{kwargs['strict']!r}), then LMLPPipeline.from_pretrained({path!r}, transformer=transformer)."
        )


def _refuse_pickled_weights(folder: str, model_index: dict[str, Any]) -> None:
    """Raise if the folder of a component named in `model_index.json` holds pickled weights and no safetensors."""
    for component in sorted(name for name, entry in model_index.items() if isinstance(entry, list)):
        directory = os.path.join(folder, component)
        if not os.path.isdir(directory):
            continue
        files = os.listdir(directory)
        pickled = sorted(f for f in files if f.endswith(PICKLE_SUFFIXES))
        if pickled and not any(f.endswith(".safetensors") for f in files):
            raise ValueError(
                f"{directory} holds only pickled weights ({', '.join(pickled)}), and LMLPPipeline loads safetensors "
                "weights only, so that loading never unpickles. If you trust the files, convert them once: load the "
                "pipeline with DiffusionPipeline.from_pretrained(folder, use_safetensors=False) and save it again "
                "with save_pretrained (safetensors is the default)."
            )


def _require_component_folders(folder: str, model_index: dict[str, Any], passed: set[str]) -> None:
    """Raise if a component named in `model_index.json` (and not `passed` in) has no folder, or a tokenizer no files:
    transformers would build an empty tokenizer, or fail later with a `model_max_length=1e30` mismatch."""
    for component, entry in sorted(model_index.items()):
        if not isinstance(entry, list) or entry[0] is None or component in passed:
            continue
        directory = os.path.join(folder, component)
        if not os.path.isdir(directory):
            raise ValueError(
                f"{folder} has no {component}/ folder, but its model_index.json names the {component} "
                f"({entry[1]}). Copy that component's files into {directory}, or pass {component}=... to "
                "from_pretrained."
            )
        if "Tokenizer" in entry[1] and not any(os.path.isfile(os.path.join(directory, f)) for f in TOKENIZER_FILES):
            raise ValueError(
                f"The tokenizer folder {directory} has neither {' nor '.join(TOKENIZER_FILES)}, so the tokenizer "
                "would load empty. Save the tokenizer there (tokenizer.save_pretrained), or pass tokenizer=... to "
                "from_pretrained."
            )


def _hub_snapshot(source: str | os.PathLike, kwargs: dict[str, Any]) -> str:
    """The local snapshot of the Hub repo `source` (configs, tokenizer files, safetensors), fetched or read from the
    cache; takes the Hub arguments out of `kwargs`. Raises `FileNotFoundError` for a path or a missing repo, and
    `LocalEntryNotFoundError` for a repo neither cached nor reachable, each saying what to do."""
    name = os.fspath(source)
    if os.path.exists(name):
        raise NotADirectoryError(f"{name} is a file; pass the pipeline's folder (the one with model_index.json).")
    folder = os.path.abspath(name)
    # A path object, or a name the Hub refuses as a repo id (leading ".", "~" or "/", two "/", other characters).
    if isinstance(source, os.PathLike) or not is_repo_id(name):
        tilde = " (a ~ is not expanded: pass os.path.expanduser(path))" if name.startswith("~") else ""
        raise FileNotFoundError(
            f"No such local folder: {name}{tilde}. Pass the folder that save_pretrained wrote (it holds "
            f"model_index.json); the current directory is {os.getcwd()}."
        )
    cache_dir = kwargs.pop("cache_dir", None)
    local_files_only = kwargs.pop("local_files_only", None) or False
    try:
        return snapshot_download(
            name,
            revision=kwargs.pop("revision", None),
            cache_dir=cache_dir,
            token=kwargs.pop("token", None),
            force_download=kwargs.pop("force_download", False),
            local_files_only=local_files_only,
            allow_patterns=HUB_ALLOW_PATTERNS,
            # Without a variant, skip variant weights such as `model.fp16.safetensors`.
            ignore_patterns=None if kwargs.get("variant") else ["*.*.safetensors"],
        )
    except RepositoryNotFoundError as error:
        if isinstance(error, GatedRepoError):  # the repo exists, and its error says how to get access
            raise
        raise FileNotFoundError(
            f"No such local folder: {name} (there is no {folder}), and no Hub repo you can access has that id. Check "
            "the name; for a private repo, log in (`hf auth login`) or pass token=..."
        ) from None
    except LocalEntryNotFoundError as error:
        cache = cache_dir or huggingface_hub.constants.HF_HUB_CACHE
        if isinstance(error, IncompleteSnapshotError):
            why = f"its copy in the huggingface_hub cache ({cache}) is incomplete, and it cannot be completed now"
        else:
            why = f"the huggingface_hub cache ({cache}) holds no copy of it"
        if huggingface_hub.constants.HF_HUB_OFFLINE:
            why += ", and HF_HUB_OFFLINE is set, so the Hub is not contacted"
        elif local_files_only:
            why += ", and local_files_only=True, so the Hub is not contacted"
        else:
            why += ", and the Hub could not be reached"
        download = f"hf download {name}" + (f" --cache-dir {cache_dir}" if cache_dir else "")
        raise LocalEntryNotFoundError(
            f"No such local folder: {name} (there is no {folder}), and as a Hub repo id it cannot be loaded: {why}. "
            f"To use the Hub repo, download it where the Hub can be reached (`{download}`), then load it again "
            "(offline too); to use a local folder, pass its path."
        ) from None


@contextmanager
def _folder_view(folder: str, model_index: dict[str, Any]) -> Iterator[str]:
    """A temporary folder linking every file of `folder` but `model_index.json`, which it holds as `model_index`:
    diffusers loads a with-code folder from it with the package's classes (see `package_model_index`)."""
    with tempfile.TemporaryDirectory(prefix="lmlp-pipeline-") as view:
        for name in os.listdir(folder):
            if name != "model_index.json":
                os.symlink(os.path.abspath(os.path.join(folder, name)), os.path.join(view, name))
        with open(os.path.join(view, "model_index.json"), "w", encoding="utf-8") as f:
            json.dump(model_index, f)
        yield view
