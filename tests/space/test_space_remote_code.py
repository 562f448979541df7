"""The Space as the Hub runs it: the staged demo, in a subprocess without diffusers-lmlp, serving the shapes model
pushed with `--with-code` (`owner/lmlp-shapes`) offline from a Hub cache, driven with gradio_client."""

import dataclasses
import json
import re
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
from space_server import app_process, image_std, load_app, model_panel, one_cpu_thread, shapes_pipeline
from without_package import environment_without_package, fill_cache

from diffusers_lmlp import FAMILIES
from diffusers_lmlp.hub import stage_pipeline, stage_space
from diffusers_lmlp.hub.remote_code import bundle_source, defining_module_of, family_part
from diffusers_lmlp.pipelines.vocabulary import describe_vocabulary
from diffusers_lmlp.shapes import pretrained_shapes_pipeline
from diffusers_lmlp.shapes.pretrained import PIPELINE_PATH
from diffusers_lmlp.tiny import build_tiny_pipeline


WITH_CODE = "owner/lmlp-shapes"
WITHOUT_CODE = "owner/lmlp-shapes-plain"
PROMPT = "a large red circle at the center"
STEPS = 3
TIMEOUT_S = 240  # for the app to start, and for any one request
# Imports of the package the served app may attempt: its own check whether the package is installed, nothing else.
APP_PROBE = ["diffusers_lmlp"]
# Runs `app.main()` of the staged Space for each LMLP_MODEL given (empty: unset) and prints how each exit read.
MAIN = """
import json, os, sys
sys.path.insert(0, os.getcwd())
import app

exits = []
for model in sys.argv[1:]:
    os.environ["LMLP_MODEL"] = model
    try:
        app.main()
    except SystemExit as exit:
        exits.append(str(exit.code))
print(json.dumps(exits))
"""


def request_args(prompt: str = PROMPT, seed: int = 0, steps: int = STEPS, num_images: int = 2) -> tuple:
    # (prompt, negative_prompt, seed, randomize_seed, num_inference_steps, guidance_scale, num_images)
    return (prompt, "", seed, False, steps, 2.0, num_images)


@pytest.fixture(scope="module")
def space(tmp_path_factory) -> SimpleNamespace:
    """The staged Space, and a Hub cache with the shapes model pushed with its code and without it."""
    root = tmp_path_factory.mktemp("remote-space")
    env = environment_without_package(root)
    with_code = stage_pipeline(PIPELINE_PATH, WITH_CODE, root / "with-code", with_code=True)
    assert "pipeline_lmlp.py" in with_code.files and "transformer/lmlp_transformer_2d.py" in with_code.files
    fill_cache(with_code.folder, root / "cache", WITH_CODE)
    fill_cache(stage_pipeline(PIPELINE_PATH, WITHOUT_CODE, root / "plain").folder, root / "cache", WITHOUT_CODE)
    staged = stage_space(WITH_CODE, output_dir=root / "space")
    assert staged.files == ["README.md", "app.py", "requirements.txt"]
    return SimpleNamespace(root=root, env=env, folder=staged.folder, imports=root / "imports.log")


@pytest.fixture(scope="module")
def served(space) -> SimpleNamespace:
    """`python app.py` in the staged Space, without the package, on one CPU thread; its URL, a client and its log."""
    env = {**space.env, "LMLP_MODEL": WITH_CODE, "LMLP_NUM_THREADS": "1"}
    log = space.root / "server.log"
    with app_process(space.folder, env, log, timeout=TIMEOUT_S) as url:
        yield SimpleNamespace(url=url, client=Client(url, verbose=False), log=log)


@pytest.fixture(scope="module")
def shapes_pipe():
    with one_cpu_thread():
        yield shapes_pipeline()


@pytest.mark.slow
def test_space_without_the_package_serves_the_model_from_its_code(served, space, shapes_pipe):
    gallery, seed = served.client.predict(*request_args(seed=5), api_name="/generate")

    assert seed == 5 and len(gallery) == 2
    images = [Image.open(item["image"]).convert("RGB") for item in gallery]
    assert all(image.size == (32, 32) and image_std(image) > 8 for image in images)
    panel = model_panel(served.url)
    assert "### Model: lmlp-shapes\n`owner/lmlp-shapes`" in panel  # the card's title, read from the cached repo
    assert "**Backbone:** UL-MLP (`LMLPTransformer2DModel`), 866,626 parameters" in panel
    assert f"**Vocabulary:** closed: use only its {describe_vocabulary(shapes_pipe.tokenizer)}\n" in panel
    assert "**Training data:** 10400 steps on the procedural shapes world" in panel
    # The package never loaded: the app asked once whether it is installed, and diffusers never asked.
    assert space.imports.read_text().split() == APP_PROBE
    # Without the package, the app applies the thread rule itself: the count given wins.
    log = served.log.read_text()
    assert "Serving on the CPU with 1 thread(s) (LMLP_NUM_THREADS; set LMLP_NUM_THREADS to change).\n" in log
    # The model's own code freezes the transformer too, and passes the frozen graph on to each request's pipeline.
    assert re.search(r"^Sampling with the transformer frozen by inductor, compiled in \d+\.\d s", log, re.M), log
    # The images the app makes with the package, in the served app's dtype, frozen, on as many threads.
    dtype = getattr(torch, panel.rsplit("**Running on:** cpu, ", 1)[1].strip())
    pipe = pretrained_shapes_pipeline(dtype=dtype)
    with one_cpu_thread():
        load_app().serve_frozen(pipe)
        expected, _ = load_app().make_generate_fn(pipe)(*request_args(seed=5))
    assert [np.asarray(image).tolist() for image in images] == [np.asarray(image).tolist() for image in expected]


@pytest.mark.slow
def test_space_without_the_package_refuses_bad_input_as_with_it(served, shapes_pipe):
    app = load_app()
    messages = []
    for args in (request_args("a dog on a beach"), request_args(steps=500), request_args(num_images=9)):
        with pytest.raises(gr.Error) as in_package:
            app.validate_inputs(*args, pipe=shapes_pipe)
        with pytest.raises(AppError) as served_error:
            served.client.predict(*args, api_name="/generate")
        assert str(served_error.value) == in_package.value.message
        messages.append(in_package.value.message)
    assert "mostly words this model does not know (3 of its 5 words: 'dog', 'on', 'beach')" in messages[0]
    assert messages[0].endswith(f"This model knows only {describe_vocabulary(shapes_pipe.tokenizer)}.")


@pytest.mark.slow
def test_space_without_the_package_refuses_a_repo_without_code_and_a_missing_model_with_the_fix(space):
    log = space.imports.read_text() if space.imports.exists() else ""
    env = {key: value for key, value in space.env.items() if key != "LMLP_MODEL"}
    command = [sys.executable, "-c", MAIN, WITHOUT_CODE, ""]
    result = subprocess.run(command, cwd=space.folder, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)

    assert result.returncode == 0, result.stderr[-3000:]
    no_code, no_model = json.loads(result.stdout.strip().splitlines()[-1])
    assert no_code == (
        f"error: {WITHOUT_CODE} has no code to load it without diffusers-lmlp, which is not installed here (its "
        "model_index.json names the package: _class_name, transformer). Push the model with its code: "
        f"`python -m diffusers_lmlp.hub push FOLDER {WITHOUT_CODE} --with-code`, FOLDER being the saved pipeline."
    )
    assert no_model.startswith("error: LMLP_MODEL is not set. Without diffusers-lmlp installed, the app serves")
    assert "`python -m diffusers_lmlp.hub push FOLDER REPO --with-code`" in no_model
    # Nothing tried to import the package but the app's own check whether it is installed.
    assert space.imports.read_text().removeprefix(log).split() == APP_PROBE
    assert "Traceback" not in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("backbone", sorted(FAMILIES))
def test_generated_backbone_code_names_its_family_as_the_registry_does(backbone, monkeypatch):
    family = FAMILIES[backbone]
    name = family.model_class.__name__
    namespace = {}
    exec(compile(bundle_source(defining_module_of(name), name), f"{name}.py", "exec"), namespace)
    remote_class = namespace[name]
    config = build_tiny_pipeline(backbone, seed=0).transformer.config
    backbone_model = remote_class.from_config(config)

    assert remote_class is not family.model_class
    assert (remote_class.family_label, remote_class.family_details(config)) == (family.label, family.details(config))
    monkeypatch.setattr(load_app(), "family_of", None)  # the app as the Space runs it: no registry to ask
    label, details = load_app().backbone_family(backbone_model)
    assert (label, details(config)) == (family.label, family.details(config))


def test_a_family_whose_details_the_code_cannot_carry_is_refused(monkeypatch):
    monkeypatch.setitem(FAMILIES, "moe_mlp", dataclasses.replace(FAMILIES["moe_mlp"], details=lambda config: ""))
    with pytest.raises(
        ValueError, match=r"The moe_mlp family's details, '<lambda>', is not a function defined at the "
    ):
        family_part("MoEMLPModel")
    assert family_part("LMLPPipeline") is None  # not a backbone: no family to carry
