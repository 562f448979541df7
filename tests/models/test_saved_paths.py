"""`save_pretrained` never writes a folder of this machine (diffusers' `_name_or_path`), nor does a push."""

import json
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import torch
from diffusers.pipelines import pipeline_utils
from test_pipeline_loading import fill_hub_cache

from diffusers_lmlp import LMLPPipeline, LMLPTransformer2DModel
from diffusers_lmlp.models.loading import is_local_path


def saved_text(folder: Path) -> dict[str, str]:
    return {
        path.relative_to(folder).as_posix(): path.read_text(encoding="utf-8")
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.suffix in {".json", ".txt", ".md"}
    }


def configs(folder: Path) -> dict[str, dict]:
    names = ["model_index.json", *(p.relative_to(folder).as_posix() for p in folder.glob("*/*config.json"))]
    return {name: json.loads((folder / name).read_text()) for name in names if "tokenizer" not in name}


def test_a_pipeline_or_backbone_loaded_from_a_folder_saves_and_pushes_no_path_of_this_machine(
    pipe, generate, tmp_path, monkeypatch
):
    pipe.save_pretrained(tmp_path / "first")  # built in memory: nothing was loaded from anywhere
    loaded = LMLPPipeline.from_pretrained(tmp_path / "first")
    assert loaded.vae.config._name_or_path == str(tmp_path / "first" / "vae")  # what diffusers records

    loaded.save_pretrained(tmp_path / "second")
    for name, text in saved_text(tmp_path / "second").items():
        assert str(tmp_path) not in text, name
    # Nothing else changed: every diffusers config reads as the one saved before the load, key for key.
    assert configs(tmp_path / "second") == configs(tmp_path / "first")
    # The pipeline in memory still knows where it came from, and the saved one loads and samples the same.
    assert loaded.name_or_path == str(tmp_path / "first")
    assert loaded.vae.config._name_or_path == str(tmp_path / "first" / "vae")
    again = LMLPPipeline.from_pretrained(tmp_path / "second")
    again.set_progress_bar_config(disable=True)
    torch.testing.assert_close(generate(again), generate(pipe), rtol=0, atol=0)

    backbone = LMLPTransformer2DModel.from_pretrained(tmp_path / "first", subfolder="transformer")
    backbone.save_pretrained(tmp_path / "backbone")
    assert "_name_or_path" not in json.loads((tmp_path / "backbone" / "config.json").read_text())
    # diffusers' own push, its Hub calls replaced; the upload reads the folder as it would be sent.
    uploaded = {}
    monkeypatch.setattr(pipeline_utils, "create_repo", lambda repo_id, **kwargs: SimpleNamespace(repo_id=repo_id))
    card = huggingface_hub.ModelCard("---\n---\n")
    monkeypatch.setattr(pipeline_utils, "load_or_create_model_card", lambda *args, **kwargs: card)
    upload = lambda self, folder, repo_id, **kwargs: uploaded.update(saved_text(Path(folder)))  # noqa: E731
    monkeypatch.setattr(LMLPPipeline, "_upload_folder", upload)
    loaded.transformer = torch.compile(loaded.transformer)  # diffusers saves the module inside
    loaded.save_pretrained(tmp_path / "push", push_to_hub=True, repo_id="user/tiny-lmlp")
    assert "model_index.json" in uploaded and "vae/config.json" in uploaded
    assert not [name for name, text in uploaded.items() if str(tmp_path) in text]


def test_a_pipeline_loaded_by_repo_id_keeps_the_id_and_leaves_out_the_cache(pipe, tmp_path, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    pipe.save_pretrained(tmp_path / "saved")
    fill_hub_cache(tmp_path / "saved", tmp_path / "cache", "user/tiny-lmlp")
    loaded = LMLPPipeline.from_pretrained("user/tiny-lmlp", cache_dir=tmp_path / "cache")
    assert str(tmp_path / "cache") in loaded.vae.config._name_or_path  # the snapshot, in this machine's cache

    loaded.save_pretrained(tmp_path / "again")
    texts = saved_text(tmp_path / "again")
    assert not [name for name, text in texts.items() if str(tmp_path) in text]
    assert json.loads(texts["model_index.json"])["_name_or_path"] == "user/tiny-lmlp"  # where it came from


def test_what_counts_as_a_path_of_this_machine(tmp_path, monkeypatch):
    assert is_local_path("/home/user/models/vae")
    assert not any(map(is_local_path, ["stabilityai/sd-vae-ft-mse", "user/tiny-lmlp", None, 3]))
    (tmp_path / "lmlp-shapes").mkdir()  # a relative folder that exists here counts as local
    monkeypatch.chdir(tmp_path)
    assert is_local_path("lmlp-shapes") and not is_local_path("lmlp-other")
