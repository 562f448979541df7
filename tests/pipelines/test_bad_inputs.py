"""Bad arguments fail loudly, before any compute, naming the argument and what is allowed: pipeline arguments,
non-finite outputs, model timesteps, dtypes and configs."""

import pytest
import torch
from diffusers import DDIMScheduler, EulerDiscreteScheduler

from diffusers_lmlp import FAMILIES, LMLPPipeline, LMLPTransformer2DModel, MoEMLPModel


NAN, INF = float("nan"), float("inf")
TINY = dict(sample_size=8, patch_size=2, hidden_size=32, num_layers=2, text_embed_dim=16, text_seq_len=5)
MODELS = {name: family.model_class for name, family in FAMILIES.items()}
TEXT = torch.zeros(1, 16, 32)  # the tiny pipeline's (1, text_seq_len, text_embed_dim)

# (keyword arguments of `__call__`, what the error must say)
# fmt: off
PIPELINE_CASES = {
    "prompt and prompt_embeds": ({"prompt_embeds": TEXT}, "got both"),
    "neither prompt nor prompt_embeds": ({"prompt": None}, "got neither"),
    "prompt not text": ({"prompt": 3}, "a string or a list of strings"),
    "negative_prompt length": ({"prompt": ["a", "b"], "negative_prompt": ["c"]}, "has 1 entries but there are 2 prompts"),
    "negative_prompt and its embeds": ({"negative_prompt": "c", "negative_prompt_embeds": TEXT},
                                       "at most one of `negative_prompt` and `negative_prompt_embeds`"),
    "prompt_embeds shape": ({"prompt": None, "prompt_embeds": torch.zeros(1, 8, 32)},
                            r"`prompt_embeds` must have shape .* = \(1, 16, 32\), got \(1, 8, 32\)"),
    "negative_prompt_embeds batch": ({"prompt": ["a", "b"], "negative_prompt_embeds": TEXT},
                                     r"`negative_prompt_embeds` must have shape .* = \(2, 16, 32\), got \(1, 16, 32\)"),
    "steps 0": ({"num_inference_steps": 0}, r"`num_inference_steps` must be an integer in \[1, 999\].*got 0"),
    "steps == num_train_timesteps": ({"num_inference_steps": 1000}, r"\[1, 999\].*got 1000"),
    "steps > num_train_timesteps": ({"num_inference_steps": 5000}, r"\[1, 999\].*got 5000"),
    "steps not an integer": ({"num_inference_steps": 2.5}, r"`num_inference_steps` must be an integer.*got 2.5"),
    "images per prompt 0": ({"num_images_per_prompt": 0}, "at least 1, got 0"),
    "images per prompt 1.5": ({"num_images_per_prompt": 1.5}, r"`num_images_per_prompt` must be an .*got 1.5"),
    "images per prompt beyond one batch": ({"num_images_per_prompt": 10**7},
                                           r"num_images_per_prompt=10000000 is 10,000,000 images, more than the 4096"),
    "generator list length": ({"num_images_per_prompt": 2, "generator": [torch.Generator()] * 3},
                              r"list of 3 generators for 2 images \(1 prompts × 2 per prompt\)"),
    "latents shape": ({"num_images_per_prompt": 2, "latents": torch.zeros(1, 4, 8, 8)},
                      r"`latents` must have shape .* = \(2, 4, 8, 8\), got \(1, 4, 8, 8\)"),
    "output_type": ({"output_type": "jpeg"}, "`output_type` must be one of"),
    "height": ({"height": 32}, "generates 16×16 images only"),
    "width": ({"width": 8}, "generates 16×16 images only"),
    "height zero": ({"height": 0}, r"got height=0, width=16"),
    "width zero": ({"width": 0}, r"got height=16, width=0"),
    "callback tensor inputs": ({"callback_on_step_end_tensor_inputs": ["noise_pred"]}, r"may only name .* got \['noise_pred'\]"),
    "guidance NaN": ({"guidance_scale": NAN}, r"`guidance_scale` must be a finite number.*got nan"),
    "guidance inf": ({"guidance_scale": INF}, r"`guidance_scale` must be a finite number.*got inf"),
    "guidance -inf": ({"guidance_scale": -INF}, r"`guidance_scale` must be a finite number.*got -inf"),
    "timesteps and sigmas": ({"timesteps": [999], "sigmas": [1.0]}, "at most one of `timesteps`"),
    "sigmas unsupported": ({"sigmas": [1.0, 0.5]}, "does not accept custom `sigmas`"),
    "timesteps empty": ({"timesteps": []}, r"`timesteps` is empty"),
    "timesteps negative": ({"timesteps": [999, -5]}, r"`timesteps` must be integers in \[0, 1000\).*\[-5\.?0?\]"),
    "timesteps too large": ({"timesteps": [1500, 10]}, r"`timesteps` must be integers in \[0, 1000\).*\[1500"),
    "timesteps not integers": ({"timesteps": [999, 500.5]}, r"`timesteps` must be integers.*got \[500\.5\]"),
    "timesteps NaN": ({"timesteps": [999, NAN]}, r"`timesteps` must be integers.*got \[nan\]"),
    "timesteps repeated": ({"timesteps": [999, 500, 500, 10]}, r"`timesteps` must be strictly decreasing"),
    "timesteps increasing": ({"timesteps": [10, 500, 999]}, r"`timesteps` must be strictly decreasing"),
    "timesteps not a list": ({"timesteps": 500}, r"`timesteps` must be a list of numbers, got 500"),
}
# fmt: on
# The same, with another scheduler: DDIM takes no custom timesteps, Euler takes sigmas.
SCHEDULER_CASES = {
    "timesteps unsupported": ({"timesteps": [999, 500]}, "DDIMScheduler does not accept custom `t"),
    "sigmas empty": ({"sigmas": []}, r"`sigmas` is empty"),
    "sigmas NaN": ({"sigmas": [14.6, NAN]}, r"`sigmas` must be finite and >= 0.*got \[nan\]"),
    "sigmas inf": ({"sigmas": [INF, 0.5]}, r"`sigmas` must be finite and >= 0.*got \[inf\]"),
    "sigmas negative": ({"sigmas": [3.0, -1.0]}, r"`sigmas` must be finite and >= 0.*got \[-1\.0\]"),
    "sigmas increasing": ({"sigmas": [0.5, 3.0]}, r"`sigmas` must be strictly decreasing"),
    # Euler reads the last sigma as the end point: one sigma is zero steps, which used to decode the raw noise.
    "sigmas give no steps": ({"sigmas": [1.0]}, r"`sigmas`=\[1.0\] gives EulerDiscreteScheduler no denois"),
}


@pytest.mark.parametrize("case", [*PIPELINE_CASES, *SCHEDULER_CASES])
def test_bad_pipeline_arguments_raise_before_any_compute(pipe, record_batches, case):
    if case in SCHEDULER_CASES:
        kwargs, message = SCHEDULER_CASES[case]
        scheduler_class = DDIMScheduler if "timesteps" in kwargs else EulerDiscreteScheduler
        pipe.scheduler = scheduler_class.from_config(pipe.scheduler.config)
    else:
        kwargs, message = PIPELINE_CASES[case]
    calls = record_batches(pipe.text_encoder, pipe.transformer)
    with pytest.raises(ValueError, match=message):
        pipe(**{"prompt": "a red circle", "num_inference_steps": 2, "output_type": "pt", **kwargs})
    assert calls == []


@pytest.mark.parametrize("generator", ["seed", 0, [torch.Generator(), "seed"]])
def test_a_generator_that_is_not_one_is_refused_before_any_compute(pipe, record_batches, generator):
    calls = record_batches(pipe.text_encoder, pipe.transformer)
    with pytest.raises(TypeError, match=r"`generator` must be a torch.Generator, a list of them"):
        pipe("a red circle", num_inference_steps=2, output_type="pt", generator=generator)
    assert calls == []


@pytest.mark.parametrize(
    "mismatch, message",
    [
        ({"text_embed_dim": 48}, "text encoder's hidden size is 32 .* text_embed_dim=48"),
        ({"text_seq_len": 8}, "model_max_length=16 .* text_seq_len=8"),
        ({"in_channels": 8}, "latent_channels=4 .* in_channels=8"),
    ],
)
def test_mismatched_components_are_refused(pipe, mismatch, message):
    config = {"sample_size": 8, "hidden_size": 32, "num_layers": 2, "text_embed_dim": 32, "text_seq_len": 16}
    with pytest.raises(ValueError, match=message):
        LMLPPipeline(**{**pipe.components, "transformer": LMLPTransformer2DModel(**{**config, **mismatch})})


@pytest.mark.slow
def test_the_largest_step_count_still_samples(pipe, generate):
    images = generate(pipe, num_inference_steps=999, guidance_scale=1.0, output_type="latent")
    assert pipe.num_timesteps == 999 and torch.isfinite(images).all()


def return_nan(module: torch.nn.Module, args, output):  # a forward hook: the output (or its first item) is NaN
    (output if isinstance(output, torch.Tensor) else output[0]).fill_(NAN)


@pytest.mark.parametrize("output_type", ["pil", "np", "pt", "latent"])
def test_nan_from_the_transformer_or_the_vae_raises_for_every_output_type(pipe, make_pipe, output_type):
    pipe.transformer.register_forward_hook(return_nan)
    with pytest.raises(FloatingPointError, match=r"non-finite latents \(NaN or inf\) in images \[0, 1\] of 2"):
        pipe(["a red circle", "a blue square"], num_inference_steps=2, output_type=output_type)
    if output_type != "latent":
        pipe = make_pipe()
        pipe.vae.decoder.register_forward_hook(return_nan)
        with pytest.raises(FloatingPointError, match=r"VAE decoded non-finite images \(NaN or inf\): images \[0\] of"):
            pipe("a red circle", num_inference_steps=2, output_type=output_type)


def test_nan_latents_from_a_callback_raise(pipe):
    def poison(pipe, step, timestep, callback_kwargs):
        return {"latents": torch.full_like(callback_kwargs["latents"], NAN)}

    with pytest.raises(FloatingPointError, match="non-finite latents"):
        pipe("a red circle", num_inference_steps=2, callback_on_step_end=poison, output_type="latent")


@pytest.mark.parametrize("kind", MODELS)
def test_model_timesteps_and_inputs_are_checked(kind):
    torch.manual_seed(0)
    model = MODELS[kind](**{**TINY, **FAMILIES[kind].tiny_overrides}).eval()
    latents, text = torch.randn(2, 4, 8, 8), torch.randn(2, 5, 16)
    for timestep, message in [
        (-1, r"timestep must lie in \[0, 1000\).*got \[-1"),
        (1000, r"timestep must lie in \[0, 1000\).*got \[1000"),
        (torch.tensor([5.0, 1e9]), r"timestep must lie in \[0, 1000\).*got \[1000000000"),
        (torch.tensor([NAN, 5.0]), r"timestep must lie in \[0, 1000\).*got \[nan\]"),
        (INF, r"timestep must lie in \[0, 1000\).*got \[inf"),
        (torch.tensor(True), r"timestep must hold real numbers.*got dtype torch.bool"),
        (torch.tensor([1 + 0j, 2 + 0j]), r"timestep must hold real numbers.*got dtype torch.complex64"),
    ]:
        with pytest.raises(ValueError, match=message):
            model(latents, text, timestep)
    with pytest.raises(ValueError, match=r"hidden_states must be a floating-point tensor, got torch.int64"):
        model(latents.long(), text, 10)
    with pytest.raises(ValueError, match=r"encoder_hidden_states must be a floating-point tensor, got torch.uint8"):
        model(latents, text.to(torch.uint8), 10)
    with torch.no_grad():
        assert torch.isfinite(model(latents, text, torch.tensor([0.0, 999.5])).sample).all()  # float timesteps
        # As diffusers' own transformers do: each input meets its projection in that layer's dtype.
        for dtype in (torch.bfloat16, torch.float64):
            out = model(latents.to(dtype), text.to(dtype), 10).sample
            assert out.dtype == torch.float32
            expected = model(latents.to(dtype).float(), text.to(dtype).float(), 10).sample
            torch.testing.assert_close(out, expected, rtol=0, atol=0)


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
)  # fmt: skip
def test_bad_moe_configs_name_the_field(config, message):
    with pytest.raises(ValueError, match=message):
        MoEMLPModel(**{**TINY, **config})
