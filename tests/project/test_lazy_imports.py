"""Quick start-up: `import diffusers_lmlp`, every command's `--help` and its argument errors load no heavy library
(each a fresh `python -X importtime`), and what the lazy names replace still holds: diffusers finds `LMLPPipeline`
whichever is imported first, and saved folders name ["diffusers_lmlp", "<Class>"]."""

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


def imported_modules(*args: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run `python -X importtime *args` and return the result and the top-level packages it imported."""
    result = subprocess.run(
        [sys.executable, "-X", "importtime", *args], capture_output=True, text=True, env=ENV, timeout=300
    )
    lines = [line for line in result.stderr.splitlines() if line.startswith("import time:") and "|" in line]
    names = {line.rsplit("|", 1)[1].strip().split(".")[0] for line in lines[1:]}  # the first line is the header
    return result, names


def test_importing_the_package_loads_no_heavy_library():
    result, names = imported_modules(
        "-c", "import diffusers_lmlp; diffusers_lmlp.FAMILIES; diffusers_lmlp.__version__"
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert not names & HEAVY, sorted(names & HEAVY)
    assert "diffusers_lmlp" in names  # the parsing of -X importtime output found the package itself


@pytest.mark.slow
def test_the_pipeline_imports_inductor_only_to_freeze():
    code = "from diffusers_lmlp import LMLPPipeline; import sys; print('torch._inductor.compile_fx' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=300)
    assert result.stdout.strip() == "False", result.stderr[-2000:]


@pytest.mark.parametrize(
    ("command", "exit_code", "says"),
    [
        (["diffusers_lmlp.train", "--help"], 0, "usage: python -m diffusers_lmlp.train"),
        (["diffusers_lmlp.train", "--no_such_option"], 2, "unrecognized arguments: --no_such_option"),
        (["diffusers_lmlp.train", "--model_type", "transformer"], 2, "invalid choice: 'transformer'"),
        (["diffusers_lmlp.train", "--learning_rate", "-1"], 2, "--learning_rate: must be a finite number > 0"),
        (["diffusers_lmlp.train", "--model_config", "Z9"], 2, "unknown --model_config 'Z9'"),
        (["diffusers_lmlp.train", "--resume_from_checkpoint", "nowhere/checkpoint-3"], 2, "no such checkpoint folder"),
        (["diffusers_lmlp.evaluation", "--help"], 0, "usage: python -m diffusers_lmlp.evaluation"),
        (["diffusers_lmlp.evaluation", "--pipeline", "./no-such-folder"], 2, "no such folder"),
        (["diffusers_lmlp.evaluation", "--pipeline", "shapes", "--batch_size", "0"], 2, "must be positive"),
        (["diffusers_lmlp.hub", "--help"], 0, "usage: python -m diffusers_lmlp.hub"),
        (["diffusers_lmlp.hub", "push", "--help"], 0, "usage: python -m diffusers_lmlp.hub push"),
        (["diffusers_lmlp.hub", "push-space"], 2, "the following arguments are required"),
        (["diffusers_lmlp.hub", "push", "a", "b", "--output-dir", "x"], 2, "--output-dir only goes with --dry-run"),
    ],
    ids=lambda value: " ".join(value) if isinstance(value, list) else None,
)
@pytest.mark.slow
def test_help_and_argument_errors_load_no_heavy_library(command, exit_code, says):
    result, names = imported_modules("-m", *command)
    assert result.returncode == exit_code, result.stderr[-2000:]
    output = result.stdout + "\n".join(line for line in result.stderr.splitlines() if not line.startswith("import"))
    assert says in " ".join(output.split())
    assert not names & HEAVY, sorted(names & HEAVY)


@pytest.mark.slow
def test_a_model_config_key_check_loads_the_model_class_only_then(tmp_path):
    # The one kind of argument error that needs a model: its config signature names the valid keys.
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"num_layers": 4, "no_such_key": 1}))
    result, names = imported_modules("-m", "diffusers_lmlp.train", "--model_config", str(config))
    assert result.returncode == 2 and "unknown config key 'no_such_key'" in result.stderr
    assert "diffusers" in names  # the class was imported for it; a key check needs its signature


@pytest.mark.parametrize(
    "first",
    [
        "import diffusers_lmlp; import diffusers",  # the package first: the import hook adds the lookup
        "import diffusers; import diffusers_lmlp",  # diffusers first: registered at once
        "from diffusers_lmlp.models import LMLPTransformer2DModel",  # diffusers imported by a model module
        "from diffusers_lmlp.pipelines import LMLPPipeline",  # by the pipelines themselves
        # diffusers' auto pipelines imported before the package: it enters the pipeline in their mapping at once
        "from diffusers import AutoPipelineForText2Image; import diffusers_lmlp",
    ],
)
@pytest.mark.slow
def test_diffusion_pipeline_finds_lmlp_pipeline_whichever_is_imported_first(first, tmp_path):
    from diffusers_lmlp.tiny import build_tiny_pipeline

    build_tiny_pipeline("lmlp").save_pretrained(tmp_path / "pipe")
    code = f"""
{first}
import diffusers_lmlp
from diffusers import AutoPipelineForText2Image, DiffusionPipeline
pipe = DiffusionPipeline.from_pretrained({str(tmp_path / "pipe")!r})
auto = AutoPipelineForText2Image.from_pretrained({str(tmp_path / "pipe")!r})
print(type(pipe).__module__, type(pipe).__name__, type(pipe.transformer).__name__)
print(type(auto).__name__, type(AutoPipelineForText2Image.from_pipe(pipe)).__name__)
"""
    result = subprocess.run(
        [sys.executable, "-W", "error::UserWarning", "-c", code], capture_output=True, text=True, env=ENV, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["diffusers_lmlp", "LMLPPipeline", "LMLPTransformer2DModel"] + ["LMLPPipeline"] * 2
    assert "could not register" not in result.stderr


@pytest.mark.slow
def test_every_public_class_is_recorded_under_the_package_from_its_own_module():
    # save_pretrained writes `__module__` into model_index.json, even for a class imported from its own module.
    code = "\n".join(
        f"from diffusers_lmlp.models.{family.module} import {family.class_name} as c; print(c.__module__)"
        for family in FAMILIES.values()
    )
    code += "\nfrom diffusers_lmlp.pipelines.pipeline_lmlp import LMLPPipeline; print(LMLPPipeline.__module__)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["diffusers_lmlp"] * (len(FAMILIES) + 1)


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
