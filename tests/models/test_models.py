"""diffusers model conventions and input checks for every block family (and L-MLP/MoE-MLP with the IMLP), tiny."""

import inspect
import json
import os

import pytest
import torch
from plain_torch import TINY

from diffusers_lmlp import FAMILIES, MoEMLPModel
from diffusers_lmlp.complexity import complexity
from diffusers_lmlp.models import family_of


MODELS = {
    name: (lambda family=family, **kw: family.model_class(**{**TINY, **family.tiny_overrides, **kw}))
    for name, family in FAMILIES.items()
}
MODELS["moe_mlp"] = lambda **kw: MoEMLPModel(**{**TINY, "num_experts": 3, "num_heads": 2, **kw})
# "<family>+imlp": the family's model with the IMLP as every block's channel MLP.
KINDS = [*MODELS, "lmlp+imlp", "moe_mlp+imlp"]


def make_model(kind, seed=0, **kw):
    torch.manual_seed(seed)
    name, _, channel_mlp = kind.partition("+")
    return MODELS[name](**kw, **({"channel_mlp": channel_mlp} if channel_mlp else {})).eval()


def make_inputs(batch=2, seed=0, channels=4, side=8, text_len=5, text_dim=16):
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(batch, channels, side, side, generator=gen),
        torch.randn(batch, text_len, text_dim, generator=gen),
        torch.randint(0, 1000, (batch,), generator=gen),
    )


@pytest.fixture(params=KINDS)
def kind(request):
    return request.param


def test_output_shape_return_dict_timesteps_and_determinism(kind):
    model = make_model(kind, out_channels=8)
    x, ctx, t = make_inputs()
    with torch.no_grad():
        for train in (False, True):  # each sample's prediction is its own (no norm couples samples)
            batched = model.train(train)(x, ctx, t).sample
            singles = torch.cat([model(x[i : i + 1], ctx[i : i + 1], t[i : i + 1]).sample for i in range(2)])
            torch.testing.assert_close(batched, singles, rtol=1e-5, atol=1e-5)
        model.eval()
        out = model(x, ctx, t)
        (as_tuple,) = model(x, ctx, t, return_dict=False)
        scalar = model(x, ctx, 250).sample
        one = model(x, ctx, torch.tensor([250])).sample
        batched = model(x, ctx, torch.tensor([250, 250])).sample
        other = model(x, ctx, torch.tensor([250, 251])).sample
    assert out.sample.shape == (2, 8, 8, 8)
    for same in (as_tuple, out.sample), (scalar, batched), (one, batched):
        torch.testing.assert_close(*same, rtol=0, atol=0)
    assert not torch.allclose(other[1], batched[1])
    torch.testing.assert_close(*(make_model(kind, seed=3).state_dict() for _ in "ab"), rtol=0, atol=0)
    for block in [*model.stack.in_blocks, model.stack.mid_block, *model.stack.out_blocks]:  # for regional compile
        assert type(block).__name__ in model._repeated_blocks and model._repeated_blocks == model._no_split_modules


def test_save_load_round_trip_uses_safetensors_and_never_unpickles(kind, tmp_path, monkeypatch):
    model = make_model(kind)
    x, ctx, t = make_inputs()
    model.save_pretrained(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "diffusion_pytorch_model.safetensors"]
    loaded = type(model).from_pretrained(tmp_path, use_safetensors=True)
    public = [{k: v for k, v in m.config.items() if k[0] != "_"} for m in (loaded, model)]
    assert public[0] == public[1] and public[0]["hidden_size"] == 32
    assert json.loads((tmp_path / "config.json").read_text())["_class_name"] == type(model).__name__
    assert family_of(loaded) is FAMILIES[kind.partition("+")[0]]
    torch.testing.assert_close(loaded(x, ctx, t).sample, model(x, ctx, t).sample, rtol=0, atol=0)
    # Every weight has its tensor on diffusers' other paths too, so strict loading refuses none of them.
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    for folder, options in [(tmp_path, {"low_cpu_mem_usage": False}), (tmp_path / "sharded", {})]:
        loaded = type(model).from_pretrained(folder, **options)
        torch.testing.assert_close(loaded.state_dict(), model.state_dict(), rtol=0, atol=0)
    model.save_pretrained(tmp_path / "pickled", safe_serialization=False)
    assert sorted(os.listdir(tmp_path / "pickled")) == ["config.json", "diffusion_pytorch_model.bin"]
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("from_pretrained unpickled a file"))
    with pytest.raises(OSError, match="no file named diffusion_pytorch_model.safetensors"):
        type(model).from_pretrained(tmp_path / "pickled")
    with pytest.raises(ValueError, match="safetensors weights only.*use_safetensors=False"):
        type(model).from_pretrained(tmp_path / "pickled", use_safetensors=False)
    with pytest.raises(ValueError, match="safetensors weights only, whose keys it checks.*use_flashpack=True"):
        type(model).from_pretrained(tmp_path, use_flashpack=True)


@pytest.mark.parametrize("dtype_kwarg", ["torch_dtype", "dtype", "autocast", "layerwise"])
def test_bfloat16_loading_casting_and_autocast_stay_close_to_fp32(kind, tmp_path, dtype_kwarg):
    model = make_model(kind)
    x, ctx, t = make_inputs()
    with torch.no_grad():
        ref = model(x, ctx, t).sample
        if dtype_kwarg == "autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x, ctx, t).sample
        elif dtype_kwarg == "layerwise":  # stores bf16, computes fp32
            model.enable_layerwise_casting(storage_dtype=torch.bfloat16, compute_dtype=torch.float32)
            assert (out := model(x, ctx, t).sample).dtype == torch.float32
            layers = [m for m in model.stack.mid_block.modules() if isinstance(m, torch.nn.Linear | torch.nn.Conv2d)]
            norms = [m for m in model.stack.mid_block.modules() if isinstance(m, torch.nn.LayerNorm)]
            assert all(m.weight.dtype == torch.bfloat16 for m in layers)  # (SymMixer's tied weights are not Linears)
            assert norms and all(m.weight.dtype == torch.float32 for m in norms)  # "norm" is skipped
            assert model.embed.pos_embed.dtype == torch.float32
        else:
            model.save_pretrained(tmp_path)
            loaded = type(model).from_pretrained(tmp_path, **{dtype_kwarg: torch.bfloat16})
            assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
            assert (out := loaded(x.bfloat16(), ctx.bfloat16(), t).sample).dtype == torch.bfloat16
    assert torch.isfinite(out).all() and (out.float() - ref).norm() / ref.norm() < 0.05


def _loss_and_grads(model, x, ctx, t):
    model.zero_grad(set_to_none=True)
    (loss := (model(x, ctx, t).sample - x).pow(2).mean()).backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_every_parameter_gets_a_gradient_and_checkpointing_gives_the_same(kind):
    model = make_model(kind).train()
    inputs = make_inputs()
    loss, grads = _loss_and_grads(model, *inputs)  # every parameter has a .grad
    assert not [n for n, g in grads.items() if not torch.isfinite(g).all() or g.abs().sum() == 0]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model.enable_gradient_checkpointing()
    assert model.is_gradient_checkpointing and model.stack.gradient_checkpointing
    checkpointing = {type(m).__name__ for m in model.modules() if getattr(m, "gradient_checkpointing", False)}
    assert checkpointing == {"UShapedStack"}
    ckpt_loss, ckpt_grads = _loss_and_grads(model, *inputs)
    torch.testing.assert_close(ckpt_loss, loss)
    torch.testing.assert_close(ckpt_grads, grads, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model.state_dict(), state, rtol=0, atol=0)  # the recomputation moved no statistics
    model.disable_gradient_checkpointing()
    assert not model.stack.gradient_checkpointing


@pytest.mark.parametrize(
    "inputs, edit, message",
    [
        (dict(side=16), None, r"expects latents of shape \(B, 4, 8, 8\).*got \(2, 4, 16, 16\).*L = 22"),
        (dict(channels=3), None, r"expects latents of shape \(B, 4, 8, 8\) \(in_channels=4.*got \(2, 3, 8, 8\)"),
        (dict(text_len=7), None, r"encoder_hidden_states of shape \(B, 5, 16\).*got \(2, 7, 16\).*max_length=5"),
        (dict(text_dim=8), None, r"encoder_hidden_states of shape \(B, 5, 16\).*got \(2, 5, 8\).*hidden size 16"),
        ({}, lambda x, c, t: (x, c[:1], t), "hidden_states has 2 samples but encoder_hidden_states has 1"),
        ({}, lambda x, c, t: (x, c, t[[0, 1, 1]]), r"timestep must be a scalar or a 1-D tensor of length 2.*\(3,\)"),
        ({}, lambda x, c, t: (x, None, t), 'needs encoder_hidden_states.*empty prompt ""'),
    ],
)
def test_bad_inputs_raise_clear_errors(kind, inputs, edit, message):
    model_inputs = make_inputs(**inputs)
    with pytest.raises(ValueError, match=message):
        make_model(kind)(*(edit(*model_inputs) if edit else model_inputs))


def test_the_pooled_text_projection_adds_the_last_text_state_to_every_image_token(kind, tmp_path):
    model, plain = make_model(kind, pooled_text_projection=True), make_model(kind)
    assert plain.embed.pooled_text_proj is None
    extra = {name for name, _ in model.named_parameters()} - {name for name, _ in plain.named_parameters()}
    assert extra == {"embed.pooled_text_proj.weight", "embed.pooled_text_proj.bias"}
    assert model.embed.pooled_text_proj.weight.std() > 0  # initialised as every Linear, not left at zero
    latents, text, t = make_inputs()
    model.embed.pooled_text_proj.weight.data.zero_()
    model.embed.pooled_text_proj.bias.data.zero_()
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("embed.pooled")})
    torch.testing.assert_close(model(latents, text, t).sample, plain(latents, text, t).sample, rtol=0, atol=0)
    model.save_pretrained(tmp_path)
    assert type(model).from_pretrained(tmp_path).config.pooled_text_projection
    # One 16 → 32 Linear on one state per caption, in the complexity count too.
    assert complexity(model).params == model.num_parameters()
    assert complexity(model).macs - complexity(plain).macs == 16 * 32
    # It is every family's last argument, and a bool.
    assert list(inspect.signature(type(model).__init__).parameters)[-1] == "pooled_text_projection"
    with pytest.raises(ValueError, match=f"pooled_text_projection='yes' cannot build a {type(model).__name__}"):
        make_model(kind, pooled_text_projection="yes")


@pytest.mark.parametrize(
    "family, overrides, message",
    [
        ("lmlp", dict(merging="sum"), r"merging='sum' cannot build a LMLPTransformer2DModel: merging must be one of"),
        ("lmlp", dict(long_skip="third_stage"), r"long_skip='third_stage'.*\('first_stage', 'second_stage'\) or None"),
        ("lmlp", dict(lateral_mlp_ratio=2.0, lateral_activation="left"), "lateral_activation='left' applies to"),
        ("lmlp", dict(lateral_activation="right"), r"lateral_activation='right'.*one of \('none', 'left', 'both'\)"),
        ("lmlp", dict(mlp_ratio=0), r"mlp_ratio=0 cannot build.*a positive finite number or None"),
        ("lmlp", dict(hidden_size=34, mlp_ratio=1.5, channel_mlp="imlp"), r"int\(34 × 1.5\) = 51 .*C' must be even"),
        ("lmlp", dict(channel_mlp="agelu"), r"channel_mlp='agelu' is not a channel MLP; choose one of \['imlp'"),
        ("moe_mlp", dict(channel_mlp="agelu"), r"channel_mlp='agelu' is not a channel MLP; choose one of \['imlp'"),
        ("mlp_mixer", dict(token_mlp_ratio=0.01), r"token_mlp_ratio=0.01 gives .* int\(22 × 0.01\) = 0"),
        ("mlp_mixer", dict(token_mlp_ratio=-1.0), "token_mlp_ratio must be a positive finite number"),
        ("mlp_mixer", dict(channel_mlp="kan"), "channel_mlp='kan' is not a channel MLP"),
        ("mlp_mixer", dict(long_skips="yes"), "long_skips must be True or False"),
        ("gmlp", dict(long_skips=None), "long_skips must be True or False"),
        ("asymmixer", dict(token_mlp_ratio=0.01), "token_mlp_ratio=0.01 gives a token MLP of int"),
        ("asymmixer", dict(token_mlp_ratio="half"), "token_mlp_ratio='half' cannot build"),
        *[("asymmixer", dict(num_iterations=n), f"num_iterations={n} cannot build") for n in (0, 1.5)],
        ("uvit", dict(num_attention_heads=3), r"hidden_size \(32\) must be divisible by num_attention_heads \(3\)"),
        ("uvit", dict(num_attention_heads="8"), "num_attention_heads='8' cannot build a UViTTransformer2DModel"),
    ],
)
def test_bad_family_options_raise_clear_errors(family, overrides, message):
    with pytest.raises(ValueError, match=message):
        FAMILIES[family].model_class(**{**TINY, **overrides})
