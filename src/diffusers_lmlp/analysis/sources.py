"""What `--pipeline` names: a shipped pipeline, a pipeline or backbone folder, or a Hub repo id. The config is read
first, so `--layers` is checked before any weight loads; from the Hub only the backbone's files are fetched first.
"""

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..models.families import BlockFamily, family_of
from ..worlds import WORLDS, pipeline_problem


# A backbone's files, at the top of a model repo or under transformer/ of a pipeline repo.
BACKBONE_FILES = [
    "config.json",
    "diffusion_pytorch_model*.safetensors",
    "diffusion_pytorch_model.safetensors.index.json",
]
HUB_ALLOW_PATTERNS = ["model_index.json", *BACKBONE_FILES, *(f"transformer/{name}" for name in BACKBONE_FILES)]


@dataclass(frozen=True)
class BackboneSource:
    """Where the backbone `name` names lies (`subfolder` "transformer" in a pipeline), its config and family;
    `from_hub` when `folder` is a Hub snapshot of the backbone's files only."""

    name: str
    folder: Path
    subfolder: str | None
    config: dict[str, Any]
    family: BlockFamily
    from_hub: bool

    def load_backbone(self):
        """The backbone, by its class's strict, safetensors-only `from_pretrained`."""
        return self.family.model_class.from_pretrained(self.folder, subfolder=self.subfolder).eval()

    def load_pipeline(self, transformer):
        """The whole pipeline around the loaded `transformer`; `ValueError` for a backbone folder."""
        if self.subfolder is None:
            raise ValueError(
                f"routing samples captions, so it needs a whole pipeline, and --pipeline {self.name} is a backbone "
                "folder: pass the folder of the pipeline it belongs to."
            )
        from huggingface_hub.errors import LocalEntryNotFoundError

        from ..pipelines import LMLPPipeline

        try:
            return LMLPPipeline.from_pretrained(self.name if self.from_hub else self.folder, transformer=transformer)
        except (LocalEntryNotFoundError, FileNotFoundError) as error:
            raise OSError(f"--pipeline {self.name}: {error}") from None


def find_backbone(name: str) -> BackboneSource:
    """Find the backbone `--pipeline` names and read its config, loading no weights; `OSError` or `ValueError`
    (with what to change) when it names no backbone."""
    from_hub = False
    if name in WORLDS:
        folder = WORLDS[name].pipeline_path
    elif os.path.isdir(name):
        folder = Path(name)
    elif problem := pipeline_problem(name):
        raise OSError(problem)
    else:
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError

        try:
            folder, from_hub = Path(snapshot_download(name, allow_patterns=HUB_ALLOW_PATTERNS)), True
        except RepositoryNotFoundError:
            raise OSError(f"--pipeline {name}: no such local folder or accessible Hub repo (for a private one, "
                          "`hf auth login`)") from None  # fmt: skip
        except LocalEntryNotFoundError:
            why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the Hub could not be reached"
            raise OSError(f"--pipeline {name}: no such local folder, and not in the huggingface_hub cache "
                          f"({constants.HF_HUB_CACHE}) while {why}: `hf download {name}` it, or pass a local folder"
                          ) from None  # fmt: skip
    subfolder = "transformer" if (folder / "model_index.json").is_file() else None
    config_file = folder / (subfolder or "") / "config.json"
    if not config_file.is_file():
        raise ValueError(
            f"--pipeline {name}: {config_file} does not exist. Pass a pipeline folder (model_index.json and "
            "transformer/) or a backbone folder (config.json and diffusion_pytorch_model.safetensors)."
        )
    config = json.loads(config_file.read_text(encoding="utf-8"))
    try:
        family = family_of(config)
    except ValueError as error:
        raise ValueError(f"--pipeline {name}: {config_file} is not a backbone's config: {error}") from None
    return BackboneSource(name, folder, subfolder, config, family, from_hub)
