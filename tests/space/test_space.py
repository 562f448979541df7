"""The Space's `app.py` in-process, with the package installed: inputs, settings, the model panel, generation."""

import os
import re

import gradio as gr
import numpy as np
import pytest
import torch
from benchmark_scripts import load_benchmark
from documents import ROOT
from space_server import image_std, load_app, one_cpu_thread, shapes_pipeline

from diffusers_lmlp import FAMILIES
from diffusers_lmlp.cpu import this_cpu
from diffusers_lmlp.hub.space import DEFAULT_SPACE_DIR
from diffusers_lmlp.pipelines.vocabulary import describe_vocabulary
from diffusers_lmlp.tiny import build_tiny_pipeline


app = load_app()

PROMPT = "a large red circle at the center"
VALID = dict(prompt=PROMPT, negative_prompt="", seed=7, randomize_seed=False, num_inference_steps=4,
             guidance_scale=2.0, num_images=2)  # fmt: skip


def test_validate_inputs_normalises_valid_values(shapes_pipe):
    values = {**VALID, "prompt": f"  {PROMPT} ", "seed": 3.0, "num_inference_steps": 5.0, "guidance_scale": 1}
    request = app.validate_inputs(**values, pipe=shapes_pipe)
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
        (dict(prompt=f"{PROMPT} and {PROMPT}"), r"prompt is 19 tokens long .* at most 10; shorten it"),
        (dict(negative_prompt=f"{PROMPT} and {PROMPT}"), r"negative prompt is 19 tokens long"),
        (dict(negative_prompt="blurry"), r"negative prompt is mostly words .* \(1 of its 1 words: 'blurry'\)"),
    ],
)
def test_validate_inputs_refuses_bad_values_with_a_clear_message(shapes_pipe, bad, message):
    with pytest.raises(gr.Error, match=message) as error:
        app.validate_inputs(**{**VALID, **bad}, pipe=shapes_pipe)
    assert error.value.title == "Invalid input" and not error.value.print_exception


def test_validate_inputs_refuses_prompts_of_mostly_unknown_words_and_flags_some(shapes_pipe):
    known = describe_vocabulary(shapes_pipe.tokenizer)
    assert "circle, cyan, green" in known and known.endswith("and any single letter or digit")
    with pytest.raises(gr.Error) as error:
        app.validate_inputs(**{**VALID, "prompt": "A dog on a beach!"}, pipe=shapes_pipe)
    assert error.value.message == (
        "The prompt is mostly words this model does not know (3 of its 5 words: 'dog', 'on', 'beach'), so it would "
        f"generate noise. This model knows only {known}."
    )
    # Some unknown words are flagged, not refused.
    flag = "The prompt has words this model does not know: 'xyz'. They do not steer the images; the model panel lists"
    request = app.validate_inputs(**{**VALID, "prompt": "a red circle xyz"}, pipe=shapes_pipe)  # 8 tokens
    assert request.prompt == "a red circle xyz" and request.warnings == (f"{flag} the words it knows.",)
    assert app.validate_inputs(**VALID, pipe=shapes_pipe).warnings == ()
    assert app.validate_inputs(**{**VALID, "prompt": "a dog on a beach"}).warnings == ()  # no pipeline: no check
    # An unknown word is spelled byte by byte, which is what makes this prompt too long: the message says so.
    with pytest.raises(gr.Error) as error:
        app.validate_inputs(**{**VALID, "prompt": f"{PROMPT} xyz"}, pipe=shapes_pipe)
    assert error.value.message.endswith(
        f"at most 10; shorten it so that nothing is cut off. {flag} the words it knows."
    )


def test_the_app_takes_bf16_on_the_cpu_only_where_the_trainer_finds_it_native(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    native = this_cpu().native_bf16 is not None
    assert app.pick_device_and_dtype() == ("cpu", torch.bfloat16 if native else torch.float32)


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


# The queue size, concurrency, CPU threads (given, else the user's, else a share of the cores) and freezing.
SETTINGS = [
    ({}, (32, 1, 8, "every core", True)),
    ({"LMLP_QUEUE_SIZE": "2", "LMLP_CONCURRENCY": "3", "LMLP_FREEZE": "1"}, (2, 3, 2, "2 of 8 cores", True)),
    ({"LMLP_FREEZE": " 0 "}, (32, 1, 8, "every core", False)),
    ({"LMLP_NUM_THREADS": "3", "OMP_NUM_THREADS": "1", "LMLP_CONCURRENCY": "4"}, (32, 4, 3, "LMLP_NUM_THREADS", True)),
    ({"OMP_NUM_THREADS": "2"}, (32, 1, 2, "OMP_NUM_THREADS", True)),
    ({"LMLP_CONCURRENCY": "16"}, (32, 16, 1, "1 of 8 cores", True)),  # requests that run side by side share the cores
]


@pytest.mark.parametrize("environ, expected", SETTINGS)
def test_settings_read_the_environment(fresh_process, environ, expected):
    for name, value in environ.items():
        fresh_process.setenv(name, value)
    assert app.read_settings() == expected


WHOLE, FREEZE = "a whole number of at least 1", "1 (freeze the transformer) or 0 (sample eagerly)"
BAD_SETTINGS = [("LMLP_QUEUE_SIZE", "0", WHOLE), ("LMLP_QUEUE_SIZE", "-1", WHOLE), ("LMLP_CONCURRENCY", "two", WHOLE)]
BAD_SETTINGS += [("LMLP_NUM_THREADS", v, WHOLE) for v in ("0", "-1", "two", "1.5", "")]
BAD_SETTINGS += [("LMLP_FREEZE", v, FREEZE) for v in ("yes", "2", "")]


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
    stop = app.CannotServe("stopped before loading")
    fresh_process.setattr(app, "load_pipeline", lambda model, dtype: (_ for _ in ()).throw(stop))
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


def test_model_panel_describes_the_shipped_model(shapes_pipe):
    text = app.describe_model(shapes_pipe, shapes_pipe.name_or_path)
    num_params = sum(p.numel() for p in shapes_pipe.transformer.parameters())
    assert num_params == 866_626 and f"{num_params:,} parameters" in text  # the model card's figure
    assert "Model: lmlp-shapes" in text and "pretrained_shapes_pipeline()" in text
    assert "UL-MLP (`LMLPTransformer2DModel`)" in text and "MoE-MLP" not in text
    assert "32×32 px (8×8 latents × VAE factor 4)" in text and "up to 10 tokens" in text
    assert f"**Vocabulary:** closed: use only its {describe_vocabulary(shapes_pipe.tokenizer)}\n" in text
    assert "**Training data:** 10400 steps on the procedural shapes world" in text and "cpu, float32" in text
    # The pipeline's vocabulary methods, which the panel and the checks use, are its tokenizer's.
    assert shapes_pipe.describe_vocabulary() == describe_vocabulary(shapes_pipe.tokenizer)
    assert shapes_pipe.prompt_words("A dog, a RED circle!") == ["a", "dog", "a", "red", "circle"]
    assert shapes_pipe.unknown_words("A dog, a RED circle!") == ["dog"]


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


def test_generate_is_reproducible_returns_its_seed_warns_of_unknown_words_and_checks_first(shapes_pipe, monkeypatch):
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
    # Outside a request, gradio turns `gr.Warning` into a Python warning; in the UI it is a toast.
    with pytest.warns(UserWarning, match="The prompt has words this model does not know: 'xyz'"):
        assert len(app.make_generate_fn(shapes_pipe)(*{**VALID, "prompt": "a red circle xyz"}.values())[0]) == 2
    monkeypatch.setattr(type(shapes_pipe), "__call__", lambda *args, **kwargs: pytest.fail("sampled"))
    with pytest.raises(gr.Error, match="number of images must be a whole number from 1 to 4, got 9"):
        app.make_generate_fn(shapes_pipe)(*{**VALID, "num_images": 9}.values())
    with pytest.raises(gr.Error, match="prompt is mostly words this model does not know"):
        app.make_generate_fn(shapes_pipe)(*{**VALID, "prompt": "a dog on a beach"}.values())


def test_space_requirements_are_setup_py_s_without_the_package_or_gradio():
    setup_py = (ROOT / "setup.py").read_text(encoding="utf-8")
    requirements = (DEFAULT_SPACE_DIR / "requirements.txt").read_text(encoding="utf-8").splitlines()
    floors, listed = (
        dict(re.fullmatch(r"([\w.-]+)(.*)", line).groups() for line in lines if line and not line.startswith("#"))
        for lines in (load_benchmark("lowest_requirements", "scripts").requirement_literals(setup_py)[0], requirements)
    )
    # What the app and the model repo's code import, at the floors setup.py tests.
    assert {"torch", "diffusers", "transformers", "accelerate", "safetensors", "huggingface_hub"} <= set(listed)
    common = set(listed) & set(floors)
    assert {name: listed[name] for name in common} == {name: floors[name] for name in common}
    # diffusers-lmlp is not on PyPI (push-space vendors its source); the README's sdk_version installs gradio.
    assert not {name for name in listed if name.replace("_", "-") in ("diffusers-lmlp", "gradio")}


def test_the_app_serves_lmlp_models_in_order_else_the_shipped_emoji_then_shapes():
    assert app.served_models({}) == ["emoji", "shapes"]
    assert app.served_models({"LMLP_MODEL": " alice/emoji , ./shapes ,"}) == ["alice/emoji", "./shapes"]
