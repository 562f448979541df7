"""Fast start-up: imports, `--help` and argument errors load no heavy library; diffusers finds LMLPPipeline."""

import ast
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
    # Last, as it imports the model class: the one argument error that needs it (its signature names the valid keys).
    (["diffusers_lmlp.train", "--model_config", "<config.json>"], 2, "unknown config key 'no_such_key'"),
]
# Run by a fresh interpreter: the package import, then each `python -m <module> <args>`, each with what it loaded.
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
    commands = [[str(config) if arg == "<config.json>" else arg for arg in command] for command, _, _ in COMMANDS]
    argv = [sys.executable, "-c", IN_TURN, json.dumps(sorted(HEAVY)), json.dumps(commands)]
    result = subprocess.run(argv, capture_output=True, text=True, env=ENV, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.splitlines()[-1])
    assert found[0]["heavy"] == []  # importing the package loads no heavy library
    return found


@pytest.mark.parametrize("index", range(len(COMMANDS)), ids=[" ".join(command) for command, _, _ in COMMANDS])
def test_help_and_argument_errors_load_no_heavy_library_but_a_config_key_check_the_model_class(in_turn, index):
    (command, exit_code, says), result = COMMANDS[index], in_turn[index + 1]
    assert result["code"] == exit_code and says in result["output"], result
    assert "diffusers" in result["heavy"] if "<config.json>" in command else result["heavy"] == [], result


FIRST_IMPORTS = [
    "import diffusers_lmlp; import diffusers",  # the package first: the import hook adds the lookup
    "import diffusers; import diffusers_lmlp",  # diffusers first: registered at once
    "from diffusers_lmlp.models import LMLPTransformer2DModel",  # diffusers imported by a model module
    "from diffusers_lmlp import LMLPPipeline",  # by the pipelines themselves, through the lazy name
    "from diffusers import AutoPipelineForText2Image; import diffusers_lmlp",  # auto pipelines first: mapped at once
]
# After each of FIRST_IMPORTS: inductor loaded yet, the pipeline diffusers loads, each public class's `__module__`.
LOAD = """
import importlib, sys
print("torch._inductor.compile_fx" in sys.modules)
import diffusers_lmlp
from diffusers import AutoPipelineForText2Image, DiffusionPipeline
pipe = DiffusionPipeline.from_pretrained(sys.argv[1])
auto = AutoPipelineForText2Image.from_pretrained(sys.argv[1])
print(type(pipe).__module__, type(pipe).__name__, type(pipe.transformer).__name__)
print(type(auto).__name__, type(AutoPipelineForText2Image.from_pipe(pipe)).__name__)
for family in diffusers_lmlp.FAMILIES.values():
    print(getattr(importlib.import_module(f"diffusers_lmlp.models.{family.module}"), family.class_name).__module__)
from diffusers_lmlp.pipelines.pipeline_lmlp import LMLPPipeline
print(LMLPPipeline.__module__)
"""


@pytest.mark.slow
@pytest.mark.parametrize("first", FIRST_IMPORTS)
def test_diffusers_loads_lmlp_pipeline_from_the_package_whichever_is_imported_first(first, tmp_path):
    from diffusers_lmlp.tiny import build_tiny_pipeline  # LOAD after `first` on it, diffusers' warnings made errors

    build_tiny_pipeline("lmlp").save_pretrained(tmp_path)
    argv = [sys.executable, "-W", "error::UserWarning", "-c", f"{first}\n{LOAD}", str(tmp_path)]
    result = subprocess.run(argv, capture_output=True, text=True, env=ENV, timeout=300)
    assert result.returncode == 0 and "could not register" not in result.stderr, result.stderr[-3000:]
    inductor, pipe, auto, *modules = result.stdout.splitlines()
    assert inductor == "False"  # the pipeline imports inductor only to freeze
    assert pipe.split() == ["diffusers_lmlp", "LMLPPipeline", "LMLPTransformer2DModel"]
    assert auto.split() == ["LMLPPipeline"] * 2 and modules == ["diffusers_lmlp"] * (len(FAMILIES) + 1)


def test_the_package_exports_every_family_and_lists_its_names():
    for family in FAMILIES.values():
        assert getattr(diffusers_lmlp, family.class_name) is family.model_class
        assert family.class_name in diffusers_lmlp.__all__ and family.class_name in dir(diffusers_lmlp)
    assert set(diffusers_lmlp.__all__) <= set(dir(diffusers_lmlp))
    with pytest.raises(AttributeError, match="has no attribute 'NoSuchName'"):
        diffusers_lmlp.NoSuchName  # noqa: B018


# A script keeps its own name in its usage (the module form, run from the package's files: in_turn's `--help` lines).
SCRIPTS = ["/venv/bin/diffusers-lmlp-train", "examples/train_text_to_image.py", "/elsewhere/train.py"]


@pytest.mark.parametrize("argv0", SCRIPTS)
def test_a_command_run_by_its_script_keeps_the_scripts_name(argv0):
    from diffusers_lmlp.commands import program_name

    assert program_name("diffusers-lmlp-train", "diffusers_lmlp.train", argv0) == Path(argv0).name


def test_no_two_subpackages_import_each_other():
    """The worlds use the evaluation's tools; the evaluation reaches a world only through `worlds.WORLDS`' names."""
    root = Path(diffusers_lmlp.__file__).parent
    imports = {}  # subpackage -> the subpackages its modules import, at any depth of the module
    for path in root.glob("*/**/*.py"):
        package, parts = path.relative_to(root).parts[0], path.relative_to(root).with_suffix("").parts
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom) or not node.module:
                continue
            named = node.module.split(".")
            target = [*parts[: len(parts) - node.level], *named] if node.level else named[1:]
            if (node.level or named[0] == "diffusers_lmlp") and target[:1] not in ([], [package]):
                if (root / target[0]).is_dir():
                    imports.setdefault(package, set()).add(target[0])
    assert not [(a, b) for a in imports for b in imports[a] if a < b and a in imports.get(b, ())]
