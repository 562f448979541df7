"""`cd spaces/lmlp-demo && python app.py` with the package installed serves its shipped models offline."""

import os
import subprocess
from pathlib import Path

import pytest
from gradio_client import Client
from gradio_client.exceptions import AppError
from PIL import Image
from space_server import app_process, image_std, model_panel

from diffusers_lmlp.hub.space import DEFAULT_SPACE_DIR


ROOT = Path(__file__).resolve().parents[2]
SPACE_FOLDER = ROOT / "spaces" / "lmlp-demo"


def untracked_files(folder: Path) -> set[str] | None:
    """The files of `folder` git would show as new (not ignored), relative to it; None outside a git checkout."""
    if (ROOT / ".git").exists():
        command = ["git", "ls-files", "--others", "--exclude-standard", "--", "."]
        return set(subprocess.run(command, cwd=folder, capture_output=True, text=True, check=True).stdout.split())


@pytest.mark.slow
def test_python_app_py_in_the_space_folder_serves_the_shipped_model_offline(tmp_path):
    assert DEFAULT_SPACE_DIR == SPACE_FOLDER  # the folder push-space uploads from a checkout
    before = untracked_files(SPACE_FOLDER)
    # Sampling frozen, compiled before the first request, is tested in test_space.py; here it would compile twice.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "GRADIO_ANALYTICS_ENABLED": "False", "LMLP_NUM_THREADS": "1"}
    env = {**{k: v for k, v in env.items() if k != "LMLP_MODEL"}, "LMLP_FREEZE": "0"}
    with app_process(SPACE_FOLDER, env, tmp_path / "server.log") as url:
        panel = model_panel(url)
        # (prompt, negative_prompt, seed, randomize_seed, num_inference_steps, guidance_scale, num_images), model
        client = Client(url, verbose=False)
        request = ("a large red circle at the center", "", 3, False, 3, 2.0, 1)
        gallery, seed = client.predict(*request, "shapes", api_name="/generate")
        with pytest.raises(AppError, match="The model must be one of 'emoji', 'shapes', got 'other'"):
            client.predict(*request, "other", api_name="/generate")
    # It opens on the shipped emoji model, with the shapes model beside it.
    assert "### Model: lmlp-emoji\nships with diffusers-lmlp: `pretrained_emoji_pipeline()`" in panel
    assert seed == 3 and len(gallery) == 1
    assert Image.open(gallery[0]["image"]).size == (32, 32) and image_std(Image.open(gallery[0]["image"])) > 8
    log = (tmp_path / "server.log").read_text()
    assert "Serving on the CPU with 1 thread(s) (LMLP_NUM_THREADS; set LMLP_NUM_THREADS to change).\n" in log
    assert "Serving emoji.\n" in log and "Serving shapes.\n" in log
    assert "Sampling eagerly (LMLP_FREEZE=0).\n" in log
    # A local run leaves nothing in the folder that git would pick up (or push-space upload: it skips hidden files).
    assert untracked_files(SPACE_FOLDER) == before
