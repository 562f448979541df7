"""Running code offline as if diffusers-lmlp were not installed (`SITECUSTOMIZE`), on repos `fill_cache` lays out."""

import os
import shutil
from pathlib import Path

from test_pipeline_loading import fill_hub_cache


# Imports of diffusers_lmlp fail as if it were not installed (but a copy under the folder `LMLP_VENDORED` names, when
# set); each attempt (diffusers' import scan tries every module a remote file seems to import) goes into `ATTEMPTS`
# and, when `LMLP_IMPORT_LOG` names a file, one line of it (for a process that does not exit on its own).
SITECUSTOMIZE = """
import os, sys
from importlib.machinery import PathFinder

ATTEMPTS = []


class RefuseDiffusersLmlp:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] != "diffusers_lmlp":
            return None
        vendored, log = os.environ.get("LMLP_VENDORED"), os.environ.get("LMLP_IMPORT_LOG")
        spec = PathFinder.find_spec(name, path) if vendored else None
        if spec and spec.origin and spec.origin.startswith(vendored + os.sep):  # a copy under it may load, no other
            return spec
        ATTEMPTS.append(name)
        if log:
            with open(log, "a") as file:
                file.write(name + "\\n")
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)


sys.meta_path.insert(0, RefuseDiffusersLmlp())
"""


def fill_cache(staged: Path, cache: Path, repo_id: str) -> None:
    """Lay out `staged` as huggingface_hub caches `repo_id`, no `trees/` (with one, remote code asks the Hub)."""
    fill_hub_cache(staged, cache, repo_id)
    shutil.rmtree(cache / f"models--{repo_id.replace('/', '--')}" / "trees")


def environment_without_package(root: Path) -> dict[str, str]:
    """The environment of an offline subprocess that cannot import diffusers_lmlp: Hub cache `root/cache` (see
    `fill_cache`), other Hugging Face files under `root/hf_home`, its imports of the package in `root/imports.log`."""
    (root / "site").mkdir(exist_ok=True)
    (root / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    hf = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(root / "cache"), "HF_HOME": str(root / "hf_home")}
    log = {"LMLP_IMPORT_LOG": str(root / "imports.log"), "GRADIO_ANALYTICS_ENABLED": "False"}
    return {**os.environ, "PYTHONPATH": str(root / "site"), **hf, **log}
