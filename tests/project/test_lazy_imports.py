"""Quick start-up: `import diffusers_lmlp`, every command's `--help` and its argument errors load no heavy library
(one fresh interpreter runs them in turn, checking after each), and what the lazy names replace still holds: diffusers
finds `LMLPPipeline` whichever is imported first, and saved folders name ["diffusers_lmlp", "<Class>"]."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import diffusers_lmlp
from diffusers_lmlp import FAMILIES


ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
HEAVY = {"diffusers", "transformers", "accelerate", "datasets", "peft", "gradio"}
COMMANDS = [
    (["diffusers_lmlp.train", "--help"], 0, "usage: python -m diffusers_lmlp.train"),
    (["diffusers_lmlp.train", "--no_such_option"], 2, "unrecognized arguments: --no_such_option"),
    (["diffusers_lmlp.train", "--model_type", "transformer"], 2, "invalid choice: 'transformer'"),
    (["diffusers_lmlp.train", "--learning_rate", "-1"], 2, "--learning_rate: must be a finite number > 0"),
    (["diffusers_lmlp.train", "--model_config", "Z9"], 2, "unknown --model_config 'Z9'"),
    (["diffusers_lmlp.train", "--resume_from_checkpoint", "nowhere/checkpoint-3"], 2, "no such checkpoint folder"),
    (["diffusers_lmlp.evaluation", "--help"], 0, "usage: python -m diffusers_lmlp.evaluation"),
    (["diffusers_lmlp.evaluation", "--pipeline", "./no-such-folder"], 2, "no such folder"),
    (["diffusers_lmlp.evaluation", "--pipeline", "shapes", "--batch_size", "0"], 2, "must be positive"),
    (["diffusers_lmlp.analysis", "lateralization", "--layers", "0"], 2, "usage: python -m diffusers_lmlp.analysis"),
    (["diffusers_lmlp.hub", "--help"], 0, "usage: python -m diffusers_lmlp.hub"),
    (["diffusers_lmlp.hub", "push", "--help"], 0, "usage: python -m diffusers_lmlp.hub push"),
    (["diffusers_lmlp.hub", "push-space"], 2, "the following arguments are required"),
    (["diffusers_lmlp.hub", "push", "a", "b", "--output-dir", "x"], 2, "--output-dir only goes with --dry-run"),
]
# Run by a fresh interpreter: the package import, then each `python -m <module> <args>` as runpy runs it, each
# followed by the heavy libraries loaded so far. The last command is the one argument error that needs a model.
IN_TURN = """
import contextlib, io, json, runpy, sys
heavy, commands = set(json.loads(sys.argv[1])), json.loads(sys.argv[2])
import diffusers_lmlp
diffusers_lmlp.FAMILIES, diffusers_lmlp.__version__
results = [{"heavy": sorted({name.split(".")[0] for name in sys.modules} & heavy)}]
for module, *args in commands:
    sys.argv, out = [module, *args], io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else (print(exit.code, file=out) or 1)
    loaded = sorted({name.split(".")[0] for name in sys.modules} & heavy)
    results.append({"code": code, "output": " ".join(out.getvalue().split()), "heavy": loaded})
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def in_turn(tmp_path_factory) -> list[dict]:
    config = tmp_path_factory.mktemp("config") / "config.json"
    config.write_text(json.dumps({"num_layers": 4, "no_such_key": 1}))
    commands = [command for command, _, _ in COMMANDS] + [["diffusers_lmlp.train", "--model_config", str(config)]]
    argv = [sys.executable, "-c", IN_TURN, json.dumps(sorted(HEAVY)), json.dumps(commands)]
    result = subprocess.run(argv, capture_output=True, text=True, env=ENV, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


def test_importing_the_package_loads_no_heavy_library(in_turn):
    assert in_turn[0]["heavy"] == []


@pytest.mark.parametrize(
    ("index", "exit_code", "says"),
    [(index, exit_code, says) for index, (_, exit_code, says) in enumerate(COMMANDS, 1)],
    ids=[" ".join(command) for command, _, _ in COMMANDS],
)
def test_help_and_argument_errors_load_no_heavy_library(in_turn, index, exit_code, says):
    result = in_turn[index]
    assert result["code"] == exit_code and says in result["output"], result
    assert result["heavy"] == []


def test_a_model_config_key_check_loads_the_model_class_only_then(in_turn):
    # The one kind of argument error that needs a model: its config signature names the valid keys.
    result = in_turn[-1]
    assert result["code"] == 2 and "unknown config key 'no_such_key'" in result["output"], result
    assert "diffusers" in result["heavy"]  # the class was imported for it; a key check needs its signature


FIRST_IMPORTS = [
    "import diffusers_lmlp; import diffusers",  # the package first: the import hook adds the lookup
    "import diffusers; import diffusers_lmlp",  # diffusers first: registered at once
    "from diffusers_lmlp.models import LMLPTransformer2DModel",  # diffusers imported by a model module
    "from diffusers_lmlp import LMLPPipeline",  # by the pipelines themselves, through the lazy name
    # diffusers' auto pipelines imported before the package: it enters the pipeline in their mapping at once
    "from diffusers import AutoPipelineForText2Image; import diffusers_lmlp",
]
# Run after each of FIRST_IMPORTS: inductor loaded yet, the pipeline as diffusers loads it, and each public class's
# `__module__` imported from its own module (save_pretrained writes it into model_index.json).
LOAD = """
import sys
print("torch._inductor.compile_fx" in sys.modules)
import diffusers_lmlp
from diffusers import AutoPipelineForText2Image, DiffusionPipeline
pipe = DiffusionPipeline.from_pretrained(sys.argv[1])
auto = AutoPipelineForText2Image.from_pretrained(sys.argv[1])
print(type(pipe).__module__, type(pipe).__name__, type(pipe.transformer).__name__)
print(type(auto).__name__, type(AutoPipelineForText2Image.from_pipe(pipe)).__name__)
"""
LOAD += "\n".join(
    f"from diffusers_lmlp.models.{family.module} import {family.class_name} as c; print(c.__module__)"
    for family in FAMILIES.values()
)
LOAD += "\nfrom diffusers_lmlp.pipelines.pipeline_lmlp import LMLPPipeline; print(LMLPPipeline.__module__)"


@pytest.fixture(scope="module", params=FIRST_IMPORTS)
def loaded(request, tmp_path_factory) -> list[str]:
    """What LOAD prints after `request.param` on a saved tiny pipeline, diffusers' warnings made errors."""
    from diffusers_lmlp.tiny import build_tiny_pipeline

    folder = tmp_path_factory.mktemp("pipe")
    build_tiny_pipeline("lmlp").save_pretrained(folder)
    argv = [sys.executable, "-W", "error::UserWarning", "-c", f"{request.param}\n{LOAD}", str(folder)]
    result = subprocess.run(argv, capture_output=True, text=True, env=ENV, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "could not register" not in result.stderr
    return result.stdout.splitlines()


@pytest.mark.slow
def test_diffusion_pipeline_finds_lmlp_pipeline_whichever_is_imported_first(loaded):
    assert loaded[1].split() == ["diffusers_lmlp", "LMLPPipeline", "LMLPTransformer2DModel"]
    assert loaded[2].split() == ["LMLPPipeline"] * 2


@pytest.mark.slow
def test_the_pipeline_imports_inductor_only_to_freeze(loaded):
    assert loaded[0] == "False"


@pytest.mark.slow
def test_every_public_class_is_recorded_under_the_package_from_its_own_module(loaded):
    assert loaded[3:] == ["diffusers_lmlp"] * (len(FAMILIES) + 1)


def test_the_package_exports_every_family_and_lists_its_names():
    for family in FAMILIES.values():
        assert getattr(diffusers_lmlp, family.class_name) is family.model_class
        assert family.class_name in diffusers_lmlp.__all__ and family.class_name in dir(diffusers_lmlp)
    assert set(diffusers_lmlp.__all__) <= set(dir(diffusers_lmlp))
    with pytest.raises(AttributeError, match="has no attribute 'NoSuchName'"):
        diffusers_lmlp.NoSuchName  # noqa: B018


@pytest.mark.parametrize(
    "name, module, argv0, named",
    [
        ("diffusers-lmlp-train", "diffusers_lmlp.train", "<package>/train.py", "python -m diffusers_lmlp.train"),
        ("diffusers-lmlp-hub", "diffusers_lmlp.hub", "<package>/hub/__main__.py", "python -m diffusers_lmlp.hub"),
        ("diffusers-lmlp-train", "diffusers_lmlp.train", "/venv/bin/diffusers-lmlp-train", "diffusers-lmlp-train"),
        ("diffusers-lmlp-train", "diffusers_lmlp.train", "examples/train_text_to_image.py", "train_text_to_image.py"),
        ("diffusers-lmlp-train", "diffusers_lmlp.train", "/elsewhere/train.py", "train.py"),
    ],
)
def test_the_module_form_of_each_command_names_itself_and_a_script_keeps_its_own_name(name, module, argv0, named):
    from diffusers_lmlp.commands import program_name

    argv0 = argv0.replace("<package>", str(Path(diffusers_lmlp.__file__).parent))
    assert program_name(name, module, argv0) == named
