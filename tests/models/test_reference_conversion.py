"""Fidelity to the reference UL-MLP (zizhao-hu/L-MLP `libs/f2.py`): a plain-torch re-statement on reference keys."""

import re

import pytest
import torch
import torch.nn.functional as F
from plain_torch import reference_skeleton_forward

from diffusers_lmlp import LMLPTransformer2DModel, convert_lmlp_reference_state_dict, convert_uvit_reference_state_dict


def reference_state_dict(depth, dim, seq_len, text_dim, block_layers, conv=True, unit_weights=False):
    """Random tensors under a reference network's keys (§A.4, §B.1; patch 2, 4 channels). `block_layers(prefix)` gives
    a block's LayerNorms (their width) and Linears ((out, in), and "no bias"); `unit_weights`: weights by fan-in^-½."""
    gen = torch.Generator().manual_seed(0)

    def rand(*shape, scale=0.05, offset=0.0):
        return offset + scale * torch.randn(*shape, generator=gen)

    sd = {"pos_embed": rand(1, seq_len, dim), "patch_embed.proj.weight": rand(dim, 4, 2, 2)}
    layers = {"patch_embed.proj": (dim,), "context_embed": (dim, text_dim), "norm": dim, "decoder_pred": (16, dim)}
    if conv:
        sd["final_layer.weight"], layers["final_layer"] = rand(4, 4, 3, 3), (4,)
    blocks = [f"in_blocks.{i}." for i in range(depth // 2)] + ["mid_block."]
    for p in blocks + [f"out_blocks.{i}." for i in range(depth // 2)]:
        layers |= {p + name: shape for name, shape in block_layers(p).items()}
    for name, shape in layers.items():
        if isinstance(shape, int):  # a LayerNorm
            sd |= {f"{name}.weight": rand(shape, offset=1.0), f"{name}.bias": rand(shape)}
            continue
        if len(shape) > 1:
            sd[f"{name}.weight"] = rand(*shape[:2], scale=shape[1] ** -0.5 if unit_weights else 0.05)
        if len(shape) != 3:
            sd[f"{name}.bias"] = rand(shape[0])
    return sd


def lmlp_state_dict(depth, dim, seq_len, text_dim, mlp_hidden):
    """The reference UL-MLP's tensors (libs/f2.py)."""
    block = {"norm1": dim, "norm2": seq_len, "l": (seq_len, seq_len), "r": (dim, dim), "proj": (dim, dim)}
    block |= {"mlp.fc1": (mlp_hidden, dim), "mlp.fc2": (dim, mlp_hidden)}
    return reference_state_dict(depth, dim, seq_len, text_dim, lambda p: block)


def linear(sd, h, name):
    return F.linear(h, sd[f"{name}.weight"], sd.get(f"{name}.bias"))


def norm(sd, h, name):
    return F.layer_norm(h, h.shape[-1:], sd[f"{name}.weight"], sd[f"{name}.bias"])


def reference_forward(sd, x, context, n, depth):
    """The reference ULMLP forward; `n` is the network timestep (1..1000)."""

    def block(p, h, skip):
        h = h if skip is None else h + skip
        left = linear(sd, norm(sd, h.transpose(1, 2), p + "norm2"), p + "l").transpose(1, 2)
        h = norm(sd, h, p + "norm1")
        h = h + linear(sd, left + linear(sd, h, p + "r"), p + "proj")
        return h + linear(sd, F.gelu(linear(sd, norm(sd, h, p + "norm1"), p + "mlp.fc1")), p + "mlp.fc2")

    return reference_skeleton_forward(sd, x, context, n, depth, 2, block)


TINY = dict(
    sample_size=8, patch_size=2, hidden_size=32, num_layers=4, mlp_ratio=4.0, text_embed_dim=24, text_seq_len=5
)


def test_converted_tiny_model_matches_reference_forward_bit_for_bit_in_fp32_and_under_bf16_autocast():
    model = LMLPTransformer2DModel(**TINY).eval()
    sd = lmlp_state_dict(depth=4, dim=32, seq_len=22, text_dim=24, mlp_hidden=128)
    model.load_state_dict(convert_lmlp_reference_state_dict(sd), strict=True)
    streams = []
    for block in model.stack.in_blocks:
        block.register_forward_hook(lambda module, args, out: streams.append(out.dtype))
    gen = torch.Generator().manual_seed(1)
    x, context = torch.randn(3, 4, 8, 8, generator=gen), torch.randn(3, 5, 24, generator=gen)
    t = torch.tensor([0, 411, 999])  # diffusers scheduler timesteps; the reference network sees t + 1
    with torch.no_grad():
        # The same ops in the same order and layouts: the same bits.
        assert torch.equal(model(x, context, t).sample, reference_forward(sd, x, context, t + 1, depth=4))
        # The reference's torch.cat joins the bf16 patches and text with the float32 time token and adds the float32
        # pos_embed: under autocast the stream is float32, and every block's residual add stays so.
        streams.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ours = model(x, context, t).sample
            expected = reference_forward(sd, x, context, t + 1, depth=4)
        assert streams == [torch.float32, torch.float32] and torch.equal(ours, expected)
        streams.clear()
        model.to(torch.bfloat16)(x, context, t)  # with bf16 weights and no autocast, everything is bf16
    assert streams == [torch.bfloat16, torch.bfloat16]


@pytest.mark.slow
def test_f2_reference_layout_loads_one_to_one_and_matches():
    with torch.device("meta"):  # the weights come from `sd`: skip initialising 47M of them
        model = LMLPTransformer2DModel().eval()  # F2
    sd = lmlp_state_dict(depth=16, dim=512, seq_len=334, text_dim=768, mlp_hidden=2048)
    assert len(sd) == 249 and sum(v.numel() for v in sd.values()) == 47_139_122  # §A.4: 249 tensors for depth 16
    converted = convert_lmlp_reference_state_dict(sd)
    assert set(converted) == set(model.state_dict())
    model.load_state_dict(converted, strict=True, assign=True)

    gen = torch.Generator().manual_seed(2)
    x, context, t = torch.randn(1, 4, 32, 32, generator=gen), torch.randn(1, 77, 768, generator=gen), 499
    with torch.no_grad():
        ours = model(x, context, t).sample
        expected = reference_forward(sd, x, context, torch.tensor([t + 1]), depth=16)
    # Bit for bit: at this width the merge GEMM rounds by Z's layout, which must be the reference's (left + right).
    assert torch.equal(ours, expected)


def test_converters_strip_ddp_prefix_and_refuse_each_others_keys():
    lmlp, uvit = convert_lmlp_reference_state_dict, convert_uvit_reference_state_dict
    cases = [
        (lmlp, "in_blocks.3.mlp.fc2.bias", "stack.in_blocks.3.joint_mlp.fc2.bias", "in_blocks.0.attn.qkv.weight"),
        (uvit, "out_blocks.1.skip_linear.bias", "stack.out_blocks.1.skip_linear.bias", "in_blocks.0.l.weight"),
    ]
    for convert, key, ours, foreign in cases:
        sd = {"module.context_embed.weight": torch.zeros(2, 2), f"module.{key}": torch.zeros(2)}
        assert set(convert(sd)) == {"embed.text_adapter.weight", ours}
        with pytest.raises(ValueError, match=rf"Unexpected key '{re.escape(foreign)}'.*(U-ViT|L-MLP)"):
            convert({foreign: torch.zeros(3, 1)})
