"""`python -m diffusers_lmlp.analysis`: the measures on known matrices, both subcommands, their errors and the docs."""

import contextlib
import functools
import io
import json
import os
import re
import shlex
from pathlib import Path

import documents
import huggingface_hub
import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from test_pipeline_loading import fill_hub_cache

from diffusers_lmlp import LMLPTransformer2DModel, convert_lmlp_reference_state_dict
from diffusers_lmlp.analysis import lateralization
from diffusers_lmlp.analysis.__main__ import main
from diffusers_lmlp.analysis.layers import block_name, default_layers
from diffusers_lmlp.analysis.metrics import (
    diagonal_ratio,
    grid_distance,
    locality,
    noise_band,
    normalise,
    periodicity,
    token_mixing_measures,
)
from diffusers_lmlp.analysis.regions import TokenRegions
from diffusers_lmlp.analysis.routing import attention_probabilities
from diffusers_lmlp.models.mixers.attention import UViTAttention
from diffusers_lmlp.shapes.pretrained import PIPELINE_PATH
from diffusers_lmlp.tiny import build_tiny_pipeline


ROOT = Path(__file__).resolve().parents[2]
DOCS = documents.text("docs/analysis.md")
README_SECTION = documents.section("docs/analysis.md", "In short")  # the README's former "Look inside a model"
CAPTIONS = ["a red circle", "a blue square", "a green triangle"]
TINY = TokenRegions(text_seq_len=16, grid_size=4)  # the tiny pipelines' layout: L = 33, 3 blocks


def commands(text: str) -> list[str]:  # the analysis command lines of a Markdown text's bash blocks
    lines = "\n".join(re.findall(r"```bash\n(.*?)```", text, flags=re.DOTALL)).splitlines()
    return [line for line in lines if line.startswith("python -m diffusers_lmlp.analysis")]


pytestmark = pytest.mark.usefixtures("no_unpickling")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """Tiny pipeline folders of each backbone; the UL-MLP's layer 2 holds `gaussian_of_patch_distance(TINY)`."""
    root, folders = tmp_path_factory.mktemp("pipelines"), {}
    for backbone in ("lmlp", "moe_mlp", "uvit", "gmlp"):
        pipe = build_tiny_pipeline(backbone)
        if backbone == "lmlp":
            with torch.no_grad():
                pipe.transformer.stack.mid_block.left.weight.copy_(gaussian_of_patch_distance(TINY))
        pipe.save_pretrained(folders.setdefault(backbone, root / backbone))
    return folders


def run(*argv: str) -> str:  # the command, in this process: what it printed
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        main([*argv, "--no_progress"])
    return printed.getvalue()


def refusal(*argv: str) -> str:  # the message of a command that must stop with an error
    with pytest.raises(SystemExit) as stop:
        run(*argv)
    return " ".join(str(stop.value.code).split())


def gaussian_of_patch_distance(regions: TokenRegions) -> torch.Tensor:
    """(L, L) weak noise, with exp(−d² / 2) of the grid distance d in the image × image block."""
    matrix = 0.01 * torch.randn(regions.seq_len, regions.seq_len, generator=torch.Generator().manual_seed(0))
    image = slice(regions.image.start, regions.image.stop)
    matrix[image, image] += torch.exp(-(grid_distance(regions).double() ** 2) / 2).float()
    return matrix


def test_the_measures_find_locality_a_diagonal_and_row_periodicity_and_nothing_in_noise_as_do_attention_maps():
    regions, generator = TokenRegions(text_seq_len=7, grid_size=8), torch.Generator().manual_seed(0)
    L = regions.seq_len
    assert locality(normalise(gaussian_of_patch_distance(regions)), regions) > 10
    assert diagonal_ratio(normalise(torch.eye(L) + 0.1 * torch.rand(L, L, generator=generator))) > 5
    for _ in range(5):
        noise = normalise(torch.randn(L, L, generator=generator))
        assert locality(noise, regions) == pytest.approx(1, abs=0.1)
        assert diagonal_ratio(noise) == pytest.approx(1, abs=0.15)
        assert periodicity(noise, regions) == pytest.approx(0, abs=0.05)
    # Noise that depends on an image token's grid column only (the others keep their index) repeats once per row.
    position = torch.arange(L)
    position[regions.image.start :] = regions.text.stop + torch.arange(regions.num_patches) % regions.grid_size
    row_periodic = torch.randn(L, L, generator=generator)[position][:, position]
    assert periodicity(normalise(row_periodic), regions) > 0.9
    index = torch.arange(L, dtype=torch.float64)  # a smooth trend: every shift correlates about as well
    assert abs(periodicity(normalise(index[:, None] + index[None, :]), regions)) < 0.05
    # The attention maps routing draws are what the module computes.
    attention, tokens = UViTAttention(hidden_size=32, num_heads=4).eval(), torch.randn(2, 9, 32, generator=generator)
    probabilities = attention_probabilities(attention, tokens)  # (B, H, L, L)
    value = attention.qkv(tokens).reshape(2, 9, 3, 4, 8)[:, :, 2].transpose(1, 2)  # (B, H, L, D/H)
    mixed = (probabilities @ value).transpose(1, 2).reshape(2, 9, 32)
    assert torch.allclose(attention.proj(mixed), attention(tokens), atol=1e-5)
    # The grid distance, the default layers, and the measures a layout cannot define.
    blocks = ["in_blocks.0", "in_blocks.4", "mid_block", "out_blocks.3", "out_blocks.7"]  # nnet_vis.py's, depth 16
    assert [block_name(layer, 17) for layer in default_layers(17)] == blocks
    assert [default_layers(n) for n in (13, 9, 3, 1)] == [[1, 4, 7, 10, 13], [1, 3, 5, 7, 9], [1, 2, 3], [1]]
    distance = grid_distance(TokenRegions(text_seq_len=3, grid_size=3))
    assert distance[0].tolist() == [0, 1, 2, 1, 2, 3, 2, 3, 4]  # patch (0, 0) to the row-major 3 × 3 grid
    one_patch = token_mixing_measures(torch.randn(5, 5), TokenRegions(text_seq_len=3, grid_size=1))
    assert one_patch["locality"] is None and one_patch["periodicity"] is None
    assert token_mixing_measures(torch.ones(33, 33), TINY)["diagonal"] is None  # constant: normalised to zeros
    measures = functools.partial(token_mixing_measures, regions=TINY)
    band = noise_band(measures, TINY.seq_len, draws=50)
    assert band == noise_band(measures, TINY.seq_len, draws=50)
    assert band["locality"][0] < 1 < band["locality"][1] and band["periodicity"][0] < 0 < band["periodicity"][1]


def test_lateralization_of_a_ul_mlp_pipeline_folder_writes_its_weights_and_measures(saved, tmp_path):
    printed = run("lateralization", "--pipeline", str(saved["lmlp"]), "--output_dir", str(tmp_path))
    report = json.loads((tmp_path / "lateralization.json").read_text())
    assert report["model"] == "UL-MLP (LMLPTransformer2DModel)"
    assert report["regions"] == {"seq_len": 33, "time": [0, 1], "text": [1, 17], "image": [17, 33], "patch_grid": 4}
    blocks = [(entry["layer"], entry["block"]) for entry in report["layers"]]
    assert blocks == [(1, "in_blocks.0"), (2, "mid_block"), (3, "out_blocks.0")]
    weights = load_file(tmp_path / "lateralization.safetensors")
    assert sorted(weights) == [f"layer_{k}.{side}" for k in (1, 2, 3) for side in ("left", "right")]
    saved_weights = load_file(saved["lmlp"] / "transformer" / "diffusion_pytorch_model.safetensors")
    for entry in report["layers"]:
        left, right = weights[f"layer_{entry['layer']}.left"], weights[f"layer_{entry['layer']}.right"]
        assert torch.equal(left, saved_weights[f"stack.{entry['block']}.left.weight"])
        assert torch.equal(right, saved_weights[f"stack.{entry['block']}.right.weight"])
        assert (set(entry["left"]), set(entry["right"])) == ({"diagonal", "locality", "periodicity", "mean_abs"},
                                                             {"diagonal", "mean_abs"})  # fmt: skip
        assert entry["left"]["locality"] == pytest.approx(locality(normalise(left), TINY))
        assert entry["left"]["mean_abs"] == pytest.approx(left.double().abs().mean().item())
    localities = [entry["left"]["locality"] for entry in report["layers"]]
    assert localities[1] > 10 and localities[0] == pytest.approx(1, abs=0.3)  # the Gaussian, and the random init
    assert set(report["noise"]) == {"draws", "left", "right"}
    assert f"{report['layers'][1]['left']['locality']:.3f}" in printed and "i.i.d. Gaussian matrices" in printed
    assert printed.rstrip().endswith(str(tmp_path / "lateralization.safetensors"))
    figure = Image.open(tmp_path / "lateralization.png")
    assert figure.mode == "RGB" and figure.width > 3 * 256 and figure.height > 2 * 256


def test_an_moe_mlp_from_the_hub_cache_is_drawn_per_expert_and_head_and_routing_needs_its_whole_pipeline(
    saved, tmp_path, monkeypatch
):
    backbone = str(saved["moe_mlp"] / "transformer")  # 2 experts × 2 heads
    assert "is a backbone folder" in refusal("routing", "--pipeline", backbone, "--captions", "a red circle")
    fill_hub_cache(saved["moe_mlp"], tmp_path / "hub", "alice/tiny-moe")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    message = refusal("lateralization", "--pipeline", "alice/not-cached")
    assert "not in the huggingface_hub cache" in message and "HF_HUB_OFFLINE is set" in message
    printed = run("lateralization", "--pipeline", "alice/tiny-moe", "--output_dir", str(tmp_path))
    run("routing", "--pipeline", "alice/tiny-moe", "--captions", "a red circle", "--num_inference_steps", "2",
        "--output_dir", str(tmp_path))  # fmt: skip
    assert json.loads((tmp_path / "routing.json").read_text())["kind"] == "expert usage"
    report = json.loads((tmp_path / "lateralization.json").read_text())
    assert report["pipeline"] == "alice/tiny-moe"
    weights = load_file(tmp_path / "lateralization.safetensors")
    saved_weights = load_file(Path(backbone) / "diffusion_pytorch_model.safetensors")
    for entry in report["layers"]:
        assert [(left["head"], left["expert"]) for left in entry["left"]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
        experts = saved_weights[f"stack.{entry['block']}.left.expert_weight"]
        assert torch.equal(weights[f"layer_{entry['layer']}.left"], experts)  # (H, E, L, L)
    assert "left h1 e0" in printed  # five rows of panels (4 experts, the right hemisphere), the UL-MLP's two:
    assert Image.open(tmp_path / "lateralization.png").height > 5 * 256


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["lateralization", "--layers", "1", "4"], "No layer 4 in this model: it has 3 blocks, numbered 1–3 as the "
         "reference figure script numbers them (layer 1 is in_blocks.0, layer 2 is mid_block, layer 3 is "
         "out_blocks.0)"),
        (["lateralization", "--pipeline", "{tmp}/nowhere"], "no such folder"),
        (["lateralization", "--pipeline", "{lmlp}/model_index.json"], "not a folder"),
        (["lateralization", "--pipeline", "{tmp}"], "config.json does not exist"),
        (["lateralization", "--pipeline", "{lmlp}/vae"], "is not a backbone's config"),
        (["lateralization", "--pipeline", "{uvit}"], "this U-ViT (UViTTransformer2DModel) has no such blocks. Run "
         "`routing` on it instead"),
        (["lateralization", "--pipeline", "{gmlp}"], "this gMLP (GMLPTransformer2DModel) has no such blocks. Neither "
         "subcommand fits it"),
        (["routing", "--captions", "a"], "Run `lateralization` on it instead"),
        (["--help"], "{lateralization,routing} ... Look inside a trained backbone"),
        (["lateralization", "--help"], "--layers LAYERS [LAYERS ...]"),
        (["routing"], "the following arguments are required: --captions"),
        (["routing", "--captions", "a", "--batch_size", "0"], "--batch_size: must be >= 1, got 0"),
        (["lateralization", "--layers", "0"], "--layers: must be >= 1, got 0"),  # test_lazy_imports runs it too
        (["routing", "--captions", "a", "--num_inference_steps", "two"], "invalid int value: 'two'"),
        (["transplant"], "invalid choice: 'transplant'"),
    ],
    ids=lambda value: " ".join(value) if isinstance(value, list) else None,
)  # fmt: skip
def test_bad_options_layers_folders_and_models_are_refused_naming_the_fix(saved, tmp_path, capsys, argv, says):
    argv = [arg.format(tmp=tmp_path, **saved) for arg in argv]
    pipeline = [] if "--pipeline" in argv else ["--pipeline", str(saved["lmlp"])]
    with pytest.raises(SystemExit) as stop:
        main([*argv, *pipeline, "--output_dir", str(tmp_path), "--no_progress"])
    captured = capsys.readouterr()
    assert says in " ".join((captured.out + captured.err + str(stop.value.code)).split())
    assert not list(tmp_path.glob("*.json"))


def test_a_one_hot_router_shows_one_experts_full_usage_at_every_step(tmp_path):
    pipe = build_tiny_pipeline("moe_mlp")  # 2 experts × 2 heads
    with torch.no_grad():
        for block in (pipe.transformer.stack.in_blocks[0], pipe.transformer.stack.mid_block):
            for head, gate in enumerate(block.left.gates):
                gate.weight.zero_()
                gate.bias.copy_(torch.tensor([-50.0, 50.0]) * (1 if head == 0 else -1))  # head 0: e1, head 1: e0
    pipe.save_pretrained(tmp_path / "pipe")
    printed = run("routing", "--pipeline", str(tmp_path / "pipe"), "--captions", *CAPTIONS, "--num_inference_steps",
                  "3", "--batch_size", "2", "--output_dir", str(tmp_path / "out"))  # fmt: skip
    report = json.loads((tmp_path / "out" / "routing.json").read_text())
    assert report["kind"] == "expert usage" and report["captions"] == CAPTIONS and len(report["timesteps"]) == 3
    assert report["sampler"] == {"num_inference_steps": 3, "guidance_scale": 2.0, "seed": 0, "batch_size": 2}
    assert [entry["layer"] for entry in report["layers"]] == [1, 2, 3]  # every layer of an MoE-MLP
    for entry in report["layers"][:2]:
        head_0, head_1 = entry["heads"]
        assert head_0["usage"] == pytest.approx([0, 1]) and head_0["top1"] == [0, 1]
        assert head_1["usage"] == pytest.approx([1, 0]) and head_1["top1"] == [1, 0]
        assert head_0["cv"] == pytest.approx(1) and head_0["entropy"] == pytest.approx(0, abs=1e-9)
    untouched = report["layers"][2]["heads"][0]
    assert 0 < min(untouched["usage"]) and untouched["entropy"] > 0.9 and untouched["cv"] < 0.5
    data = load_file(tmp_path / "out" / "routing.safetensors")
    assert data["usage"].shape == (3, 3, 2, 2) and data["timesteps"].tolist() == report["timesteps"]
    assert torch.allclose(data["usage"].sum(-1), torch.ones(3, 3, 2))
    assert torch.equal(data["usage"][:, 0, 0, 1], torch.ones(3))  # layer 1, head 0, expert 1, at every step
    assert "load-balancing loss" in printed and report["balance_loss"] > 0
    assert Image.open(tmp_path / "out" / "routing.png").width > 2 * 160


def test_routing_a_uvit_draws_the_attention_of_the_lateralization_layers(saved, tmp_path):
    printed = run("routing", "--pipeline", str(saved["uvit"]), "--captions", *CAPTIONS, "--num_inference_steps", "2",
                  "--output_dir", str(tmp_path))  # fmt: skip
    report = json.loads((tmp_path / "routing.json").read_text())
    assert report["kind"] == "attention" and [entry["layer"] for entry in report["layers"]] == default_layers(3)
    assert set(report["layers"][0]["attention"]) == {"diagonal", "locality", "periodicity"}
    maps = load_file(tmp_path / "routing.safetensors")
    assert sorted(maps) == ["layer_1.attention", "layer_2.attention", "layer_3.attention"]
    assert torch.allclose(maps["layer_2.attention"].sum(-1), torch.ones(33))  # probabilities over the inputs
    measures = token_mixing_measures(maps["layer_2.attention"], TINY)
    assert report["layers"][1]["attention"]["locality"] == pytest.approx(measures["locality"], rel=1e-5)
    assert "periodicity" in printed and "attention:" in printed


@pytest.mark.slow
def test_the_readme_command_draws_the_shipped_model_as_docs_show_it(tmp_path, monkeypatch, capsys):
    [command, _] = commands(README_SECTION)
    assert command == "python -m diffusers_lmlp.analysis lateralization"  # the shipped shapes model, by default
    monkeypatch.chdir(tmp_path)
    main(shlex.split(command)[3:])
    assert "layers: 100% 5/5" in capsys.readouterr().err  # a progress bar (lines, in a log)
    report = json.loads(Path("analysis/lateralization.json").read_text())
    assert report["pipeline"] == "shapes" and report["regions"]["seq_len"] == 27
    assert [entry["layer"] for entry in report["layers"]] == [1, 3, 5, 7, 9]
    weights = load_file("analysis/lateralization.safetensors")
    shipped = load_file(PIPELINE_PATH / "transformer" / "diffusion_pytorch_model.safetensors")
    assert torch.equal(weights["layer_9.left"], shipped["stack.out_blocks.3.left.weight"])
    documented = ROOT / "docs" / "lateralization-shapes.png"  # this figure, small enough for the README
    assert documented.stat().st_size < 300_000
    paths = ("analysis/lateralization.png", documented)
    drawn, shown = (np.asarray(Image.open(path).convert("RGB"), dtype=np.float64) for path in paths)
    assert drawn.shape == shown.shape and np.abs(drawn - shown).mean() < 1


@pytest.mark.slow
def test_every_documented_command_runs_as_written(tmp_path, monkeypatch, saved):
    # docs/analysis.md's other commands, on tiny stand-ins and a narrow converted checkpoint of F2-deep's layout.
    documented = commands(DOCS)  # "In short" (the README's former section) included
    assert len(documented) == 9 and commands(README_SECTION) == documented[:2]
    monkeypatch.chdir(tmp_path)
    for name, backbone in (("lmlp-shapes-moe", "moe_mlp"), ("uvit-shapes", "uvit")):
        os.symlink(saved[backbone], name)
    reference = {f"{name}.l.weight": torch.randn(334, 334) for name in ("in_blocks.4", "out_blocks.7")}
    model = LMLPTransformer2DModel(hidden_size=32, text_embed_dim=32)
    model.load_state_dict(convert_lmlp_reference_state_dict(reference), strict=False)
    model.save_pretrained("ul-mlp-f2-deep")
    printed = {}
    for command in set(documented) - {documented[0]}:  # the first is the README's, which the test above runs
        argv = shlex.split(command)
        assert argv[:3] == ["python", "-m", "diffusers_lmlp.analysis"], command
        # 200 noise draws cost minutes at L = 334; only the table needs them.
        with pytest.MonkeyPatch.context() as patch:
            if "analysis-all-layers" not in command:
                patch.setattr(lateralization, "noise_band", functools.partial(noise_band, draws=10))
            printed[command] = run(*argv[3:], *(["--num_inference_steps", "2"] if argv[3] == "routing" else []))
    report = json.loads(Path("analysis-f2-deep/lateralization.json").read_text())
    assert [entry["layer"] for entry in report["layers"]] == [1, 5, 9, 13, 17]
    assert report["regions"]["text"] == [1, 78] and report["regions"]["image"] == [78, 334]
    weights = load_file("analysis-f2-deep/lateralization.safetensors")
    assert torch.equal(weights["layer_5.left"], reference["in_blocks.4.l.weight"])  # nnet_vis.py's "Layer 5"
    assert torch.equal(weights["layer_17.left"], reference["out_blocks.7.l.weight"])  # and its "Layer 17"
    assert json.loads(Path("analysis-emoji/lateralization.json").read_text())["regions"]["seq_len"] == 42
    assert json.loads(Path("analysis-moe/routing.json").read_text())["kind"] == "expert usage"
    assert json.loads(Path("analysis-uvit/routing.json").read_text())["kind"] == "attention"
    # The table docs/analysis.md shows is what the command prints for the shipped model's nine layers.
    [table] = re.findall(r"```text\n(.*?)```", DOCS, flags=re.DOTALL)
    all_layers = next(command for command in documented if "--layers 1 2 3 4 5 6 7 8 9" in command)
    assert printed[all_layers].startswith(table)
