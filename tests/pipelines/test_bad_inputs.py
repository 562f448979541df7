"""Bad arguments fail loudly: pipeline arguments, non-finite outputs, model timesteps and dtypes, and configs.

Every case here once returned a wrong result (NaN images, raw noise, a silently rounded timestep) or failed deep
inside PyTorch; each must now raise an error that names the argument and says what is allowed.
"""

import pytest
import torch
from diffusers import EulerDiscreteScheduler

from diffusers_lmlp import FAMILIES, MoEMLPModel


NAN, INF = float("nan"), float("inf")
TINY = dict(sample_size=8, patch_size=2, hidden_size=32, num_layers=2, text_embed_dim=16, text_seq_len=5)
MODELS = {name: family.model_class for name, family in FAMILIES.items()}


def record_calls(*modules: torch.nn.Module) -> list[str]:
    """Record the class name of every forward call of `modules`."""
    calls = []
    for module in modules:
        module.register_forward_pre_hook(lambda m, _: calls.append(type(m).__name__))
    return calls


def return_nan(module: torch.nn.Module, args, output):
    """Forward hook that turns a module's output (a tensor, or a tuple/output whose first item is one) into NaN."""
    first = output if isinstance(output, torch.Tensor) else output[0]
    first.fill_(NAN)


# (keyword arguments of `__call__`, what the error must say). The argument, the value and the valid range.
PIPELINE_CASES = {
    "steps == num_train_timesteps": ({"num_inference_steps": 1000}, r"`num_inference_steps`.*\[1, 999\].*got 1000"),
    "steps > num_train_timesteps": ({"num_inference_steps": 5000}, r"`num_inference_steps`.*\[1, 999\].*got 5000"),
    "steps not an integer": ({"num_inference_steps": 2.5}, r"`num_inference_steps` must be an integer.*got 2.5"),
    "images per prompt not an integer": (
        {"num_images_per_prompt": 1.5},
        r"`num_images_per_prompt` must be an integer.*got 1.5",
    ),
    "images per prompt beyond one batch": (
        {"num_images_per_prompt": 10**7},
        r"1 prompts × num_images_per_prompt=10000000 is 10,000,000 images, more than the 4096 one call makes",
    ),
    "guidance NaN": ({"guidance_scale": NAN}, r"`guidance_scale` must be a finite number.*got nan"),
    "guidance inf": ({"guidance_scale": INF}, r"`guidance_scale` must be a finite number.*got inf"),
    "guidance -inf": ({"guidance_scale": -INF}, r"`guidance_scale` must be a finite number.*got -inf"),
    "timesteps empty": ({"timesteps": []}, r"`timesteps` is empty"),
    "timesteps negative": ({"timesteps": [999, -5]}, r"`timesteps` must be integers in \[0, 1000\).*got \[-5\.?0?\]"),
    "timesteps too large": ({"timesteps": [1500, 10]}, r"`timesteps` must be integers in \[0, 1000\).*got \[1500"),
    "timesteps not integers": ({"timesteps": [999, 500.5]}, r"`timesteps` must be integers.*got \[500\.5\]"),
    "timesteps NaN": ({"timesteps": [999, NAN]}, r"`timesteps` must be integers.*got \[nan\]"),
    "timesteps repeated": ({"timesteps": [999, 500, 500, 10]}, r"`timesteps` must be strictly decreasing"),
    "timesteps increasing": ({"timesteps": [10, 500, 999]}, r"`timesteps` must be strictly decreasing"),
    "timesteps not a list": ({"timesteps": 500}, r"`timesteps` must be a list of numbers, got 500"),
    "height zero": ({"height": 0}, r"got height=0, width=16"),
    "width zero": ({"width": 0}, r"got height=16, width=0"),
}


@pytest.mark.parametrize("case", PIPELINE_CASES)
def test_bad_pipeline_arguments_raise_before_any_compute(pipe, case):
    kwargs, message = PIPELINE_CASES[case]
    calls = record_calls(pipe.text_encoder, pipe.transformer, pipe.vae)
    with pytest.raises(ValueError, match=message):
        pipe("a red circle", **{"num_inference_steps": 2, "output_type": "pt", **kwargs})
    assert calls == []


@pytest.mark.parametrize("generator", ["seed", 0, [torch.Generator(), "seed"]])
def test_a_generator_that_is_not_one_is_refused_before_any_compute(pipe, generator):
    calls = record_calls(pipe.text_encoder, pipe.transformer, pipe.vae)
    with pytest.raises(TypeError, match=r"`generator` must be a torch.Generator, a list of them"):
        pipe("a red circle", num_inference_steps=2, output_type="pt", generator=generator)
    assert calls == []


SIGMA_CASES = {
    "sigmas empty": ([], r"`sigmas` is empty"),
    "sigmas NaN": ([14.6, NAN], r"`sigmas` must be finite and >= 0.*got \[nan\]"),
    "sigmas inf": ([INF, 0.5], r"`sigmas` must be finite and >= 0.*got \[inf\]"),
    "sigmas negative": ([3.0, -1.0], r"`sigmas` must be finite and >= 0.*got \[-1\.0\]"),
    "sigmas increasing": ([0.5, 3.0], r"`sigmas` must be strictly decreasing"),
    # Euler reads the last sigma as the end point: one sigma is zero steps, which used to decode the raw noise.
    "sigmas give no steps": ([1.0], r"`sigmas`=\[1.0\] gives EulerDiscreteScheduler no denoising steps"),
}


@pytest.mark.parametrize("case", SIGMA_CASES)
def test_bad_sigmas_raise_before_any_compute(pipe, case):
    sigmas, message = SIGMA_CASES[case]
    pipe.scheduler = EulerDiscreteScheduler.from_config(pipe.scheduler.config)
    calls = record_calls(pipe.text_encoder, pipe.transformer, pipe.vae)
    with pytest.raises(ValueError, match=message):
        pipe("a red circle", sigmas=sigmas, output_type="pt")
    assert calls == []


@pytest.mark.slow
def test_the_largest_step_count_still_samples(pipe, generate):
    images = generate(pipe, num_inference_steps=999, guidance_scale=1.0, output_type="latent")
    assert pipe.num_timesteps == 999 and torch.isfinite(images).all()


def test_guidance_scale_at_most_one_means_no_guidance(pipe, generate):
    # diffusers' convention, kept: any guidance_scale <= 1 skips the unconditional pass, the same as 1.
    torch.testing.assert_close(generate(pipe, guidance_scale=0.5), generate(pipe, guidance_scale=1), rtol=0, atol=0)


@pytest.mark.parametrize("output_type", ["pil", "np", "pt", "latent"])
def test_nan_from_the_transformer_raises_for_every_output_type(pipe, output_type):
    pipe.transformer.register_forward_hook(return_nan)
    with pytest.raises(FloatingPointError, match=r"non-finite latents \(NaN or inf\) in images \[0, 1\] of 2"):
        pipe(["a red circle", "a blue square"], num_inference_steps=2, output_type=output_type)


@pytest.mark.parametrize("output_type", ["pil", "np", "pt"])
def test_nan_from_the_vae_decoder_raises(pipe, output_type):
    pipe.vae.decoder.register_forward_hook(return_nan)
    with pytest.raises(FloatingPointError, match=r"VAE decoded non-finite images \(NaN or inf\): images \[0\] of 1"):
        pipe("a red circle", num_inference_steps=2, output_type=output_type)


def test_nan_latents_from_a_callback_raise(pipe):
    def poison(pipe, step, timestep, callback_kwargs):
        return {"latents": torch.full_like(callback_kwargs["latents"], NAN)}

    with pytest.raises(FloatingPointError, match="non-finite latents"):
        pipe("a red circle", num_inference_steps=2, callback_on_step_end=poison, output_type="latent")


def make_model(kind: str, **config) -> torch.nn.Module:
    torch.manual_seed(0)
    return MODELS[kind](**{**TINY, **FAMILIES[kind].tiny_overrides, **config}).eval()


def model_inputs(batch: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(batch, 4, 8, 8, generator=generator), torch.randn(batch, 5, 16, generator=generator)


@pytest.mark.parametrize("kind", MODELS)
@pytest.mark.parametrize(
    "timestep, message",
    [
        (-1, r"timestep must lie in \[0, 1000\).*got \[-1"),
        (1000, r"timestep must lie in \[0, 1000\).*got \[1000"),
        (torch.tensor([5.0, 1e9]), r"timestep must lie in \[0, 1000\).*got \[1000000000"),
        (torch.tensor([NAN, 5.0]), r"timestep must lie in \[0, 1000\).*got \[nan\]"),
        (INF, r"timestep must lie in \[0, 1000\).*got \[inf"),
        (torch.tensor(True), r"timestep must hold real numbers.*got dtype torch.bool"),
        (torch.tensor([1 + 0j, 2 + 0j]), r"timestep must hold real numbers.*got dtype torch.complex64"),
    ],
)
def test_bad_timesteps_raise(kind, timestep, message):
    model = make_model(kind)
    with pytest.raises(ValueError, match=message):
        model(*model_inputs(), timestep)


@pytest.mark.parametrize("kind", MODELS)
def test_float_timesteps_in_range_are_accepted(kind):
    model = make_model(kind)
    with torch.no_grad():
        out = model(*model_inputs(), torch.tensor([0.0, 999.5])).sample
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("kind", MODELS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_inputs_are_cast_to_the_model_dtype(kind, dtype):
    # As diffusers' own transformers do (e.g. MiniMax-H3): each input meets its projection in that layer's dtype.
    model = make_model(kind)
    latents, text = model_inputs()
    with torch.no_grad():
        expected = model(latents.to(dtype).float(), text.to(dtype).float(), 10).sample
        out = model(latents.to(dtype), text.to(dtype), 10).sample
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize("kind", MODELS)
def test_integer_inputs_raise(kind):
    model = make_model(kind)
    latents, text = model_inputs()
    with pytest.raises(ValueError, match=r"hidden_states must be a floating-point tensor, got torch.int64"):
        model(latents.long(), text, 10)
    with pytest.raises(ValueError, match=r"encoder_hidden_states must be a floating-point tensor, got torch.uint8"):
        model(latents, text.to(torch.uint8), 10)


@pytest.mark.parametrize("kind", MODELS)
@pytest.mark.parametrize(
    "config, message",
    [
        ({"patch_size": 0}, r"patch_size=0 .*positive integer"),
        ({"sample_size": 0}, r"sample_size=0 .*positive integer"),
        ({"sample_size": -8}, r"sample_size=-8 .*positive integer"),
        ({"sample_size": 8.0}, r"sample_size=8.0 .*positive integer"),
        ({"hidden_size": 0}, r"hidden_size=0 .*positive integer"),
        ({"hidden_size": -4}, r"hidden_size=-4 .*positive integer"),
        ({"in_channels": 0}, r"in_channels=0 .*positive integer"),
        ({"out_channels": 0}, r"out_channels=0 .*positive integer or None"),
        ({"text_seq_len": 0}, r"text_seq_len=0 .*positive integer"),
        ({"text_embed_dim": 0}, r"text_embed_dim=0 .*positive integer"),
        ({"mlp_ratio": 0}, r"mlp_ratio=0 .*positive finite number"),
        ({"mlp_ratio": -1.0}, r"mlp_ratio=-1.0 .*positive finite number"),
        ({"mlp_ratio": 0.01}, r"mlp_ratio=0.01 gives a channel MLP of int\(32 × 0.01\) = 0 hidden units"),
        ({"norm_eps": 0.0}, r"norm_eps=0.0 .*positive finite number"),
        ({"num_layers": -2}, r"num_layers must be even and >= 0.*got -2"),
        ({"num_layers": 3}, r"num_layers must be even and >= 0.*got 3"),
        ({"patch_size": 3}, r"sample_size \(8\) must be a multiple of patch_size \(3\)"),
    ],
)
def test_bad_configs_name_the_field(kind, config, message):
    with pytest.raises(ValueError, match=message):
        MODELS[kind](**{**TINY, **FAMILIES[kind].tiny_overrides, **config})


@pytest.mark.parametrize(
    "config, message",
    [
        ({"num_experts": 0}, r"num_experts and num_heads must be >= 1, got 0 and 1"),
        ({"num_heads": 0}, r"num_experts and num_heads must be >= 1, got 4 and 0"),
        ({"num_heads": 3}, r"hidden_size \(32\) must be divisible by num_heads \(3\)"),
    ],
)
def test_bad_moe_configs_name_the_field(config, message):
    with pytest.raises(ValueError, match=message):
        MoEMLPModel(**{**TINY, **config})
