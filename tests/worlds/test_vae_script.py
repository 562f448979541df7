"""scripts/train_vae.py's two stages as docs/training.md runs them; the decoder stage trains the decoder only."""

import json
import shlex
from pathlib import Path

import pytest
import torch
from documents import block
from safetensors.torch import load_file


SCRIPT = "train_vae"
# A VAE of the script's layout, as small as its GroupNorms allow, trained for two steps on eight renders.
TINY = ["--steps", "2", "--batch-size", "4", "--num-images", "8", "--block-out-channels", "8", "8", "8"]


def saved(folder: Path) -> tuple[dict[str, torch.Tensor], dict]:  # a saved VAE's weights and config
    return load_file(folder / "diffusion_pytorch_model.safetensors"), json.loads((folder / "config.json").read_text())


@pytest.mark.slow  # trains the VAE's stages (about 4 s)
def test_the_documented_stages_train_the_decoder_alone_and_keep_the_latents(script, tmp_path, monkeypatch):
    # docs/training.md's two commands, run as written with tiny sizes added (argparse's last value wins).
    commands = block("docs/training.md", "The shapes VAE").strip().splitlines()
    assert len(commands) == 2 and "--decoder-from shapes-vae --latent-noise 0.4" in commands[1]
    monkeypatch.chdir(tmp_path)
    for command in commands:
        argv = shlex.split(command)
        assert argv[:2] == ["python", "scripts/train_vae.py"]
        script.main([*argv[2:], *TINY])
    before, before_config = saved(tmp_path / "shapes-vae")
    after, after_config = saved(tmp_path / "shapes-vae-decoder")
    assert before.keys() == after.keys()
    frozen = [key for key in before if key.startswith(("encoder.", "quant_conv."))]
    trained = [key for key in before if key.startswith(("decoder.", "post_quant_conv."))]
    assert frozen and trained and len(frozen) + len(trained) == len(before)
    assert [key for key in frozen if not torch.equal(before[key], after[key])] == []
    assert [key for key in trained if torch.equal(before[key], after[key])] == []  # no decoder layer left as it was
    assert after_config["scaling_factor"] == before_config["scaling_factor"]  # set by the first stage only


def test_the_latent_noise_is_drawn_per_image_in_units_of_the_scaled_latents(script):
    noise = script.latent_noise(torch.Size((4000, 8, 8, 8)), 0.4, 0.5, torch.Generator().manual_seed(0))
    per_image = (noise * 0.5).flatten(1).std(dim=1)  # (b,): in the backbone's units
    assert per_image.max() < 0.4 * 1.15  # at most --latent-noise, up to the estimate's spread over 512 values
    assert per_image.mean() == pytest.approx(0.2, abs=0.01)  # U(0, 0.4) on average
    assert per_image.min() < 0.02  # nearly exact latents are drawn too


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        *[(["--lr", v], f"--lr must be a finite number > 0, got {float(v)}") for v in ("0", "inf")],
        *[(["--latent-noise", v], f"--latent-noise must be a finite number >= 0, got {v}") for v in ("-0.1", "nan")],
        (["--decoder-from", "missing"], "--decoder-from missing has no config.json: pass a folder saved by this"),
    ],
)
def test_bad_arguments_are_refused_before_any_training(script, capsys, argv, says):
    with pytest.raises(SystemExit) as error:
        script.main(argv)
    assert error.value.code == 2 and says in capsys.readouterr().err


@pytest.mark.parametrize("where", ["loss", "weights"])
def test_a_diverging_run_stops_and_writes_nothing(script, tmp_path, monkeypatch, where):
    losses, finite_loss, trained = [], script.reconstruction_loss, script.train

    def diverging_loss(*args):  # finite at the first step, NaN from the second on
        losses.append(finite_loss(*args))
        return losses[-1] if len(losses) == 1 else losses[-1] * float("nan")

    def train_then_overflow(vae, *args):  # every loss finite, and the last update overflowed a weight
        seconds = trained(vae, *args)
        vae.decoder.conv_out.weight.data[0, 0, 0, 0] = float("nan")
        return seconds

    if where == "loss":
        monkeypatch.setattr(script, "reconstruction_loss", diverging_loss)
        match = r"loss is nan at step 2 of 2: training diverged and nothing was saved\. Lower --lr \(it is 0\.002\)"
    else:
        monkeypatch.setattr(script, "train", train_then_overflow)
        match = r"1 of the trained VAE.s tensors hold NaN or inf \(decoder\.conv_out\.weight\), so it was not saved"
    with pytest.raises(script.DivergedError, match=match):
        script.main([*TINY, "--output-dir", str(tmp_path / "vae")])
    assert not (tmp_path / "vae").exists() and len(losses) == (2 if where == "loss" else 0)


@pytest.mark.slow
def test_the_documented_emoji_vae_command_trains_on_the_training_pictures(script, tmp_path, capsys, monkeypatch):
    # docs/emoji.md's command, run as written with tiny sizes added (argparse's last value wins).
    argv = shlex.split(block("docs/emoji.md", "The components, trained on the world").strip().splitlines()[1])
    assert argv[:4] == ["python", "scripts/train_vae.py", "--world", "emoji"]
    monkeypatch.chdir(tmp_path)
    script.main([*argv[2:], "--steps", "2", "--batch-size", "4", "--block-out-channels", "8", "8", "8"])
    report = json.loads(capsys.readouterr().out.split("reconstructions: ")[1])
    scores = ("clip top-1", "pixel top-1", "psnr")
    assert set(report) == {f"{split} {score}" for split in ("train", "heldout") for score in scores}
    assert all(0 <= report[key] <= 1 for key in report if "top-1" in key)
    _, config = saved(tmp_path / "emoji-vae")
    assert config["latent_channels"] == 8 and config["sample_size"] == 32
