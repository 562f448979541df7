"""Running code as if diffusers-lmlp were not installed, offline, on model repos laid out in a Hub cache.

A subprocess whose `sitecustomize.py` is `SITECUSTOMIZE` refuses every import of `diffusers_lmlp` (as if it were not
installed) and records each attempt; `fill_cache` lays out a staged folder as huggingface_hub caches a download, so
that the subprocess loads it by repo id with `HF_HUB_OFFLINE=1`.
"""

import os
import shutil
from pathlib import Path

from test_pipeline_loading import fill_hub_cache


# Plays a Python environment without diffusers-lmlp: importing it fails as if it were not installed (but for a copy
# under the folder `LMLP_VENDORED` names, when set), and each attempt is recorded (diffusers' import scan tries every module a line of a remote file seems to import): in `ATTEMPTS`, and
# one line each in the file `LMLP_IMPORT_LOG` names, when set (for a process that does not exit on its own).
SITECUSTOMIZE = """
import os
import sys

ATTEMPTS = []


class RefuseDiffusersLmlp:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "diffusers_lmlp":
            if os.environ.get("LMLP_VENDORED"):  # a copy under this folder may load, no other
                from importlib.machinery import PathFinder

                spec = PathFinder.find_spec(name, path)
                if spec and spec.origin and spec.origin.startswith(os.environ["LMLP_VENDORED"] + os.sep):
                    return spec
            ATTEMPTS.append(name)
            if os.environ.get("LMLP_IMPORT_LOG"):
                with open(os.environ["LMLP_IMPORT_LOG"], "a") as log:
                    log.write(name + "\\n")
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, RefuseDiffusersLmlp())
"""


def fill_cache(staged: Path, cache: Path, repo_id: str) -> None:
    """The staged folder as huggingface_hub caches a download of `repo_id` (blobs, snapshots/<commit>, refs/main),
    without the cached file listing (`trees/`): with one, diffusers 0.42.1 asks the Hub for the commit of the code
    (`get_cached_module_file` calls `model_info`), which fails offline."""
    fill_hub_cache(staged, cache, repo_id)
    shutil.rmtree(cache / f"models--{repo_id.replace('/', '--')}" / "trees")


def environment_without_package(root: Path) -> dict[str, str]:
    """The environment of a subprocess that cannot import diffusers_lmlp, offline, with its Hub cache at
    `root/cache` (fill it with `fill_cache`) and its other Hugging Face files (the remote code diffusers copies) under
    `root/hf_home`; imports of the package are logged to `root/imports.log`.

    Args:
        root (`Path`): A folder of the test's own.
    """
    (root / "site").mkdir(exist_ok=True)
    (root / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return {
        **os.environ,
        "PYTHONPATH": str(root / "site"),
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_CACHE": str(root / "cache"),
        "HF_HOME": str(root / "hf_home"),
        "LMLP_IMPORT_LOG": str(root / "imports.log"),
        "GRADIO_ANALYTICS_ENABLED": "False",
    }
