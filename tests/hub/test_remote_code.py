"""`push --with-code`: a repo diffusers loads by repo id with `trust_remote_code=True`, without diffusers-lmlp (in a
subprocess whose `sitecustomize.py` refuses and records every import of the package, offline from a Hub cache)."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
from diffusers import DiffusionPipeline
from diffusers.utils.dynamic_modules_utils import get_relative_imports
from huggingface_hub import CommitInfo, HfApi, ModelCard
from test_hub import PIPELINE_FILES
from without_package import SITECUSTOMIZE, fill_cache

from diffusers_lmlp import FAMILIES, LMLPPipeline, __version__
from diffusers_lmlp.hub import push_pipeline, stage_pipeline
from diffusers_lmlp.hub.__main__ import main
from diffusers_lmlp.hub.remote_code import (
    _check_one_namespace,
    bundle_source,
    defining_module_of,
    file_stem,
    load_module,
    remote_code_files,
)


# Families whose whole pipeline is compared image for image; every other family compares one transformer forward.
IMAGE_FAMILIES = ("lmlp", "moe_mlp")
CODE_FILES = {"pipeline_lmlp.py", "transformer/lmlp_transformer_2d.py"}
# diffusers' refusal to run a repo's code without trust_remote_code=True.
REFUSAL = r"(?s)contains custom code in pipeline_lmlp\.py which must be executed.*Pass `trust_remote_code=True`"
# Loads each repo with `DiffusionPipeline.from_pretrained(repo_id, trust_remote_code=True)` and saves what it gives:
# a 2-step image (`image`) or one transformer forward on the inputs in `inputs.safetensors` (`forward`).
LOAD = """
import json, sys
import safetensors.torch
import torch
from diffusers import DiffusionPipeline
import sitecustomize

torch.set_num_threads(1)
mode, out = sys.argv[1], sys.argv[2]
results, classes = {}, {}
for repo_id in sys.argv[3:]:
    pipe = DiffusionPipeline.from_pretrained(repo_id, trust_remote_code=True)
    pipe.set_progress_bar_config(disable=True)
    classes[repo_id] = [type(pipe).__module__, type(pipe.transformer).__module__]
    if mode == "image":
        generator = torch.Generator().manual_seed(0)
        results[repo_id] = pipe("a red circle", num_inference_steps=2, generator=generator, output_type="pt").images
    else:
        inputs = safetensors.torch.load_file("inputs.safetensors")
        with torch.no_grad():
            results[repo_id] = pipe.transformer(**inputs, return_dict=False)[0]
safetensors.torch.save_file(results, out)
package = sorted(name for name in sys.modules if name.split(".")[0] == "diffusers_lmlp")
print(json.dumps({"classes": classes, "package_modules": package, "attempts": sitecustomize.ATTEMPTS}))
"""


def repo_id_of(family: str) -> str:
    return f"owner/tiny-{family.replace('_', '-')}"


def load_without_package(tmp_path: Path, mode: str, repo_ids: list[str]) -> tuple[dict, dict]:
    """Run `LOAD` in a subprocess that cannot import diffusers_lmlp; return its results and its report."""
    (tmp_path / "site").mkdir(exist_ok=True)
    (tmp_path / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {
        **os.environ,
        "PYTHONPATH": str(tmp_path / "site"),
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_CACHE": str(tmp_path / "cache"),
        "HF_HOME": str(tmp_path / "hf_home"),  # diffusers copies the remote code under HF_HOME/modules
    }
    out = tmp_path / f"{mode}.safetensors"
    command = [sys.executable, "-c", LOAD, mode, str(out), *repo_ids]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return safetensors.torch.load_file(out), json.loads(result.stdout.strip().splitlines()[-1])


def saved_pipeline(make_pipe, folder: Path, family: str = "lmlp") -> LMLPPipeline:
    pipe = make_pipe(family)
    pipe.save_pretrained(folder)
    return pipe


def image_of(pipe: LMLPPipeline) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return pipe("a red circle", num_inference_steps=2, generator=generator, output_type="pt").images


def stage_with_code(make_pipe, tmp_path: Path, family: str) -> tuple[LMLPPipeline, Path]:
    """A tiny pipeline of `family`, saved, then staged by `push --dry-run --with-code`; the pipeline and the stage."""
    saved, staged = tmp_path / f"saved-{family}", tmp_path / f"upload-{family}"
    pipe = saved_pipeline(make_pipe, saved, family)
    main(["push", str(saved), repo_id_of(family), "--dry-run", "--with-code", "--output-dir", str(staged)])
    return pipe, staged


def code_files_of(family: str) -> set[str]:
    stem = file_stem(defining_module_of(FAMILIES[family].model_class.__name__))
    return {"pipeline_lmlp.py", f"transformer/{stem}.py"}


@pytest.mark.slow
@pytest.mark.parametrize("family", IMAGE_FAMILIES)
def test_with_code_repo_loads_by_repo_id_without_the_package_and_gives_the_package_image(make_pipe, tmp_path, family):
    pipe, staged = stage_with_code(make_pipe, tmp_path, family)
    assert {p.relative_to(staged).as_posix() for p in staged.rglob("*.py")} == code_files_of(family)
    fill_cache(staged, tmp_path / "cache", repo_id_of(family))

    images, report = load_without_package(tmp_path, "image", [repo_id_of(family)])

    stem = file_stem(defining_module_of(FAMILIES[family].model_class.__name__))
    modules = ["diffusers_modules.local.pipeline_lmlp", f"diffusers_modules.local.{stem}"]
    assert report["classes"][repo_id_of(family)] == modules
    assert report["package_modules"] == [] and report["attempts"] == []
    torch.testing.assert_close(images[repo_id_of(family)], image_of(pipe), rtol=0, atol=1e-5)


@pytest.mark.slow
def test_every_family_s_generated_transformer_loads_without_the_package_and_matches_it(make_pipe, tmp_path):
    families = sorted(set(FAMILIES) - set(IMAGE_FAMILIES))
    expected = {}
    generator = torch.Generator().manual_seed(0)
    inputs = {
        "hidden_states": torch.randn(2, 4, 8, 8, generator=generator),  # (B, C, H, W) tiny latents
        "encoder_hidden_states": torch.randn(2, 16, 32, generator=generator),  # (B, T, 32) tiny CLIP states
        "timestep": torch.tensor([3, 999]),
    }
    safetensors.torch.save_file(inputs, tmp_path / "inputs.safetensors")
    for family in families:
        pipe, staged = stage_with_code(make_pipe, tmp_path, family)
        assert {p.relative_to(staged).as_posix() for p in staged.rglob("*.py")} == code_files_of(family)
        fill_cache(staged, tmp_path / "cache", repo_id_of(family))
        with torch.no_grad():
            expected[repo_id_of(family)] = pipe.transformer(**inputs, return_dict=False)[0]

    outputs, report = load_without_package(tmp_path, "forward", list(expected))

    assert report["package_modules"] == [] and report["attempts"] == []
    for family in families:
        stem = file_stem(defining_module_of(FAMILIES[family].model_class.__name__))
        assert report["classes"][repo_id_of(family)][1] == f"diffusers_modules.local.{stem}"
        torch.testing.assert_close(outputs[repo_id_of(family)], expected[repo_id_of(family)], rtol=0, atol=1e-5)


@pytest.mark.slow
def test_without_trust_remote_code_nothing_of_the_repo_runs_and_the_package_loads_it_with_its_own_code(
    make_pipe, tmp_path
):
    pipe, staged = stage_with_code(make_pipe, tmp_path, "lmlp")
    for path in staged.rglob("*.py"):  # each code file fails loudly if it is ever run
        path.write_text(f"raise RuntimeError('{path.name} ran')\n" + path.read_text())
    fill_cache(staged, tmp_path / "cache", "owner/tiny-lmlp")
    before = set(sys.modules)
    with pytest.raises(ValueError, match=REFUSAL):
        DiffusionPipeline.from_pretrained("owner/tiny-lmlp", cache_dir=tmp_path / "cache")
    with pytest.raises(ValueError, match=REFUSAL):
        DiffusionPipeline.from_pretrained(staged)
    assert not [name for name in set(sys.modules) - before if name.split(".")[0] == "diffusers_modules"]

    from_folder = LMLPPipeline.from_pretrained(staged)
    from_repo = LMLPPipeline.from_pretrained("owner/tiny-lmlp", cache_dir=tmp_path / "cache")
    for loaded, name in ((from_folder, str(staged)), (from_repo, "owner/tiny-lmlp")):
        loaded.set_progress_bar_config(disable=True)
        assert type(loaded) is LMLPPipeline and type(loaded.transformer) is type(pipe.transformer)
        assert loaded.config.transformer == ("diffusers_lmlp", "LMLPTransformer2DModel")
        assert loaded.config._name_or_path == name
        torch.testing.assert_close(image_of(loaded), image_of(pipe), rtol=0, atol=0)


def imports_of(source: str) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names.append("." * node.level + (node.module or ""))
    return names


@pytest.mark.slow
@pytest.mark.parametrize("class_name", sorted({"LMLPPipeline", *(f.model_class.__name__ for f in FAMILIES.values())}))
def test_generated_files_are_self_contained_deterministic_and_name_their_version(class_name, tmp_path):
    module = defining_module_of(class_name)
    source = bundle_source(module, class_name)

    imported = imports_of(source)
    assert "diffusers" in {name.split(".")[0] for name in imported}
    assert not [name for name in imported if name.startswith(".") or name.split(".")[0] == "diffusers_lmlp"]
    (tmp_path / "code.py").write_text(source)
    assert get_relative_imports(tmp_path / "code.py") == []  # diffusers' own scan: no file to fetch beside it
    assert source.startswith(f"# Generated from diffusers-lmlp {__version__} ")
    assert f"#   {load_module(module).path}\n" in source
    assert bundle_source(module, class_name) == source


def test_a_name_two_bundled_modules_define_differently_is_refused():
    modules = [load_module(defining_module_of(name)) for name in ("LMLPTransformer2DModel", "UViTTransformer2DModel")]
    with pytest.raises(NameError, match="both define '_REFERENCE_KEY_RULES' at the top level, differently"):
        _check_one_namespace(modules)


@pytest.mark.slow
def test_default_push_uploads_no_code_and_the_code_push_commits_what_its_dry_run_wrote(
    make_pipe, tmp_path, monkeypatch
):
    saved_pipeline(make_pipe, tmp_path / "saved")
    index = (tmp_path / "saved" / "model_index.json").read_text()
    planted = {"evil.py": "import os\nos.system('echo pwned')\n", "pipeline_lmlp.py": "print('not ours')\n"}
    for path, text in planted.items():
        (tmp_path / "saved" / path).write_text(text)

    plain = stage_pipeline(tmp_path / "saved", "alice/tiny-lmlp", tmp_path / "plain")
    with_code = stage_pipeline(tmp_path / "saved", "alice/tiny-lmlp", tmp_path / "code", with_code=True)
    assert set(plain.files) == PIPELINE_FILES and set(with_code.files) == PIPELINE_FILES | CODE_FILES
    assert (plain.folder / "model_index.json").read_text() == index
    for staged in (plain, with_code):
        assert set(planted) <= set(staged.left_out)
        assert staged.left_out["evil.py"].startswith("code: a push uploads none of the folder's own")
    generated = (with_code.folder / "pipeline_lmlp.py").read_text()
    assert generated == bundle_source(defining_module_of("LMLPPipeline"), "LMLPPipeline")
    model_index = json.loads((with_code.folder / "model_index.json").read_text())
    assert model_index["_class_name"] == ["pipeline_lmlp", "LMLPPipeline"]
    assert model_index["transformer"] == ["lmlp_transformer_2d", "LMLPTransformer2DModel"]
    assert model_index["vae"] == ["diffusers", "AutoencoderKL"]
    # The cards: the package's snippet, or trust_remote_code=True naming the code that runs.
    plain_card, card = (ModelCard.load(staged.folder / "README.md").text for staged in (plain, with_code))
    assert 'pipe = LMLPPipeline.from_pretrained("alice/tiny-lmlp")' in plain_card
    assert "trust_remote_code" not in plain_card
    assert 'pipe = DiffusionPipeline.from_pretrained("alice/tiny-lmlp", trust_remote_code=True)' in card
    assert (
        "`trust_remote_code=True` downloads this repo's `pipeline_lmlp.py` and `transformer/lmlp_transformer_2d.py` "
        "and executes them on your machine when the pipeline loads: read them first"
    ) in card

    # Pushed again without the code: its code is left out; model_index.json and the card name the package.
    again = stage_pipeline(with_code.folder, "alice/tiny-lmlp", tmp_path / "again")
    assert set(again.files) == PIPELINE_FILES and set(CODE_FILES) <= set(again.left_out)
    assert json.loads((again.folder / "model_index.json").read_text()) == json.loads(index)
    assert "trust_remote_code" not in ModelCard.load(again.folder / "README.md").text

    # The push with the code commits exactly what its dry run wrote.
    committed = {}

    def create_commit(self, repo_id, operations, **kwargs):
        committed.update({op.path_in_repo: Path(op.path_or_fileobj).read_bytes() for op in operations})
        url = f"https://huggingface.co/{repo_id}/commit/abc"
        return CommitInfo(commit_url=url, commit_message="", commit_description="", oid="abc")

    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, **kwargs: None)
    monkeypatch.setattr(HfApi, "create_commit", create_commit)
    push_pipeline(tmp_path / "saved", "alice/tiny-lmlp", token="hf_test", with_code=True)
    assert committed == {path: (with_code.folder / path).read_bytes() for path in with_code.files}


@pytest.mark.slow
def test_cli_dry_run_with_code_lists_the_code_and_writes_the_same_bytes_in_another_process(make_pipe, tmp_path):
    _, staged = stage_with_code(make_pipe, tmp_path, "lmlp")
    out = tmp_path / "cli"
    command = [sys.executable, "-m", "diffusers_lmlp.hub", "push", str(tmp_path / "saved-lmlp"), "owner/tiny-lmlp"]
    env = {**os.environ, "PYTHONHASHSEED": "12345"}  # set and dict orders must not reach the files
    command += ["--dry-run", "--with-code", "--output-dir", str(out)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    header = (
        f"Dry run, nothing was uploaded. The folder that would be uploaded to the model repo owner/tiny-lmlp: {out}"
    )
    assert header in result.stdout
    assert "  pipeline_lmlp.py\n" in result.stdout and "  transformer/lmlp_transformer_2d.py\n" in result.stdout
    for path in (*CODE_FILES, "model_index.json"):
        assert (out / path).read_bytes() == (staged / path).read_bytes(), path


@pytest.mark.parametrize("key", ["..", "../escape", "ABSOLUTE", "transformer/..", "a\\b", ""])
def test_a_model_index_key_that_is_a_path_is_refused_before_anything_is_written(make_pipe, tmp_path, key, capsys):
    saved_pipeline(make_pipe, tmp_path / "saved")
    outside = tmp_path / "outside"  # an existing folder outside the staging folder, named by an absolute key
    outside.mkdir()
    key = str(outside) if key == "ABSOLUTE" else key
    index = json.loads((tmp_path / "saved" / "model_index.json").read_text())
    index[key] = ["diffusers_lmlp", "LMLPTransformer2DModel"]  # diffusers ignores a key its pipeline does not take
    (tmp_path / "saved" / "model_index.json").write_text(json.dumps(index))
    before = sorted(tmp_path.rglob("*"))

    argv = [
        "push",
        str(tmp_path / "saved"),
        "owner/x",
        "--dry-run",
        "--with-code",
        "--output-dir",
        str(tmp_path / "up"),
    ]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert str(exit_info.value.code) == (
        f"error: {tmp_path / 'saved' / 'model_index.json'} has the key {key!r}, which is not a component name: each "
        "key names a folder of the pipeline (a Python identifier such as 'transformer'), never a path. Fix or remove "
        "that entry."
    )
    assert sorted(tmp_path.rglob("*")) == before  # nothing written: no staging folder, no file outside it
    assert not list(outside.iterdir()) and not (tmp_path / "lmlp_transformer_2d.py").exists()


def test_code_is_generated_for_the_pipeline_s_components_only(make_pipe, tmp_path):
    saved_pipeline(make_pipe, tmp_path / "saved")
    index = json.loads((tmp_path / "saved" / "model_index.json").read_text())
    # An entry the pipeline does not take, naming the package, would get no code: refused, naming it.
    (tmp_path / "saved" / "model_index.json").write_text(
        json.dumps({**index, "extra": ["diffusers_lmlp", "LMLPTransformer2DModel"]})
    )
    with pytest.raises(ValueError) as error:
        stage_pipeline(tmp_path / "saved", "owner/x", tmp_path / "up", with_code=True)
    assert str(error.value).endswith(
        "model_index.json names LMLPTransformer2DModel under 'extra', which is not a component of LMLPPipeline (it "
        "takes scheduler, text_encoder, tokenizer, transformer, vae): remove that entry."
    )
    assert not (tmp_path / "up").exists()

    # One naming a library (which diffusers loads itself): kept as it is, and no code is generated for it.
    files, with_code_index = remote_code_files({**index, "extra": ["diffusers", "AutoencoderKL"]})
    assert set(files) == CODE_FILES and with_code_index["extra"] == ["diffusers", "AutoencoderKL"]


def test_with_code_entries_are_mapped_by_one_function_that_only_looks_at_the_loaded_package(monkeypatch):
    from diffusers_lmlp.hub import remote_code
    from diffusers_lmlp.pipelines import model_index, pipeline_lmlp

    # The push and LMLPPipeline.from_pretrained share it, and the pipeline's remote code carries it.
    assert remote_code.package_model_index is pipeline_lmlp.package_model_index is model_index.package_model_index
    assert "def package_model_index(" in bundle_source(defining_module_of("LMLPPipeline"), "LMLPPipeline")
    with_code = {
        "_class_name": ["pipeline_lmlp", "LMLPPipeline"],
        "transformer": ["lmlp_transformer_2d", "LMLPTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKL"],
        "other": ["lmlp_other", "NoSuchClass"],
        "_diffusers_version": "0.42.0",
    }
    expected = {
        **with_code,
        "_class_name": "LMLPPipeline",
        "transformer": ["diffusers_lmlp", "LMLPTransformer2DModel"],
    }
    assert model_index.package_model_index(with_code) == expected
    assert model_index.package_model_index(expected) == expected

    # A class the package exports lazily counts; without the package loaded nothing changes, and nothing is imported.
    lazy = type(sys)("diffusers_lmlp")

    def exported_lazily(name):
        if name in ("LMLPPipeline", "LMLPTransformer2DModel"):
            return LMLPPipeline
        raise AttributeError(name)

    lazy.__getattr__ = exported_lazily
    monkeypatch.setitem(sys.modules, "diffusers_lmlp", lazy)
    assert model_index.package_model_index(with_code) == expected
    monkeypatch.delitem(sys.modules, "diffusers_lmlp")
    assert model_index.package_model_index(with_code) == with_code
    assert "diffusers_lmlp" not in sys.modules
