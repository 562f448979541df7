"""LoRA fine-tuning (`--lora_rank`): adapter and card, every block layer, exact resumes, the preset and the push."""

import contextlib
import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from documents import text as page_text
from safetensors.torch import load_file
from test_hub import HUB_TOKEN, hub_calls  # noqa: F401 (a fixture)
from test_train_text_to_image import ENV, assert_same_weights, train_here

from diffusers_lmlp import LMLPPipeline
from diffusers_lmlp.hub import push_lora
from diffusers_lmlp.hub.__main__ import main as hub_main
from diffusers_lmlp.hub.lora_card import SHIPPED_SHAPES_MODEL, names_in_block
from diffusers_lmlp.models import FAMILIES
from diffusers_lmlp.tiny import build_tiny_pipeline
from diffusers_lmlp.training.components import add_lora, lora_config


LORA = ["--lora_rank", "2", "--lora_alpha", "4", "--max_train_steps", "4", "--checkpointing_steps", "2"]
LORA_FILE = "pytorch_lora_weights.safetensors"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")  # as the workspace it writes in: a second set-up would find its run
def lora_run(workspace) -> Path:
    """An uninterrupted 4-step LoRA run with checkpoints at steps 2 and 4."""
    result = train_here(workspace, "lora", *LORA, "--cache_features")
    assert "LoRA rank 2, alpha 4: 15 layers adapted" in result.stderr
    assert 'pipe.load_lora_weights("' in result.stdout  # the end-of-run summary says how to load it
    return workspace / "lora"


def block_linears(model: torch.nn.Module) -> set[str]:
    """Every nn.Linear inside the blocks, found without the registry's target names."""
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    return {n for n in names if n.startswith("stack.") and names_in_block([n])}


@pytest.mark.slow
def test_the_output_is_a_card_and_a_lora_file_of_every_block_linear_loading_as_the_merged_weights(lora_run, workspace):
    assert sorted(p.name for p in lora_run.iterdir() if p.name != ".train.lock") == [
        "README.md", "checkpoint-2", "checkpoint-4", LORA_FILE, "training_summary.json"
    ]  # fmt: skip
    assert sorted(p.name for p in (lora_run / "checkpoint-2").iterdir() if p.is_dir()) == ["transformer_lora"]
    card = (lora_run / "README.md").read_text()
    assert "- lora" in card and "rank 2, alpha 4" in card and 'pipe.load_lora_weights("lora")' in card
    assert "`left`, `right`, `merge`, `joint_mlp.fc1`, `joint_mlp.fc2` in the blocks" in card
    summary = json.loads((lora_run / "training_summary.json").read_text())
    assert summary["base_model"] == str(workspace / "tiny") and summary["steps"] == 4
    state = load_file(lora_run / LORA_FILE)
    adapted = {key.removeprefix("transformer.").rsplit(".lora_", 1)[0] for key in state}
    base = LMLPPipeline.from_pretrained(workspace / "tiny").transformer
    assert adapted == block_linears(base)  # no layer silently skipped, none outside the blocks
    assert all(state[k].abs().sum() > 0 for k in state if "lora_B" in k)  # B starts at 0: every layer learned
    pipe = LMLPPipeline.from_pretrained(workspace / "tiny")
    pipe.load_lora_weights(lora_run)  # as W + (alpha / r) B A: test_lora_loading.py checks it for this file's writer
    assert [(c.r, c.lora_alpha) for c in pipe.transformer.peft_config.values()] == [(2, 4)]


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra, refused",
    [(LORA, None), (LORA[4:], "is a checkpoint of a run that trained a LoRA adapter: resume it with --lora_rank"),
     (["--lora_rank", "3", *LORA[4:]], "does not fit this run's adapter")],
    ids=["same-adapter", "full-run", "other-rank"],
)  # fmt: skip
def test_a_lora_checkpoint_resumes_exactly_and_only_into_its_adapter(lora_run, tmp_path, workspace, extra, refused):
    out = tmp_path / "resumed"
    shutil.copytree(lora_run / "checkpoint-2", out / "checkpoint-2")
    with pytest.raises(SystemExit, match=refused) if refused else contextlib.nullcontext():
        result = train_here(workspace, str(out), *extra, "--cache_features", "--resume_from_checkpoint", "latest")
    if not refused:
        assert f"resumed from {out / 'checkpoint-2'} at step 2" in result.stderr
        assert_same_weights(load_file(out / LORA_FILE), load_file(lora_run / LORA_FILE))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_default_targets_are_every_block_linear_of_each_family(family):
    model = build_tiny_pipeline(family).transformer
    linears = block_linears(model)
    adapted = add_lora(model, lora_config(model, rank=2, alpha=None, dropout=0.0, target_modules=None))
    if FAMILIES[family].lora_target_parameters:  # tied weights, adapted as parameters of their MLP module
        linears |= {n for n, _ in model.named_modules() if n.endswith(("token_mlp", "channel_mlp"))}
    assert set(adapted) == linears
    assert all(not p.requires_grad for n, p in model.named_parameters() if ".lora_" not in n)  # the base is frozen


def test_named_targets_adapt_only_those_layers_and_unknown_names_are_refused():
    model = build_tiny_pipeline("lmlp").transformer
    adapted = add_lora(model, lora_config(model, 2, None, 0.0, ["left", "right"]))
    assert set(names_in_block(adapted)) == {"left", "right"}
    model = build_tiny_pipeline("moe_mlp").transformer
    with pytest.raises(SystemExit, match=r"--lora_target_modules left: no nn.Linear layer .* left\.gates\.0"):
        add_lora(model, lora_config(model, 2, None, 0.0, ["left"]))  # the MoE's left is no Linear: its gates are


@pytest.mark.slow
def test_the_documented_shapes_lora_preset_runs_offline_and_scores_before_and_after(tmp_path):
    # docs/training.md's LoRA command as written, shortened: the shipped shapes model learns the held-out combinations.
    (documented,) = [
        line for line in page_text("docs/training.md").splitlines()
        if line.startswith("accelerate launch") and "shapes-lora" in line
    ]  # fmt: skip
    argv, out = shlex.split(documented), tmp_path / "out"
    shorter = "--max_train_steps 2 --validation_inference_steps 2 --final_evaluation_inference_steps 2 --output_dir"
    command = [sys.executable, "-m", "accelerate.commands.launch", *argv[2:], *shorter.split(), str(out)]
    command += ["--cache_dir", str(tmp_path / "cache")]
    result = subprocess.run(command, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    summary, card = json.loads((out / "training_summary.json").read_text()), (out / "README.md").read_text()
    assert set(summary["scores"]) == set(summary["scores_before"]) == {"train", "held-out"}
    assert "train: base" in result.stdout and "held-out: LoRA" in result.stdout  # the table, side by side
    assert "pretrained_shapes_pipeline()" in result.stdout and "pipe.load_lora_weights(" in result.stdout
    assert "held-out: base | held-out: with LoRA" in card
    assert summary["base_model"] == SHIPPED_SHAPES_MODEL  # named by the function that loads it, not by its folder here
    assert "the shapes model that ships with diffusers-lmlp" in card and "pretrained_shapes_pipeline()" in card
    written = [p for p in out.glob("*.*") if p.suffix in {".json", ".md"}]
    assert len(written) == 2 and not [p.name for p in written if str(ROOT) in p.read_text()]
    assert not list(out.glob("**/diffusion_pytorch_model.safetensors"))  # the base is not copied


@pytest.mark.slow
def test_the_adapter_is_pushed_in_one_commit_of_its_dry_run_files(lora_run, hub_calls, tmp_path, capsys):  # noqa: F811
    (lora_run / "token.txt").write_text("hf_secret")  # a credential, and a link out of the folder: never uploaded
    (lora_run / "notes.json").symlink_to("/etc/hostname")
    up, hub = tmp_path / "up", ["push", str(lora_run), "alice/shapes-lora"]
    hub_main([*hub, "--dry-run", "--output-dir", str(up), "--base-model", "alice/tiny"])
    staged = sorted(str(p.relative_to(up)) for p in up.rglob("*") if p.is_file())
    assert staged == ["README.md", LORA_FILE, "training_summary.json"]
    assert "token.txt" in (printed := capsys.readouterr().out) and "notes.json" in printed  # refused, with the reason
    card = (up / "README.md").read_text()
    assert 'pipe = LMLPPipeline.from_pretrained("alice/tiny")' in card and "base_model: alice/tiny" in card
    assert 'pipe.load_lora_weights("alice/shapes-lora")' in card and "rank 2, alpha 4" in card  # the trainer's kept
    # The run's base was a local folder: the staged files name it by the Hub repo given, never by its path here.
    assert json.loads((up / "training_summary.json").read_text())["base_model"] == "alice/tiny"
    assert not [p.name for p in up.iterdir() if p.suffix != ".safetensors" and str(lora_run.parent) in p.read_text()]
    assert json.loads((lora_run / "training_summary.json").read_text())["base_model"] == str(lora_run.parent / "tiny")
    with pytest.raises(SystemExit) as refused:
        hub_main([*hub, "--dry-run", "--with-code"])
    assert refused.value.code == 2 and "apply to pipeline folders only" in capsys.readouterr().err
    # What the trainer's --push_to_hub does with --lora_rank, against a recording HfApi.
    commit = push_lora(lora_run, "shapes-lora", token=HUB_TOKEN, commit_message="End of training")
    assert [name for name, _ in hub_calls] == ["whoami", "create_repo", "create_commit"]
    files = hub_calls[-1][1]["files"]
    assert sorted(files) == staged and files[LORA_FILE] == (lora_run / LORA_FILE).read_bytes()
    assert not [path for path, data in files.items() if HUB_TOKEN.encode() in data]  # the token is in no file
    assert 'pipe.load_lora_weights("alice/shapes-lora")' in files["README.md"].decode()
    assert commit.commit_url.startswith("https://huggingface.co/alice/shapes-lora/")
