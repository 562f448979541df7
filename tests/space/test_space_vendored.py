"""The Space as the Hub runs it: the staged folder on its vendored copy of the package, never an installed one,
serving model repos pushed with and without their code, offline from a Hub cache, driven with gradio_client."""

import json
import subprocess
import sys
from types import SimpleNamespace

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
from diffusers_lmlp.pipelines.vocabulary import describe_vocabulary
from diffusers_lmlp.shapes import pretrained_shapes_pipeline
from diffusers_lmlp.shapes.pretrained import PIPELINE_PATH


PLAIN, WITH_CODE = "owner/lmlp-shapes", "owner/lmlp-shapes-code"
TIMEOUT_S = 240  # for the app to start, and for any one request
# Runs `app.main()` of the staged Space with LMLP_MODEL unset and prints how it exited.
MAIN = """
import json, os, sys
sys.path.insert(0, os.getcwd())
os.environ.pop("LMLP_MODEL", None)
import app

try:
    app.main()
except SystemExit as exit:
    print(json.dumps(str(exit.code)))
"""


def request_args(prompt: str = "a large red circle at the center", steps: int = 3, num_images: int = 2) -> tuple:
    return (prompt, "", 5, False, steps, 2.0, num_images)  # (prompt, negative, seed, randomize, steps, g, images)


@pytest.fixture(scope="module")
def space(tmp_path_factory) -> SimpleNamespace:
    """The staged Space, and a Hub cache with the shapes model pushed without its code and with it (whose code,
    were it run, fails loudly)."""
    root = tmp_path_factory.mktemp("vendored-space")
    staged = stage_space([PLAIN, WITH_CODE], output_dir=root / "space")
    fill_cache(stage_pipeline(PIPELINE_PATH, PLAIN, root / "plain").folder, root / "cache", PLAIN)
    with_code = stage_pipeline(PIPELINE_PATH, WITH_CODE, root / "with-code", with_code=True).folder
    for path in with_code.rglob("*.py"):
        path.write_text(f"raise RuntimeError('{path.name} ran')\n" + path.read_text())
    fill_cache(with_code, root / "cache", WITH_CODE)
    env = {**environment_without_package(root), "LMLP_VENDORED": str(staged.folder)}
    return SimpleNamespace(root=root, env=env, folder=staged.folder, imports=root / "imports.log")


@pytest.fixture(scope="module")
def served(space) -> SimpleNamespace:
    """`python app.py` in the staged Space, on one CPU thread, serving both repos; its URL, a client and its log.
    Eagerly: sampling frozen, compiled before the first request, is tested in test_space.py."""
    env = {**space.env, "LMLP_MODEL": f"{PLAIN},{WITH_CODE}", "LMLP_NUM_THREADS": "1", "LMLP_FREEZE": "0"}
    log = space.root / "server.log"
    with app_process(space.folder, env, log, timeout=TIMEOUT_S) as url:
        yield SimpleNamespace(url=url, client=Client(url, verbose=False), log=log)


@pytest.mark.slow
def test_the_space_serves_repos_with_and_without_code_on_its_vendored_package(served, space, shapes_pipe):
    galleries = {
        model: served.client.predict(*request_args(), model, api_name="/generate") for model in (PLAIN, WITH_CODE)
    }

    panel = model_panel(served.url)
    assert f"### Model: lmlp-shapes\n`{PLAIN}`" in panel  # the card's title, read from the cached repo
    assert "**Backbone:** UL-MLP (`LMLPTransformer2DModel`), 866,626 parameters" in panel
    assert f"**Vocabulary:** closed: use only its {describe_vocabulary(shapes_pipe.tokenizer)}\n" in panel
    assert "**Training data:** 10400 steps on the procedural shapes world" in panel
    # Every import of the package found the vendored copy: none reached for an installed one.
    assert not space.imports.exists() or space.imports.read_text() == ""
    log = served.log.read_text()
    assert "Serving on the CPU with 1 thread(s) (LMLP_NUM_THREADS; set LMLP_NUM_THREADS to change).\n" in log
    assert log.count("Sampling eagerly (LMLP_FREEZE=0).\n") == 2
    assert "ran')" not in log  # the with-code repo's canaries never ran
    # The images the app makes in-process, in the served app's dtype, on as many threads.
    dtype = getattr(torch, panel.rsplit("**Running on:** cpu, ", 1)[1].strip())
    with one_cpu_thread():
        expected, _ = load_app().make_generate_fn(pretrained_shapes_pipeline(dtype=dtype))(*request_args())
    for gallery, seed in galleries.values():
        images = [Image.open(item["image"]).convert("RGB") for item in gallery]
        assert seed == 5 and all(image.size == (32, 32) and image_std(image) > 8 for image in images)
        assert [np.asarray(image).tolist() for image in images] == [np.asarray(image).tolist() for image in expected]


@pytest.mark.slow
def test_the_space_refuses_bad_input_as_the_package_does(served, shapes_pipe):
    for args in (request_args("a dog on a beach"), request_args(steps=500), request_args(num_images=9)):
        with pytest.raises(gr.Error) as in_package:
            load_app().validate_inputs(*args, pipe=shapes_pipe)
        with pytest.raises(AppError) as served_error:
            served.client.predict(*args, api_name="/generate")
        assert str(served_error.value) == in_package.value.message


@pytest.mark.slow
def test_the_space_without_lmlp_model_stops_with_the_fix(space):
    result = subprocess.run(
        [sys.executable, "-c", MAIN],
        cwd=space.folder,
        env=space.env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == (
        "error: LMLP_MODEL is not set: set it to the model repos to serve, comma-separated (`python -m "
        "diffusers_lmlp.hub push-space` sets it on a Space). The shipped models are not in this copy of diffusers-lmlp."
    )
    assert "Traceback" not in result.stderr
    assert not space.imports.exists() or space.imports.read_text() == ""
