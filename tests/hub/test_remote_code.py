"""`push --with-code`: a repo diffusers loads offline by repo id with `trust_remote_code=True`, without the package."""

import ast
import json
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import safetensors.torch
import torch
from diffusers import DiffusionPipeline
from diffusers.utils.dynamic_modules_utils import get_relative_imports
from huggingface_hub import ModelCard
from test_hub import PIPELINE_FILES, hub_calls  # noqa: F401 (a fixture)
from without_package import environment_without_package, fill_cache

from diffusers_lmlp import FAMILIES, LMLPPipeline, __version__
from diffusers_lmlp.hub import push_pipeline, remote_code, stage_pipeline
from diffusers_lmlp.hub.__main__ import main
from diffusers_lmlp.tiny import build_tiny_pipeline


# Families whose whole pipeline is compared image for image; every other family compares one transformer forward.
IMAGE_FAMILIES = ("lmlp", "moe_mlp")
CODE_FILES = {"pipeline_lmlp.py", "transformer/lmlp_transformer_2d.py"}
REFUSAL = r"(?s)contains custom code in pipeline_lmlp\.py which must be executed.*Pass `trust_remote_code=True`"
# Run where `sitecustomize` refuses (and records) imports of the package: each "mode:repo_id" loaded with remote code.
LOAD = """
import json, sys
import safetensors.torch
import torch
from diffusers import DiffusionPipeline
import sitecustomize

torch.set_num_threads(1)
results, classes = {}, {}
for request in sys.argv[2:]:
    mode, repo_id = request.split(":")
    pipe = DiffusionPipeline.from_pretrained(repo_id, trust_remote_code=True)
    pipe.set_progress_bar_config(disable=True)
    classes[repo_id] = [type(pipe).__module__, type(pipe.transformer).__module__]
    with torch.no_grad():
        if mode == "image":
            generator = torch.Generator().manual_seed(0)
            results[repo_id] = pipe("a red circle", num_inference_steps=2, generator=generator, output_type="pt").images
        else:
            results[repo_id] = pipe.transformer(**safetensors.torch.load_file("inputs.safetensors"), return_dict=False)[0]
safetensors.torch.save_file(results, sys.argv[1])
package = sorted(name for name in sys.modules if name.split(".")[0] == "diffusers_lmlp")
print(json.dumps({"classes": classes, "package_modules": package, "attempts": sitecustomize.ATTEMPTS}))
"""


def repo_id_of(family: str) -> str:
    return f"owner/tiny-{family.replace('_', '-')}"


def image_of(pipe: LMLPPipeline) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return pipe("a red circle", num_inference_steps=2, generator=generator, output_type="pt").images


@pytest.fixture(scope="module")
def with_code(tmp_path_factory):
    """Each family's pipeline staged `--with-code` into a Hub cache and run by LOAD; lmlp's staged again by `cli`."""
    root, pipes = tmp_path_factory.mktemp("with-code"), {}
    for family in sorted(FAMILIES):
        pipes[family] = build_tiny_pipeline(family, seed=0)
        pipes[family].set_progress_bar_config(disable=True)
        pipes[family].save_pretrained(root / f"saved-{family}")
        push = ["push", str(root / f"saved-{family}"), repo_id_of(family), "--dry-run", "--with-code", "--output-dir"]
        if family == "lmlp":  # set and dict orders must not reach the files
            command = [sys.executable, "-m", "diffusers_lmlp.hub", *push, str(root / "cli")]
            cli = subprocess.Popen(command, env={**os.environ, "PYTHONHASHSEED": "12345"}, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)  # fmt: skip
        main([*push, str(root / f"upload-{family}")])
        fill_cache(root / f"upload-{family}", root / "cache", repo_id_of(family))
    generator = torch.Generator().manual_seed(0)
    inputs = {
        "hidden_states": torch.randn(2, 4, 8, 8, generator=generator),  # tiny latents
        "encoder_hidden_states": torch.randn(2, 16, 32, generator=generator),  # tiny CLIP states
        "timestep": torch.tensor([3, 999]),
    }
    safetensors.torch.save_file(inputs, root / "inputs.safetensors")
    requests = [f"{'image' if f in IMAGE_FAMILIES else 'forward'}:{repo_id_of(f)}" for f in sorted(FAMILIES)]
    command = [sys.executable, "-c", LOAD, str(root / "out.safetensors"), *requests]
    result = subprocess.run(command, cwd=root, env=environment_without_package(root), capture_output=True, text=True,
                            timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    stdout, stderr = cli.communicate(timeout=300)
    return SimpleNamespace(
        root=root, pipes=pipes, inputs=inputs, outputs=safetensors.torch.load_file(root / "out.safetensors"),
        report=json.loads(result.stdout.strip().splitlines()[-1]),
        cli=SimpleNamespace(stdout=stdout, stderr=stderr, returncode=cli.returncode),
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.usefixtures("make_pipe")  # one CPU thread
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_with_code_repo_loads_by_repo_id_without_the_package_and_matches_it(with_code, family):
    staged, pipe, repo_id = with_code.root / f"upload-{family}", with_code.pipes[family], repo_id_of(family)
    stem = remote_code.file_stem(remote_code.defining_module_of(FAMILIES[family].model_class.__name__))
    code = {"pipeline_lmlp.py": "LMLPPipeline", f"transformer/{stem}.py": FAMILIES[family].class_name}
    assert {p.relative_to(staged).as_posix() for p in staged.rglob("*.py")} == set(code)
    for path, class_name in code.items():  # self-contained, and naming the version and sources it was made from
        source = (staged / path).read_text()
        nodes = list(ast.walk(ast.parse(source)))
        imported = [alias.name for node in nodes if isinstance(node, ast.Import) for alias in node.names]
        imported += ["." * node.level + (node.module or "") for node in nodes if isinstance(node, ast.ImportFrom)]
        assert "diffusers" in {name.split(".")[0] for name in imported}
        assert not [name for name in imported if name.startswith(".") or name.split(".")[0] == "diffusers_lmlp"]
        assert get_relative_imports(staged / path) == []  # diffusers' own scan: no file to fetch beside it
        assert source.startswith(f"# Generated from diffusers-lmlp {__version__} ")
        assert f"#   {remote_code.load_module(remote_code.defining_module_of(class_name)).path}\n" in source
    assert with_code.report["package_modules"] == [] and with_code.report["attempts"] == []
    assert with_code.report["classes"][repo_id] == [f"diffusers_modules.local.{n}" for n in ("pipeline_lmlp", stem)]
    with torch.no_grad():
        expected = image_of(pipe) if family in IMAGE_FAMILIES else pipe.transformer(**with_code.inputs)[0]
    torch.testing.assert_close(with_code.outputs[repo_id], expected, rtol=0, atol=1e-5)


@pytest.mark.slow
@pytest.mark.usefixtures("make_pipe")  # one CPU thread
def test_without_trust_remote_code_no_repo_code_runs_and_the_package_loads_it_with_its_own_code(with_code, tmp_path):
    staged = shutil.copytree(with_code.root / "upload-lmlp", tmp_path / "staged")
    for path in staged.rglob("*.py"):  # each code file fails loudly if it is ever run
        path.write_text(f"raise RuntimeError('{path.name} ran')\n" + path.read_text())
    fill_cache(staged, tmp_path / "cache", "owner/tiny-lmlp")
    before = set(sys.modules)
    for source in ("owner/tiny-lmlp", staged):
        with pytest.raises(ValueError, match=REFUSAL):
            DiffusionPipeline.from_pretrained(source, cache_dir=tmp_path / "cache")
    assert not [name for name in set(sys.modules) - before if name.split(".")[0] == "diffusers_modules"]
    for name in (str(staged), "owner/tiny-lmlp"):
        loaded = LMLPPipeline.from_pretrained(name, cache_dir=tmp_path / "cache")
        loaded.set_progress_bar_config(disable=True)
        assert type(loaded) is LMLPPipeline and type(loaded.transformer) is type(with_code.pipes["lmlp"].transformer)
        assert loaded.config.transformer == ("diffusers_lmlp", "LMLPTransformer2DModel")
        assert loaded.config._name_or_path == name
        torch.testing.assert_close(image_of(loaded), image_of(with_code.pipes["lmlp"]), rtol=0, atol=0)


@pytest.mark.slow
def test_cli_dry_run_with_code_lists_the_code_and_writes_the_same_bytes_in_another_process(with_code):
    result, out = with_code.cli, with_code.root / "cli"
    assert result.returncode == 0, result.stderr
    said = f"Dry run, nothing was uploaded. The folder that would be uploaded to the model repo owner/tiny-lmlp: {out}"
    assert said in result.stdout
    assert "  pipeline_lmlp.py\n" in result.stdout and "  transformer/lmlp_transformer_2d.py\n" in result.stdout
    for path in (*CODE_FILES, "model_index.json"):
        assert (out / path).read_bytes() == (with_code.root / "upload-lmlp" / path).read_bytes(), path


def test_a_name_two_bundled_modules_define_differently_is_refused():
    modules = [
        remote_code.load_module(remote_code.defining_module_of(name))
        for name in ("LMLPTransformer2DModel", "UViTTransformer2DModel")
    ]
    with pytest.raises(NameError, match="both define '_REFERENCE_KEY_RULES' at the top level, differently"):
        remote_code._check_one_namespace(modules)


def test_default_push_uploads_no_code_and_the_code_push_commits_what_its_dry_run_wrote(pipe, hub_calls, tmp_path):  # noqa: F811
    pipe.save_pretrained(tmp_path / "saved")
    index = (tmp_path / "saved" / "model_index.json").read_text()
    planted = {"evil.py": "import os\nos.system('echo pwned')\n", "pipeline_lmlp.py": "print('not ours')\n"}
    for path, text in planted.items():
        (tmp_path / "saved" / path).write_text(text)
    plain = stage_pipeline(tmp_path / "saved", "alice/tiny-lmlp", tmp_path / "plain")
    code = stage_pipeline(tmp_path / "saved", "alice/tiny-lmlp", tmp_path / "code", with_code=True)
    assert set(plain.files) == PIPELINE_FILES and set(code.files) == PIPELINE_FILES | CODE_FILES
    assert (plain.folder / "model_index.json").read_text() == index
    assert set(planted) <= set(plain.left_out) and set(planted) <= set(code.left_out)
    assert code.left_out["evil.py"].startswith("code: a push uploads none of the folder's own")
    model_index = json.loads((code.folder / "model_index.json").read_text())
    assert model_index == {**json.loads(index), "_class_name": ["pipeline_lmlp", "LMLPPipeline"],
                           "transformer": ["lmlp_transformer_2d", "LMLPTransformer2DModel"]}  # fmt: skip
    plain_card, card = (ModelCard.load(staged.folder / "README.md").text for staged in (plain, code))
    assert "trust_remote_code" not in plain_card
    assert 'pipe = DiffusionPipeline.from_pretrained("alice/tiny-lmlp", trust_remote_code=True)' in card
    assert (
        "`trust_remote_code=True` downloads this repo's `pipeline_lmlp.py` and `transformer/lmlp_transformer_2d.py` "
        "and executes them on your machine when the pipeline loads: read them first"
    ) in card
    # Pushed again without the code: its code is left out; model_index.json and the card name the package.
    again = stage_pipeline(code.folder, "alice/tiny-lmlp", tmp_path / "again")
    assert set(again.files) == PIPELINE_FILES and set(CODE_FILES) <= set(again.left_out)
    assert json.loads((again.folder / "model_index.json").read_text()) == json.loads(index)
    assert "trust_remote_code" not in ModelCard.load(again.folder / "README.md").text

    push_pipeline(tmp_path / "saved", "alice/tiny-lmlp", token="hf_test", with_code=True)
    assert hub_calls[-1][1]["files"] == {path: (code.folder / path).read_bytes() for path in code.files}
    # A component a library loads gets no code.
    files, extra = remote_code.remote_code_files({**json.loads(index), "extra": ["diffusers", "AutoencoderKL"]})
    assert set(files) == CODE_FILES and extra["extra"] == ["diffusers", "AutoencoderKL"]


PATH_KEY = (
    "has the key {key!r}, which is not a component name: each key names a folder of the pipeline (a Python identifier "
    "such as 'transformer'), never a path. Fix or remove that entry."
)
NOT_A_COMPONENT = (
    "names LMLPTransformer2DModel under 'extra', which is not a component of LMLPPipeline (it takes scheduler, "
    "text_encoder, tokenizer, transformer, vae): remove that entry."  # it would get no code
)


@pytest.mark.parametrize(
    "key, message",
    [*((key, PATH_KEY) for key in ["..", "../escape", "ABSOLUTE", "transformer/..", "a\\b", ""]), ("extra", NOT_A_COMPONENT)],
)  # fmt: skip
def test_a_model_index_key_that_is_a_path_or_no_component_is_refused_before_writing(pipe, tmp_path, key, message):
    pipe.save_pretrained(tmp_path / "saved")
    (tmp_path / "outside").mkdir()  # an existing folder outside the staging folder, named by an absolute key
    key = str(tmp_path / "outside") if key == "ABSOLUTE" else key
    index = json.loads((tmp_path / "saved" / "model_index.json").read_text())
    index[key] = ["diffusers_lmlp", "LMLPTransformer2DModel"]  # diffusers ignores a key its pipeline does not take
    (tmp_path / "saved" / "model_index.json").write_text(json.dumps(index))
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(SystemExit) as exit_info:
        main(["push", str(tmp_path / "saved"), "owner/x", "--dry-run", "--with-code", "--output-dir", str(tmp_path / "up")])  # fmt: skip
    assert str(exit_info.value.code) == f"error: {tmp_path / 'saved' / 'model_index.json'} " + message.format(key=key)
    assert sorted(tmp_path.rglob("*")) == before  # nothing written: no staging folder, no file outside it


def test_with_code_entries_are_mapped_by_one_function_that_only_looks_at_the_loaded_package(monkeypatch):
    from diffusers_lmlp.pipelines import model_index, pipeline_lmlp

    # The push and LMLPPipeline.from_pretrained share it, and the pipeline's remote code carries it.
    assert remote_code.package_model_index is pipeline_lmlp.package_model_index is model_index.package_model_index
    source = remote_code.bundle_source(remote_code.defining_module_of("LMLPPipeline"), "LMLPPipeline")
    assert "def package_model_index(" in source
    with_code = {"_class_name": ["pipeline_lmlp", "LMLPPipeline"], "vae": ["diffusers", "AutoencoderKL"],
                 "transformer": ["lmlp_transformer_2d", "LMLPTransformer2DModel"], "other": ["lmlp_other", "NoSuchClass"]}  # fmt: skip
    expected = with_code | {"_class_name": "LMLPPipeline", "transformer": ["diffusers_lmlp", "LMLPTransformer2DModel"]}
    assert model_index.package_model_index(with_code) == expected
    assert model_index.package_model_index(expected) == expected
    # A class the package exports lazily counts; without the package loaded nothing changes, and nothing is imported.
    lazy = type(sys)("diffusers_lmlp")
    lazy.__getattr__ = lambda name: LMLPPipeline if name in ("LMLPPipeline", "LMLPTransformer2DModel") else None
    monkeypatch.setitem(sys.modules, "diffusers_lmlp", lazy)
    assert model_index.package_model_index(with_code) == expected
    monkeypatch.delitem(sys.modules, "diffusers_lmlp")
    assert model_index.package_model_index(with_code) == with_code
    assert "diffusers_lmlp" not in sys.modules
