"""The Space's `app.py` in-process, with the package installed: inputs, settings, the model panel, generation."""

import ast
import os
import re
from pathlib import Path

import gradio as gr
import numpy as np
import pytest
import torch
from PIL import Image
from space_server import emoji_pipeline, image_std, load_app, one_cpu_thread, serve, shapes_pipeline

from diffusers_lmlp import FAMILIES
from diffusers_lmlp.hub import stage_pipeline
from diffusers_lmlp.hub.space import DEFAULT_SPACE_DIR
from diffusers_lmlp.pipelines.vocabulary import describe_vocabulary
from diffusers_lmlp.shapes.pretrained import PIPELINE_PATH
from diffusers_lmlp.tiny import build_tiny_pipeline


app = load_app()

PROMPT = "a large red circle at the center"
VALID = dict(prompt=PROMPT, negative_prompt="", seed=7, randomize_seed=False, num_inference_steps=4,
             guidance_scale=2.0, num_images=2)  # fmt: skip


def test_validate_inputs_normalises_valid_values(shapes_pipe):
    request = app.validate_inputs(
        **{**VALID, "prompt": f"  {PROMPT} ", "seed": 3.0, "num_inference_steps": 5.0, "guidance_scale": 1},
        pipe=shapes_pipe,
    )
    assert request == app.GenerationRequest(PROMPT, "", 3, False, 5, 1.0, 2)
    assert isinstance(request.seed, int) and isinstance(request.num_inference_steps, int)
    assert app.validate_inputs(**{**VALID, "negative_prompt": None}).negative_prompt == ""
    edges = dict(seed=app.MAX_SEED, num_inference_steps=app.MAX_STEPS, guidance_scale=0, num_images=app.MAX_IMAGES)
    assert app.validate_inputs(**{**VALID, **edges}).seed == 2**31 - 1


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(prompt=""), r"prompt is empty.*1 to 400 characters"),
        (dict(prompt="   "), r"prompt is empty"),
        (dict(prompt=None), r"prompt must be text, got NoneType"),
        (dict(prompt="a" * 401), r"prompt has 401 characters; at most 400"),
        (dict(negative_prompt="b" * 401), r"negative prompt has 401 characters; at most 400"),
        (dict(negative_prompt=3), r"negative prompt must be text"),
        (dict(seed=-1), r"seed must be a whole number from 0 to 2147483647, got -1"),
        (dict(seed=2**31), r"seed must be a whole number from 0 to 2147483647"),
        (dict(seed=2.5), r"seed must be a whole number .* got 2\.5"),
        (dict(seed="7"), r"seed must be a whole number .* got '7'"),
        (dict(seed=True), r"seed must be a whole number"),
        (dict(randomize_seed="yes"), r"'Randomize seed' must be true or false"),
        (dict(num_inference_steps=0), r"number of steps must be a whole number from 1 to 100, got 0"),
        (dict(num_inference_steps=101), r"number of steps must be a whole number from 1 to 100, got 101"),
        (dict(num_inference_steps=None), r"number of steps must be a whole number from 1 to 100, got None"),
        (dict(guidance_scale=-0.5), r"guidance scale must be a number from 0 to 10, got -0\.5"),
        (dict(guidance_scale=10.5), r"guidance scale must be a number from 0 to 10"),
        (dict(guidance_scale=float("nan")), r"guidance scale must be a number from 0 to 10, got nan"),
        (dict(guidance_scale="2"), r"guidance scale must be a number"),
        (dict(num_images=0), r"number of images must be a whole number from 1 to 4, got 0"),
        (dict(num_images=5), r"number of images must be a whole number from 1 to 4, got 5"),
    ],
)
def test_validate_inputs_refuses_bad_values_with_a_clear_message(bad, message):
    with pytest.raises(gr.Error, match=message) as error:
        app.validate_inputs(**{**VALID, **bad})
    assert error.value.title == "Invalid input" and not error.value.print_exception


def test_validate_inputs_refuses_prompts_longer_than_the_tokenizer_takes(shapes_pipe):
    tokenizer = shapes_pipe.tokenizer  # 10 tokens, start and end included
    long_prompt = f"{PROMPT} and {PROMPT}"  # 69 characters, 19 tokens
    assert len(tokenizer(long_prompt).input_ids) == 19
    with pytest.raises(gr.Error, match=r"prompt is 19 tokens long .* at most 10; shorten it"):
        app.validate_inputs(**{**VALID, "prompt": long_prompt}, pipe=shapes_pipe)
    with pytest.raises(gr.Error, match=r"negative prompt is 19 tokens long"):
        app.validate_inputs(**{**VALID, "negative_prompt": long_prompt}, pipe=shapes_pipe)
    app.validate_inputs(**VALID, pipe=shapes_pipe)


def test_validate_inputs_refuses_prompts_of_mostly_unknown_words_with_the_known_ones(shapes_pipe):
    known = describe_vocabulary(shapes_pipe.tokenizer)
    assert "circle, cyan, green" in known and known.endswith("and any single letter or digit")
    with pytest.raises(gr.Error) as error:
        app.validate_inputs(**{**VALID, "prompt": "A dog on a beach!"}, pipe=shapes_pipe)
    assert error.value.message == (
        "The prompt is mostly words this model does not know (3 of its 5 words: 'dog', 'on', 'beach'), so it would "
        f"generate noise. This model knows only {known}."
    )
    with pytest.raises(gr.Error, match=r"negative prompt is mostly words .* \(1 of its 1 words: 'blurry'\)"):
        app.validate_inputs(**{**VALID, "negative_prompt": "blurry"}, pipe=shapes_pipe)


def test_validate_inputs_flags_prompts_with_some_unknown_words(shapes_pipe):
    flag = (
        "The prompt has words this model does not know: 'xyz'. They do not steer the images; the model panel lists "
        "the words it knows."
    )
    request = app.validate_inputs(**{**VALID, "prompt": "a red circle xyz"}, pipe=shapes_pipe)  # 8 tokens
    assert request.prompt == "a red circle xyz" and request.warnings == (flag,)
    assert app.validate_inputs(**VALID, pipe=shapes_pipe).warnings == ()
    assert app.validate_inputs(**{**VALID, "prompt": "a dog on a beach"}).warnings == ()  # no pipeline: no check
    # An unknown word is spelled byte by byte, which is what makes this prompt too long: the message says so.
    with pytest.raises(gr.Error) as error:
        app.validate_inputs(**{**VALID, "prompt": f"{PROMPT} xyz"}, pipe=shapes_pipe)
    assert error.value.message.endswith(f"at most 10; shorten it so that nothing is cut off. {flag}")


def test_the_app_takes_bf16_on_the_cpu_only_where_the_trainer_finds_it_native(monkeypatch):
    from diffusers_lmlp.cpu import this_cpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    native = this_cpu().native_bf16 is not None
    assert app.pick_device_and_dtype() == ("cpu", torch.bfloat16 if native else torch.float32)


@pytest.mark.parametrize(
    "environ, expected",
    [
        ({}, (32, 1, True)),
        ({"LMLP_QUEUE_SIZE": "2", "LMLP_CONCURRENCY": "3", "LMLP_FREEZE": "1"}, (2, 3, True)),
        ({"LMLP_FREEZE": " 0 "}, (32, 1, False)),
    ],
)
def test_queue_and_freeze_settings_read_the_environment(environ, expected):
    queue_size, concurrency, _, _, freeze = app.read_settings(environ)
    assert (queue_size, concurrency, freeze) == expected


@pytest.fixture
def fresh_process(monkeypatch):
    """A process nobody configured, on 8 cores: no thread or app variables, torch's thread count restored after."""
    for name in ("OMP_NUM_THREADS", app.THREADS_VARIABLE, "LMLP_CONCURRENCY", "LMLP_QUEUE_SIZE", "LMLP_MODEL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("LMLP_FREEZE", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    num_threads = torch.get_num_threads()
    yield monkeypatch
    torch.set_num_threads(num_threads)


@pytest.mark.parametrize(
    "environ, concurrency, expected",
    [
        ({"LMLP_NUM_THREADS": "3", "OMP_NUM_THREADS": "1"}, 4, (3, "LMLP_NUM_THREADS")),
        ({"OMP_NUM_THREADS": "2"}, 1, (2, "OMP_NUM_THREADS")),
        ({}, 1, (8, "every core")),
        ({}, 3, (2, "2 of 8 cores")),  # requests that run side by side share the cores
        ({}, 16, (1, "1 of 8 cores")),
    ],
)
def test_cpu_threads_are_given_else_the_user_s_else_a_share_of_the_cores(
    fresh_process, environ, concurrency, expected
):
    for name, value in environ.items():
        fresh_process.setenv(name, value)
    fresh_process.setenv("LMLP_CONCURRENCY", str(concurrency))
    assert app.read_settings()[2:4] == expected


BAD_SETTINGS = [("LMLP_QUEUE_SIZE", v, "a whole number of at least 1") for v in ("0", "-1")]
BAD_SETTINGS += [("LMLP_CONCURRENCY", "two", "a whole number of at least 1")]
BAD_SETTINGS += [("LMLP_NUM_THREADS", v, "a whole number of at least 1") for v in ("0", "-1", "two", "1.5", "")]
BAD_SETTINGS += [("LMLP_FREEZE", v, "1 (freeze the transformer) or 0 (sample eagerly)") for v in ("yes", "2", "")]


@pytest.mark.parametrize("name, value, rule", BAD_SETTINGS)
def test_a_bad_setting_stops_the_app_naming_it_before_it_picks_a_device(fresh_process, name, value, rule):
    fresh_process.setenv(name, value)
    fresh_process.setattr(app, "pick_device_and_dtype", lambda: pytest.fail("went on to pick the device"))
    with pytest.raises(SystemExit) as exit_info:
        app.main()
    assert exit_info.value.code == f"error: {name} must be {rule}, got {value!r}."


def test_the_app_serves_on_the_threads_it_chose_and_says_why(fresh_process, capsys):
    fresh_process.setenv("LMLP_NUM_THREADS", "3")
    fresh_process.setattr(app, "pick_device_and_dtype", lambda: ("cpu", torch.float32))

    def stop(model, dtype):
        raise app.CannotServe("stopped before loading")

    fresh_process.setattr(app, "load_pipeline", stop)
    with pytest.raises(SystemExit, match="error: stopped before loading"):
        app.main()
    assert torch.get_num_threads() == 3
    assert "Serving on the CPU with 3 thread(s) (LMLP_NUM_THREADS; set LMLP_NUM_THREADS to change).\n" in (
        capsys.readouterr().out
    )


@pytest.mark.slow
def test_the_app_samples_with_the_transformer_frozen_and_compiled_before_the_first_request(frozen_app):
    line = r"^Sampling with the transformer frozen by inductor, compiled in \d+\.\d s\.$"
    assert re.search(line, frozen_app.output, re.M) and frozen_app.pipe.inductor_freezing_enabled
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    # Requests whose batches are 1 (one image, no guidance), 2, 3 and 8 latents.
    requests = [{**VALID, "num_inference_steps": 2, "num_images": n, "guidance_scale": g} for n, g in
                [(1, 1.0), (1, 2.0), (3, 0.0), (4, 2.0)]]  # fmt: skip
    with one_cpu_thread():
        frozen = [app.make_generate_fn(frozen_app.pipe)(*request.values())[0] for request in requests]
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs, "a request compiled a graph"
        generate = app.make_generate_fn(shapes_pipeline())
        eager = [generate(*request.values())[0] for request in requests]
    for frozen_images, eager_images in zip(frozen, eager, strict=True):
        for image, expected in zip(frozen_images, eager_images, strict=True):
            assert np.abs(np.asarray(image).astype(int) - np.asarray(expected)).max() <= 1  # fused GEMMs round


def test_lmlp_freeze_0_serves_the_transformer_as_it_is(fresh_process, capsys):
    pipe = shapes_pipeline()
    for name, value in {"LMLP_NUM_THREADS": "1", "LMLP_FREEZE": "0", "LMLP_MODEL": "shapes"}.items():
        fresh_process.setenv(name, value)
    fresh_process.setattr(app, "load_pipeline", lambda model, dtype: pipe)
    fresh_process.setattr(app, "launch", lambda demo: None)
    app.main()
    assert "Sampling eagerly (LMLP_FREEZE=0).\n" in capsys.readouterr().out
    assert not pipe.inductor_freezing_enabled


def test_model_panel_describes_the_shipped_model(shapes_pipe):
    text = app.describe_model(shapes_pipe, shapes_pipe.name_or_path)
    num_params = sum(p.numel() for p in shapes_pipe.transformer.parameters())
    assert num_params == 866_626  # the model card's figure
    assert f"{num_params:,} parameters" in text
    assert "Model: lmlp-shapes" in text and "pretrained_shapes_pipeline()" in text
    assert "UL-MLP (`LMLPTransformer2DModel`)" in text and "MoE-MLP" not in text
    assert "32×32 px (8×8 latents × VAE factor 4)" in text
    assert "up to 10 tokens" in text
    assert f"**Vocabulary:** closed: use only its {describe_vocabulary(shapes_pipe.tokenizer)}\n" in text
    assert "**Training data:** 10400 steps on the procedural shapes world" in text
    assert "cpu, float32" in text


@pytest.mark.parametrize("backbone", sorted(FAMILIES))
def test_model_panel_names_every_family_and_reads_training_data_from_the_card(backbone, tmp_path):
    family, pipe = FAMILIES[backbone], build_tiny_pipeline(backbone, seed=0)
    pipe.save_pretrained(tmp_path)
    text = app.describe_model(pipe, str(tmp_path))
    num_params = sum(p.numel() for p in pipe.transformer.parameters())
    assert f"**Backbone:** {family.label} (`{family.model_class.__name__}`), {num_params:,} parameters" in text
    assert not [other.label for other in FAMILIES.values() if f"{other.label} (`" in text and other is not family]
    assert ("experts" in text) is (backbone == "moe_mlp")
    assert f"Model: {tmp_path.name}" in text and "16×16 px" in text
    assert "**Training data:** not recorded (no model card found)" in text

    (tmp_path / "README.md").write_text("---\ndatasets:\n- someone/captions\n---\n\n# tiny\n", encoding="utf-8")
    text = app.describe_model(pipe, str(tmp_path))
    assert "Model: tiny" in text and "**Training data:** `someone/captions`" in text


def test_generate_makes_native_size_images_reproducibly_and_returns_the_seed_it_used(shapes_pipe):
    generate = app.make_generate_fn(shapes_pipe)
    images, seed = generate(*VALID.values())
    assert seed == VALID["seed"] and len(images) == VALID["num_images"]
    assert all(image.size == (32, 32) and image.mode == "RGB" and image_std(image) > 8 for image in images)
    other, _ = generate(*{**VALID, "seed": 8}.values())
    assert not np.array_equal(np.asarray(images[0]), np.asarray(other[0]))
    randomized, seed = generate(*{**VALID, "randomize_seed": True}.values())
    assert 0 <= seed <= app.MAX_SEED
    replay, _ = generate(*{**VALID, "seed": seed}.values())
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(randomized, replay, strict=True))


def test_generate_refuses_bad_input_before_sampling(shapes_pipe, monkeypatch):
    monkeypatch.setattr(type(shapes_pipe), "__call__", lambda *args, **kwargs: pytest.fail("sampled"))
    with pytest.raises(gr.Error, match="number of images must be a whole number from 1 to 4, got 9"):
        app.make_generate_fn(shapes_pipe)(*{**VALID, "num_images": 9}.values())
    with pytest.raises(gr.Error, match="prompt is mostly words this model does not know"):
        app.make_generate_fn(shapes_pipe)(*{**VALID, "prompt": "a dog on a beach"}.values())


def test_generate_shows_the_warning_for_unknown_words(shapes_pipe):
    # Outside a request, gradio turns `gr.Warning` into a Python warning; in the UI it is a toast.
    with pytest.warns(UserWarning, match="The prompt has words this model does not know: 'xyz'"):
        images, _ = app.make_generate_fn(shapes_pipe)(
            *{**VALID, "prompt": "a red circle xyz", "num_images": 1}.values()
        )
    assert len(images) == 1


def test_pipeline_vocabulary_methods_are_the_tokenizer_s(shapes_pipe):
    text = "A dog, a RED circle!"
    assert shapes_pipe.describe_vocabulary() == describe_vocabulary(shapes_pipe.tokenizer)
    assert shapes_pipe.prompt_words(text) == ["a", "dog", "a", "red", "circle"]
    assert shapes_pipe.unknown_words(text) == ["dog"]


@pytest.mark.slow
def test_with_the_package_the_app_loads_a_with_code_folder_and_runs_none_of_its_code(tmp_path):
    build_tiny_pipeline("lmlp", seed=0).save_pretrained(tmp_path / "saved")
    staged = stage_pipeline(tmp_path / "saved", "owner/tiny-lmlp", tmp_path / "code", with_code=True).folder
    for path in staged.rglob("*.py"):  # canaries: any run of the repo's code fails loudly
        path.write_text(f"raise RuntimeError('{path.name} ran')\n" + path.read_text())

    pipe = app.load_pipeline(str(staged), torch.float32)

    assert type(pipe) is app.LMLPPipeline and type(pipe.transformer) is FAMILIES["lmlp"].model_class
    assert Path(app.load_pipeline("shapes", torch.float32).name_or_path).samefile(PIPELINE_PATH)


def test_space_requirements_are_setup_py_s_without_the_package_or_gradio():
    tree = ast.parse((Path(__file__).resolve().parents[2] / "setup.py").read_text(encoding="utf-8"))
    (install_requires,) = [
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["install_requires"]
    ]
    floors = dict(re.fullmatch(r"([\w.-]+)(.*)", requirement).groups() for requirement in install_requires)
    lines = (DEFAULT_SPACE_DIR / "requirements.txt").read_text(encoding="utf-8").splitlines()
    listed = dict(re.fullmatch(r"([\w.-]+)(.*)", line).groups() for line in lines if line and not line.startswith("#"))

    # What the app and the model repo's code import, at the floors setup.py tests.
    assert {"torch", "diffusers", "transformers", "accelerate", "safetensors", "huggingface_hub"} <= set(listed)
    assert {name: listed[name] for name in set(listed) & set(floors)} == {
        name: floors[name] for name in set(listed) & set(floors)
    }
    # diffusers-lmlp is not on PyPI (push-space vendors its source); the README's sdk_version installs gradio.
    assert not {name for name in listed if name.replace("_", "-") in ("diffusers-lmlp", "gradio")}


def test_the_app_serves_lmlp_models_in_order_else_the_shipped_emoji_then_shapes():
    assert app.served_models({}) == ["emoji", "shapes"]
    assert app.served_models({"LMLP_MODEL": " alice/emoji , ./shapes ,"}) == ["alice/emoji", "./shapes"]


@pytest.mark.slow
def test_the_model_choice_opens_on_emoji_and_samples_the_chosen_model(shapes_pipe):
    from gradio_client import Client

    with one_cpu_thread():
        emoji_pipe = emoji_pipeline()
        demo = app.build_demo({"emoji": emoji_pipe, "shapes": shapes_pipe}, queue_size=4)
        [choice] = [c for c in demo.config["components"] if c["props"].get("elem_id") == "model"]
        assert choice["props"]["value"] == "emoji" and choice["props"]["visible"]
        [panel] = [c for c in demo.config["components"] if c["props"].get("elem_id") == "model-info"]
        assert "emoji world" in panel["props"]["value"]
        request = [*VALID.values()][:-1] + [1]  # one image
        emoji_request = ["red apple", *request[1:]]
        with serve(demo) as url:
            client = Client(url, verbose=False)
            default, _ = client.predict(*emoji_request, api_name="/generate")  # the first model when left out
            shapes, _ = client.predict(*request, "shapes", api_name="/generate")
            with pytest.raises(Exception, match="The model must be one of 'emoji', 'shapes'"):
                client.predict(*request, "other", api_name="/generate")
        expected_emoji = app.make_generate_fn(emoji_pipe)(*emoji_request)[0][0]
        expected_shapes = app.make_generate_fn(shapes_pipe)(*request)[0][0]
    for gallery, expected in ((default, expected_emoji), (shapes, expected_shapes)):
        image = np.asarray(Image.open(gallery[0]["image"]).convert("RGB"))
        assert np.array_equal(image, np.asarray(expected))
    assert app.examples_for(app.describe_model(emoji_pipe, app.SHIPPED["emoji"])) == app.EXAMPLES["emoji world"]
