"""U-ViT: fidelity to the reference `libs/uvit_t2i.py` (explicit per-head softmax(QKᵀ/√d)·V), cost, pipeline."""

import json
import math
import re

import pytest
import torch
import torch.nn.functional as F
from diffusers import DiffusionPipeline
from plain_torch import TINY, reference_skeleton_forward
from test_reference_conversion import reference_state_dict
from torch.utils.flop_counter import FlopCounterMode

from diffusers_lmlp import (
    LMLPPipeline,
    UViTTransformer2DModel,
    convert_uvit_reference_state_dict,
)
from diffusers_lmlp.complexity import complexity, transformer_block_macs
from diffusers_lmlp.models.families import FAMILIES, family_of
from diffusers_lmlp.models.mixers.attention import UViTBlock


def uvit_state_dict(depth, dim, seq_len, patch, channels, text_dim, mlp_hidden, qkv_bias=False, conv=True):
    """The reference U-ViT's tensors (libs/uvit_t2i.py): out blocks add `skip_linear`."""

    def block_tensors(p, rand, weight):
        sd = {
            p + "norm1.weight": rand(dim, offset=1.0),
            p + "norm1.bias": rand(dim),
            p + "attn.qkv.weight": weight(3 * dim, dim),
            p + "attn.proj.weight": weight(dim, dim),
            p + "attn.proj.bias": rand(dim),
            p + "norm2.weight": rand(dim, offset=1.0),
            p + "norm2.bias": rand(dim),
            p + "mlp.fc1.weight": weight(mlp_hidden, dim),
            p + "mlp.fc1.bias": rand(mlp_hidden),
            p + "mlp.fc2.weight": weight(dim, mlp_hidden),
            p + "mlp.fc2.bias": rand(dim),
        }
        if p.startswith("out_blocks"):
            sd |= {p + "skip_linear.weight": weight(dim, 2 * dim), p + "skip_linear.bias": rand(dim)}
        if qkv_bias:
            sd[p + "attn.qkv.bias"] = rand(3 * dim)
        return sd

    return reference_state_dict(depth, dim, seq_len, patch, channels, text_dim, block_tensors, conv, unit_weights=True)


def reference_attention(sd, p, h, num_heads):
    """Multi-head self-attention: qkv's 3D outputs are [q | k | v], each split into heads in order."""
    dim = h.shape[-1]
    head_dim = dim // num_heads
    qkv = F.linear(h, sd[p + "attn.qkv.weight"], sd.get(p + "attn.qkv.bias"))  # (B, L, 3D)
    heads = []
    for i in range(num_heads):
        channels = slice(i * head_dim, (i + 1) * head_dim)
        q = qkv[..., :dim][..., channels]
        k = qkv[..., dim : 2 * dim][..., channels]
        v = qkv[..., 2 * dim :][..., channels]
        weights = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(head_dim), dim=-1)  # (B, L, L)
        heads.append(weights @ v)
    return F.linear(torch.cat(heads, dim=-1), sd[p + "attn.proj.weight"], sd[p + "attn.proj.bias"])


def reference_forward(sd, x, context, n, depth, patch, num_heads):
    """The reference UViT forward (libs/uvit_t2i.py); `n` is the network timestep (1..1000)."""
    dim = sd["pos_embed"].shape[-1]

    def block(p, h, skip):
        if skip is not None:
            h = F.linear(torch.cat([h, skip], dim=-1), sd[p + "skip_linear.weight"], sd[p + "skip_linear.bias"])
        hn = F.layer_norm(h, (dim,), sd[p + "norm1.weight"], sd[p + "norm1.bias"])
        h = h + reference_attention(sd, p, hn, num_heads)
        hn = F.layer_norm(h, (dim,), sd[p + "norm2.weight"], sd[p + "norm2.bias"])
        hidden = F.gelu(F.linear(hn, sd[p + "mlp.fc1.weight"], sd[p + "mlp.fc1.bias"]))
        return h + F.linear(hidden, sd[p + "mlp.fc2.weight"], sd[p + "mlp.fc2.bias"])

    return reference_skeleton_forward(sd, x, context, n, depth, patch, block)


# Reference configs on the tiny skeleton: (depth, heads, qkv_bias, conv).
REFERENCE_CASES = {
    "4_layers_4_heads": (4, 4, False, True),
    "2_layers_2_heads_qkv_bias_no_conv": (2, 2, True, False),
    "mid_block_only_8_heads": (0, 8, False, True),
}


@pytest.mark.parametrize("case", REFERENCE_CASES)
def test_converted_tiny_model_matches_reference_forward(case):
    depth, heads, qkv_bias, conv = REFERENCE_CASES[case]
    config = dict(TINY, num_layers=depth, text_embed_dim=24, num_attention_heads=heads, qkv_bias=qkv_bias)
    model = UViTTransformer2DModel(**config, conv_out=conv).eval()
    sd = uvit_state_dict(depth, 32, 22, 2, 4, text_dim=24, mlp_hidden=128, qkv_bias=qkv_bias, conv=conv)
    model.load_state_dict(convert_uvit_reference_state_dict(sd), strict=True)

    gen = torch.Generator().manual_seed(1)
    x, context = torch.randn(3, 4, 8, 8, generator=gen), torch.randn(3, 5, 24, generator=gen)
    t = torch.tensor([0, 411, 999])  # diffusers timesteps; the network sees t + 1
    with torch.no_grad():
        ours = model(x, context, t).sample
        expected = reference_forward(sd, x, context, t + 1, depth=depth, patch=2, num_heads=heads)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_uvit_s2_reference_layout_loads_one_to_one_and_matches():
    model = UViTTransformer2DModel().eval()  # U-ViT-S/2
    sd = uvit_state_dict(12, 512, 334, 2, 4, text_dim=768, mlp_hidden=2048)
    # 11 top-level tensors, 11 per block in 13 blocks, skip_linear's 2 in 6 out blocks.
    assert len(sd) == 11 + 13 * 11 + 6 * 2 and sum(v.numel() for v in sd.values()) == 44_692_644
    converted = convert_uvit_reference_state_dict(sd)
    assert set(converted) == set(model.state_dict())
    model.load_state_dict(converted, strict=True)

    gen = torch.Generator().manual_seed(2)
    x, context, t = (
        torch.randn(1, 4, 32, 32, generator=gen),
        torch.randn(1, 77, 768, generator=gen),
        torch.tensor([499]),
    )
    with torch.no_grad():
        ours = model(x, context, t).sample
        expected = reference_forward(sd, x, context, t + 1, depth=12, patch=2, num_heads=8)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


def test_registered_as_the_uvit_family():
    family = FAMILIES["uvit"]
    assert family_of(UViTTransformer2DModel) is family
    assert (family.label, family.tag) == ("U-ViT", "u-vit")
    assert family.details(family.full_config({})) == ", 8 attention heads"


@pytest.mark.parametrize(
    "key, cause",
    [
        ("in_blocks.0.l.weight", r"L-MLP checkpoint .*convert_lmlp_reference_state_dict"),
        ("mid_block.proj.bias", r"L-MLP checkpoint"),
        ("in_blocks.2.skip_linear.weight", r"Only out blocks have a skip_linear"),
        ("label_emb.weight", r"another U-ViT .*libs/uvit.py"),
        ("time_embed.0.weight", r"another U-ViT"),
        ("param_groups", r"the network's own state dict"),
    ],
)
def test_converter_names_the_likely_cause_of_a_foreign_key(key, cause):
    with pytest.raises(ValueError, match=rf"Unexpected key '{re.escape(key)}'.*{cause}"):
        convert_uvit_reference_state_dict({key: torch.zeros(1)})


def test_bad_heads_and_skips_are_refused():
    with pytest.raises(ValueError, match=r"hidden_size \(32\) must be divisible by num_attention_heads \(3\)"):
        UViTTransformer2DModel(**TINY, num_attention_heads=3)
    with pytest.raises(ValueError, match="num_attention_heads='8' cannot build a UViTTransformer2DModel"):
        UViTTransformer2DModel(**TINY, num_attention_heads="8")
    x = torch.zeros(1, 22, 32)
    with pytest.raises(ValueError, match="skip_linear=True but got skip=None"):
        UViTBlock(32, 4, 4.0, 1e-5, skip=True)(x)
    with pytest.raises(ValueError, match="skip_linear=False but got skip=a tensor"):
        UViTBlock(32, 4, 4.0, 1e-5)(x, x)


def test_in_block_costs_lmlp_table3_transformer_block_and_out_block_adds_skip_linear():
    with torch.device("meta"):
        blocks = {skip: UViTBlock(512, 8, 4.0, 1e-5, skip=skip) for skip in (False, True)}
        x = torch.zeros(1, 334, 512)
        macs = {}
        for skip, block in blocks.items():
            with torch.no_grad(), FlopCounterMode(display=False) as counter:
                block(x, x if skip else None)
            macs[skip] = counter.get_total_flops() // 2
    assert macs[False] == transformer_block_macs(334, 512, 4) == 1_164_906_496  # (4 + 2s)·L·D² + 2·L²·D
    assert complexity({}, family="uvit").block_macs == macs[False]
    # (4 + 2s)·D² weights (Table 3), two LayerNorms, the biases of proj, fc1 and fc2 (qkv has none).
    params = {skip: sum(p.numel() for p in block.parameters()) for skip, block in blocks.items()}
    assert params[False] == 12 * 512**2 + 4 * 512 + 512 + 2048 + 512 == 3_150_848
    assert macs[True] - macs[False] == 334 * 2 * 512 * 512
    assert params[True] - params[False] == 2 * 512 * 512 + 512


def test_lmlp_table4_uvit_gmacs_leave_out_the_attention_matmuls():
    # L-MLP Table 4's 14.78 GMACs for U-ViT-S/2 come from ptflops, whose module hooks cannot see the functional
    # attention: our count without QKᵀ and softmax(QKᵀ)·V is within 0.3% of it, and 16.23 G with them.
    counted = complexity({}, family="uvit")
    without_attention_matmuls = counted.macs - counted.num_blocks * 2 * 334**2 * 512
    assert without_attention_matmuls == pytest.approx(14.78e9, rel=3e-3)
    assert counted.macs == pytest.approx(16.23e9, rel=1e-3)


def test_uvit_generates_in_lmlp_pipeline_and_round_trips_through_diffusion_pipeline(
    make_pipe, generate, tmp_path, monkeypatch
):
    uvit_pipe = make_pipe("uvit")
    images = generate(uvit_pipe)
    assert images.shape == (1, 3, 16, 16) and torch.isfinite(images).all()
    uvit_pipe.save_pretrained(tmp_path)
    model_index = json.loads((tmp_path / "model_index.json").read_text())
    assert model_index["transformer"] == ["diffusers_lmlp", "UViTTransformer2DModel"]

    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("loading unpickled a file"))
    loaded = DiffusionPipeline.from_pretrained(tmp_path)  # offline: conftest sets HF_HUB_OFFLINE=1
    loaded.set_progress_bar_config(disable=True)
    assert type(loaded) is LMLPPipeline and type(loaded.transformer) is UViTTransformer2DModel
    saved_config = {k: v for k, v in loaded.transformer.config.items() if not k.startswith("_")}
    assert saved_config == {k: v for k, v in uvit_pipe.transformer.config.items() if not k.startswith("_")}
    torch.testing.assert_close(generate(loaded), images, rtol=0, atol=0)
