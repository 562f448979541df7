"""`cd spaces/lmlp-demo && python app.py` with the package installed serves its shipped models offline."""

import os
import subprocess

import pytest
from documents import ROOT
from gradio_client import Client
from gradio_client.exceptions import AppError
from PIL import Image
from space_server import app_process, image_std, model_panel

from diffusers_lmlp.hub.space import DEFAULT_SPACE_DIR


def untracked_files() -> set[str] | None:
    """The files of the Space folder git would show as new (not ignored); None outside a git checkout."""
    if (ROOT / ".git").exists():
        command = ["git", "ls-files", "--others", "--exclude-standard", "--", "."]
        listed = subprocess.run(command, cwd=DEFAULT_SPACE_DIR, capture_output=True, text=True, check=True)
        return set(listed.stdout.split())


@pytest.mark.slow
def test_python_app_py_in_the_space_folder_serves_the_shipped_model_offline(tmp_path):
    before = untracked_files()  # DEFAULT_SPACE_DIR is spaces/lmlp-demo/ in a checkout: see test_hub.py
    # Sampling frozen, compiled before the first request, is tested in test_space.py; here it would compile twice.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "GRADIO_ANALYTICS_ENABLED": "False", "LMLP_NUM_THREADS": "1"}
    env = {**{k: v for k, v in env.items() if k != "LMLP_MODEL"}, "LMLP_FREEZE": "0"}
    with app_process(DEFAULT_SPACE_DIR, env, tmp_path / "server.log") as url:
        panel = model_panel(url)
        client = Client(url, verbose=False)
        request = ("a large red circle at the center", "", 3, False, 3, 2.0, 1)  # (prompt, ..., num_images), model
        gallery, seed = client.predict(*request, "shapes", api_name="/generate")
        with pytest.raises(AppError, match="The model must be one of 'emoji', 'shapes', got 'other'"):
            client.predict(*request, "other", api_name="/generate")
    # It opens on the shipped emoji model, with the shapes model beside it.
    assert "### Model: lmlp-emoji\nships with diffusers-lmlp: `pretrained_emoji_pipeline()`" in panel
    assert seed == 3 and len(gallery) == 1
    assert Image.open(gallery[0]["image"]).size == (32, 32) and image_std(Image.open(gallery[0]["image"])) > 8
    log = (tmp_path / "server.log").read_text()
    assert "Serving emoji.\n" in log and "Serving shapes.\n" in log
    assert "Sampling eagerly (LMLP_FREEZE=0).\n" in log
    # A local run leaves nothing in the folder that git would pick up (or push-space upload: it skips hidden files).
    assert untracked_files() == before
