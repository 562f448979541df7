"""The staged Space on its vendored package (never an installed one) serves repos pushed with and without code."""

import subprocess
import sys

import gradio as gr
import numpy as np
import pytest
import torch
from gradio_client import Client
from gradio_client.exceptions import AppError
from PIL import Image
from space_server import app_process, image_std, load_app, model_panel, one_cpu_thread
from without_package import environment_without_package, fill_cache

from diffusers_lmlp.hub import stage_pipeline, stage_space
from diffusers_lmlp.shapes import pretrained_shapes_pipeline
from diffusers_lmlp.shapes.pretrained import PIPELINE_PATH


PLAIN, WITH_CODE = "owner/lmlp-shapes", "owner/lmlp-shapes-code"
TIMEOUT_S = 240  # for the app to start, and for any one request


def request_args(prompt: str = "a large red circle at the center", steps: int = 3, num_images: int = 2) -> tuple:
    return (prompt, "", 5, False, steps, 2.0, num_images)  # (prompt, negative, seed, randomize, steps, g, images)


@pytest.mark.slow
def test_the_vendored_space_serves_repos_with_and_without_code_and_stops_without_lmlp_model(shapes_pipe, tmp_path):
    # The staged Space; a Hub cache of the shapes model pushed without code and with it (its code fails if run).
    staged = stage_space([PLAIN, WITH_CODE], output_dir=tmp_path / "space").folder
    fill_cache(stage_pipeline(PIPELINE_PATH, PLAIN, tmp_path / "plain").folder, tmp_path / "cache", PLAIN)
    with_code = stage_pipeline(PIPELINE_PATH, WITH_CODE, tmp_path / "with-code", with_code=True).folder
    for path in with_code.rglob("*.py"):
        path.write_text(f"raise RuntimeError('{path.name} ran')\n" + path.read_text())
    fill_cache(with_code, tmp_path / "cache", WITH_CODE)
    space_env = {**environment_without_package(tmp_path), "LMLP_VENDORED": str(staged)}
    # `python app.py` in the staged Space on one CPU thread, eagerly (sampling frozen is tested in test_space.py).
    env = {**space_env, "LMLP_MODEL": f"{PLAIN},{WITH_CODE}", "LMLP_NUM_THREADS": "1", "LMLP_FREEZE": "0"}
    with app_process(staged, env, tmp_path / "server.log", timeout=TIMEOUT_S) as url:
        client = Client(url, verbose=False)
        galleries = [client.predict(*request_args(), model, api_name="/generate") for model in (PLAIN, WITH_CODE)]
        panel = model_panel(url)
        for args in (request_args("a dog on a beach"), request_args(steps=500), request_args(num_images=9)):
            with pytest.raises(gr.Error) as in_package:  # bad input is refused as the package does
                load_app().validate_inputs(*args, pipe=shapes_pipe)
            with pytest.raises(AppError) as served_error:
                client.predict(*args, api_name="/generate")
            assert str(served_error.value) == in_package.value.message
    assert f"### Model: lmlp-shapes\n`{PLAIN}`" in panel  # the card's title, read from the cached repo
    assert "**Training data:** 10400 steps on the procedural shapes world" in panel  # read from the cached card
    log = (tmp_path / "server.log").read_text()
    assert log.count("Sampling eagerly (LMLP_FREEZE=0).\n") == 2
    assert "ran')" not in log  # the with-code repo's canaries never ran
    # The images the app makes in-process, in the served app's dtype, on as many threads.
    dtype = getattr(torch, panel.rsplit("**Running on:** cpu, ", 1)[1].strip())
    with one_cpu_thread():
        expected, _ = load_app().make_generate_fn(pretrained_shapes_pipeline(dtype=dtype))(*request_args())
    for gallery, seed in galleries:
        images = [Image.open(item["image"]).convert("RGB") for item in gallery]
        assert seed == 5 and all(image.size == (32, 32) and image_std(image) > 8 for image in images)
        assert [np.asarray(image).tolist() for image in images] == [np.asarray(image).tolist() for image in expected]
    # Without LMLP_MODEL, the vendored copy (which has no shipped models) stops with the fix.
    env = {key: value for key, value in space_env.items() if key != "LMLP_MODEL"}
    main = "import sys; sys.path.insert(0, '.'); import app; app.main()"
    result = subprocess.run(
        [sys.executable, "-c", main], cwd=staged, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == (
        "error: LMLP_MODEL is not set: set it to the model repos to serve, comma-separated (`python -m "
        "diffusers_lmlp.hub push-space` sets it on a Space). The shipped models are not in this copy of "
        "diffusers-lmlp."
    )
    # Every import of the package, in both runs, found the vendored copy: none reached for an installed one.
    assert not (tmp_path / "imports.log").exists() or (tmp_path / "imports.log").read_text() == ""
