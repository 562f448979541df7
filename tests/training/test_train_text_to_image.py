"""examples/train_text_to_image.py on a tiny pipeline and imagefolder, as a subprocess or in this process (`main`)."""

import contextlib
import importlib.util
import io
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from space_server import free_port  # noqa: F401  (the tests that launch several processes import it here)

import diffusers_lmlp.hub
import diffusers_lmlp.train
from diffusers_lmlp import LMLPPipeline
from diffusers_lmlp.tiny import build_tiny_pipeline


SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_text_to_image.py"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def make_workspace(root: Path) -> Path:
    """A tiny saved pipeline (16 px images) and an imagefolder of 24 images with caption lists (one has two)."""
    for family, name in (("lmlp", "tiny"), ("moe_mlp", "tiny-moe"), ("asymmixer", "tiny-asym")):
        build_tiny_pipeline(family).save_pretrained(root / name)
    (data := root / "data").mkdir()
    rng = np.random.default_rng(0)
    with open(data / "metadata.jsonl", "w") as f:
        for i in range(24):
            Image.fromarray(rng.integers(0, 255, (20, 18, 3), dtype=np.uint8)).save(data / f"{i}.png")
            text = ["a red circle", "a blue square"] if i == 0 else [["a red circle", "a blue square"][i % 2]]
            f.write(json.dumps({"file_name": f"{i}.png", "text": text}) + "\n")
    return root


def train(workspace: Path, output: str, *extra: str, base: str = "tiny", check: bool = True, launcher=(), env=None):
    """Run the script on the tiny pipeline and imagefolder; `launcher` goes between python and the script."""
    args = [sys.executable, *launcher, str(SCRIPT), *train_args(workspace, output, base), *extra]
    result = subprocess.run(args, env=env or ENV, capture_output=True, text=True, timeout=600)
    if check and result.returncode:
        raise AssertionError(f"training failed ({result.returncode}):\n{result.stderr[-4000:]}")
    return result


def train_here(workspace, output, *extra, base="tiny", data_option="--train_data_dir") -> SimpleNamespace:
    """`train`'s run in this process, on one thread; returns its `stdout` and `stderr` (with the INFO records)."""
    threads, root, stdout, stderr = torch.get_num_threads(), logging.getLogger(), io.StringIO(), io.StringIO()
    log, level = logging.StreamHandler(stderr), root.level
    log.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))  # the trainer's format
    root.addHandler(log)
    root.setLevel(logging.INFO)
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            diffusers_lmlp.train.main(
                [*train_args(workspace, output, base, data_option), "--num_threads", "1", *extra]
            )
    except BaseException:
        sys.stderr.write(f"{stdout.getvalue()[-2000:]}\n{stderr.getvalue()[-4000:]}")
        raise
    finally:
        root.removeHandler(log)
        root.setLevel(level)
        torch.set_num_threads(threads)
    return SimpleNamespace(stdout=stdout.getvalue(), stderr=stderr.getvalue())


def train_args(workspace, output, base="tiny", data_option="--train_data_dir", data=None) -> list[str]:
    """The tiny pipeline `base` on the imagefolder (or `data`), 16 px, batch 4, into `output` (in `workspace`)."""
    return [
        "--pretrained_model_name_or_path", str(workspace / base), data_option, str(data or workspace / "data"),
        "--resolution", "16", "--train_batch_size", "4", "--report_to", "none", "--output_dir", str(workspace / output),
        "--cache_dir", str(workspace / "cache"), "--lr_warmup_steps", "0", "--learning_rate", "1e-3"
    ]  # fmt: skip


def load_script():
    """A fresh copy of the script's command (`diffusers_lmlp.train`), to run in this process."""
    spec = importlib.util.spec_from_file_location("train_text_to_image", diffusers_lmlp.train.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "transformer" / "diffusion_pytorch_model.safetensors")


def assert_same_weights(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Bit for bit, the same tensors under the same names."""
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


@pytest.mark.slow
def test_trains_and_saves_a_loadable_pipeline_with_card_and_grid(workspace, monkeypatch):
    for name in ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES"):  # a user's would be kept
        monkeypatch.delenv(name, raising=False)
    base = weights(workspace / "tiny")
    result = train_here(
        workspace, "run", "--max_train_steps", "3", "--checkpointing_steps", "2", "--use_ema",
        "--validation_prompts", "a red circle", "a blue square", "--validation_steps", "2",
        "--validation_inference_steps", "2", "--pretrained_vae", str(workspace / "tiny"), "--vae_subfolder", "vae",
        "--pretrained_text_encoder", str(workspace / "tiny"), "--text_encoder_subfolder", "text_encoder",
        "--latent_scale", "0.5", "--gradient_checkpointing", "--max_grad_norm", "0.5", "--random_flip"
    )  # fmt: skip
    out = workspace / "run"
    assert "steps: 100%" in result.stderr and "loss=" in result.stderr
    assert "CPU memory: glibc keeps up to 1 GiB of freed buffers for reuse" in result.stderr
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    for part in ("transformer", "transformer_ema"):
        assert (out / "checkpoint-2" / part / "diffusion_pytorch_model.safetensors").is_file()
    assert (out / "validation" / "step-0000002.png").is_file() and (out / "samples.png").is_file()
    card = (out / "README.md").read_text()
    assert "library_name: diffusers" in card and "pipeline_tag: text-to-image" in card and "samples.png" in card
    summary = json.loads((out / "training_summary.json").read_text())
    assert summary["num_processes"] == 1 and summary["ranks_in_sync"] and summary["steps"] == 3
    # What a push publishes names no folder of this machine.
    published = [p for p in out.rglob("*.*") if p.suffix in {".json", ".md"} and p.parts[len(out.parts)] != "logs"]
    assert "3 steps on the local folder `data`" in card and len(published) > 5
    assert not [str(p) for p in published if str(workspace) in p.read_text()]
    assert json.loads((out / "vae" / "config.json").read_text())["scaling_factor"] == 0.5  # travels with the pipeline

    pipe = LMLPPipeline.from_pretrained(out)
    assert any(not torch.equal(pipe.transformer.state_dict()[k], base[k]) for k in base)  # it learned something
    assert pipe("a red circle", num_inference_steps=2, output_type="np").images.shape == (1, 16, 16, 3)


@pytest.mark.slow
def test_gradient_accumulation_matches_the_large_batch(workspace, tmp_path):
    train_here(workspace, tmp_path / "big", "--max_train_steps", "2", "--train_batch_size", "8")
    steps = ("--max_train_steps", "2", "--train_batch_size", "4", "--gradient_accumulation_steps", "2")
    train_here(workspace, tmp_path / "accum", *steps)
    big, accum, base = weights(tmp_path / "big"), weights(tmp_path / "accum"), weights(workspace / "tiny")
    assert any(not torch.equal(big[k], base[k]) for k in big)
    torch.testing.assert_close(accum, big, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("base, extra, model_class", [
    ("tiny-moe", ["--load_balance_weight", "0.01", "--snr_gamma", "5.0", "--noise_offset", "0.05", "--mixed_precision",
                  "bf16"], "MoEMLPModel"),
    ("tiny-asym", ["--symmetry_breaking_weight", "0.01"], "AsymMixerTransformer2DModel")
], ids=["moe-load-balancing-min-snr-noise-offset-bf16", "asymmixer-symmetry-breaking"])  # fmt: skip
def test_the_family_losses_train(workspace, base, extra, model_class):
    train_here(workspace, f"{base}-run", "--max_train_steps", "2", *extra, base=base)
    config = json.loads((workspace / f"{base}-run" / "transformer" / "config.json").read_text())
    assert config["_class_name"] == model_class and (workspace / f"{base}-run" / "model_index.json").is_file()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--model_type", "transformer"], "argument --model_type: invalid choice: 'transformer'"),
        (["--symmetry_breaking_weight", "0.01"], "weight: LMLPTransformer2DModel has no symmetry-breaking"),
        (["--caption_column", "caption"], "--caption_column 'caption' is not a column of the dataset"),
        (["--resume_from_checkpoint", "no/such/checkpoint"], "no/such/checkpoint: no such checkpoint folder"),
        (["--model_type", "moe_mlp"], "--model_type moe_mlp conflicts with the base pipeline"),
        (["--load_balance_weight", "0.01"], "--load_balance_weight applies to MoE-MLP backbones only"),
        (["--random_flip", "--cache_features"], "--random_flip cannot be combined with --cache_features"),
        (["--resolution", "32", "--cache_features"], "--resolution 32 does not match the model: sample_size 8 × VAE "
         "factor 2 = 16 px. Token mixing is over a fixed number of tokens: pass --resolution 16 (a fine-tuned model"),
        (["--push_to_hub", "--hub_model_id", "a/b/c"], "--hub_model_id 'a/b/c' is not a valid Hub repo id"),
        (["--seed", "-1"], "argument --seed: must be >= 0 and < 4294967296 (numpy's 32-bit seeds"),
        (["--seed", str(2**32)], f"(numpy's 32-bit seeds; every draw of the run comes from it), got {2**32}"),
    ],
)  # fmt: skip
def test_bad_arguments_fail_at_start_up_with_a_clear_message(script, workspace, tmp_path, extra, message, capsys):
    args = [*train_args(workspace, "bad"), "--max_train_steps", "1", "--cache_dir", str(tmp_path), *extra]
    with pytest.raises((SystemExit, ValueError)) as stopped:
        script.main(args)
    assert message in str(stopped.value) + capsys.readouterr().err
    assert not (workspace / "bad" / "checkpoint-1").exists() and not (tmp_path / "features").exists()


@pytest.mark.slow
def test_the_hub_token_reaches_the_upload_and_nothing_else(workspace, tmp_path, monkeypatch):
    secret, pushed = "hf_SECRETtest0123456789abcdefghijklmnop", {}

    def push_pipeline(folder, repo_id, token=None, commit_message=None):  # the upload, recording its arguments
        pushed.update(repo_id=repo_id, token=token)
        return SimpleNamespace(commit_url=f"https://huggingface.co/{repo_id}/commit/0")

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(diffusers_lmlp.hub, "push_pipeline", push_pipeline)
    out = tmp_path / "secret"
    result = train_here(
        workspace, out, "--max_train_steps", "2", "--checkpointing_steps", "1", "--report_to", "tensorboard",
        "--validation_prompts", "a red circle", "--validation_steps", "1", "--validation_inference_steps", "1",
        "--push_to_hub", "--hub_model_id", "alice/tiny", "--hub_token", secret
    )  # fmt: skip
    assert pushed == {"repo_id": "alice/tiny", "token": secret} and "alice/tiny/commit/0" in result.stdout
    files, printed = [p for p in out.rglob("*") if p.is_file()], result.stdout + result.stderr
    hparams = next(p for p in files if p.name == "hparams.yml").read_text()
    assert "learning_rate" in hparams and "hub_model_id" in hparams  # the trackers still get the recipe
    assert any(p.name.startswith("events.out.tfevents") for p in files) and (out / "README.md") in files
    assert not [p for p in files if b"SECRETtest" in p.read_bytes()] and "SECRETtest" not in printed
