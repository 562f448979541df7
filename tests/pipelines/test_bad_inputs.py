"""Bad pipeline arguments, non-finite outputs, model inputs and configs fail loudly, naming what is allowed."""

import pytest
import torch
from diffusers import DDIMScheduler, EulerDiscreteScheduler
from test_models import make_inputs, make_model

from diffusers_lmlp import FAMILIES, LMLPPipeline, LMLPTransformer2DModel


NAN, INF = float("nan"), float("inf")
TEXT = torch.zeros(1, 16, 32)  # the tiny pipeline's (1, text_seq_len, text_embed_dim)

STEPS = r"`num_inference_steps` must be an integer in \[1, 999\].*got "
TIMESTEPS, SIGMAS = r"`timesteps` must be integers in \[0, 1000\), got \[", r"`sigmas` must be finite and >= 0, got \["
NOT_A_GENERATOR = (TypeError, r"`generator` must be a torch.Generator, a list of them")
EULER = EulerDiscreteScheduler

# (`__call__` kwargs, the error: a regex or (type, regex)); a `scheduler` class is set first (Euler takes sigmas).
# fmt: off
CASES = {
    "prompt and prompt_embeds": ({"prompt_embeds": TEXT}, "got both"),
    "neither prompt nor prompt_embeds": ({"prompt": None}, "got neither"),
    "prompt not text": ({"prompt": 3}, "a string or a list of strings"),
    "negative_prompt length": ({"prompt": ["a", "b"], "negative_prompt": ["c"]}, "has 1 entries but there are 2"),
    "negative_prompt and embeds": ({"negative_prompt": "c", "negative_prompt_embeds": TEXT}, "at most one of `neg"),
    "prompt_embeds shape": ({"prompt": None, "prompt_embeds": torch.zeros(1, 8, 32)}, r"\(1, 16, 32\), got \(1, 8,"),
    "negative_prompt_embeds": ({"prompt": ["a", "b"], "negative_prompt_embeds": TEXT}, r"\(2, 16, 32\), got \(1, 16"),
    "steps 0": ({"num_inference_steps": 0}, STEPS + "0"),
    "steps == num_train_timesteps": ({"num_inference_steps": 1000}, STEPS + "1000"),
    "steps not an integer": ({"num_inference_steps": 2.5}, STEPS + "2.5"),
    "images per prompt 0": ({"num_images_per_prompt": 0}, "at least 1, got 0"),
    "images per prompt 1.5": ({"num_images_per_prompt": 1.5}, r"`num_images_per_prompt` must be an .*got 1.5"),
    "images beyond one call": ({"num_images_per_prompt": 10**7}, r"is 10,000,000 images, more than the 4096"),
    "generator a string": ({"generator": "seed"}, NOT_A_GENERATOR),
    "generator list with a string": ({"generator": [torch.Generator(), "seed"]}, NOT_A_GENERATOR),
    "generators": ({"num_images_per_prompt": 2, "generator": [torch.Generator()] * 3}, r"3 generators for 2 images"),
    "latents shape": ({"num_images_per_prompt": 2, "latents": torch.zeros(1, 4, 8, 8)}, r"\(2, 4, 8, 8\), got \(1,"),
    "output_type": ({"output_type": "jpeg"}, "`output_type` must be one of"),
    "height": ({"height": 32}, "generates 16×16 images only"),
    "width zero": ({"width": 0}, r"got height=16, width=0"),
    "callback tensor inputs": ({"callback_on_step_end_tensor_inputs": ["noise_pred"]}, r"may only name .* \['noi"),
    "guidance NaN": ({"guidance_scale": NAN}, r"`guidance_scale` must be a finite number.*got nan"),
    "guidance -inf": ({"guidance_scale": -INF}, r"`guidance_scale` must be a finite number.*got -inf"),
    "timesteps and sigmas": ({"timesteps": [999], "sigmas": [1.0]}, "at most one of `timesteps`"),
    "sigmas unsupported": ({"sigmas": [1.0, 0.5]}, "does not accept custom `sigmas`"),
    "timesteps empty": ({"timesteps": []}, r"`timesteps` is empty"),
    "timesteps negative": ({"timesteps": [999, -5]}, TIMESTEPS + r"-5\.?0?\]"),
    "timesteps too large": ({"timesteps": [1500, 10]}, TIMESTEPS + "1500"),
    "timesteps not integers": ({"timesteps": [999, 500.5]}, TIMESTEPS + r"500\.5\]"),
    "timesteps NaN": ({"timesteps": [999, NAN]}, TIMESTEPS + r"nan\]"),
    "timesteps repeated": ({"timesteps": [999, 500, 500, 10]}, r"`timesteps` must be strictly decreasing"),
    "timesteps not a list": ({"timesteps": 500}, r"`timesteps` must be a list of numbers, got 500"),
    "timesteps unsupported": ({"scheduler": DDIMScheduler, "timesteps": [999, 500]}, "DDIMScheduler does not accept"),
    "sigmas empty": ({"scheduler": EULER, "sigmas": []}, r"`sigmas` is empty"),
    "sigmas NaN": ({"scheduler": EULER, "sigmas": [14.6, NAN]}, SIGMAS + r"nan\]"),
    "sigmas negative": ({"scheduler": EULER, "sigmas": [3.0, -1.0]}, SIGMAS + r"-1\.0\]"),
    "sigmas increasing": ({"scheduler": EULER, "sigmas": [0.5, 3.0]}, r"`sigmas` must be strictly decreasing"),
    # Euler reads the last sigma as the end point: one sigma is zero steps, which used to decode the raw noise.
    "sigmas give no steps": ({"scheduler": EULER, "sigmas": [1.0]}, r"`sigmas`=\[1.0\] gives EulerDiscreteSchedul"),
}
# fmt: on


@pytest.mark.parametrize("case", CASES)
def test_bad_pipeline_arguments_raise_before_any_compute(pipe, record_batches, case):
    kwargs, message = CASES[case]
    error, message = message if isinstance(message, tuple) else (ValueError, message)
    kwargs = {"prompt": "a red circle", "num_inference_steps": 2, "output_type": "pt", **kwargs}
    if "scheduler" in kwargs:
        pipe.scheduler = kwargs.pop("scheduler").from_config(pipe.scheduler.config)
    calls = record_batches(pipe.text_encoder, pipe.transformer)
    with pytest.raises(error, match=message):
        pipe(**kwargs)
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
def test_nan_from_the_transformer_the_vae_or_a_callback_raises_for_every_output_type(pipe, make_pipe, output_type):
    pipe.transformer.register_forward_hook(return_nan)
    with pytest.raises(FloatingPointError, match=r"non-finite latents \(NaN or inf\) in images \[0, 1\] of 2"):
        pipe(["a red circle", "a blue square"], num_inference_steps=2, output_type=output_type)
    if output_type != "latent":
        pipe = make_pipe()
        pipe.vae.decoder.register_forward_hook(return_nan)
        with pytest.raises(FloatingPointError, match=r"VAE decoded non-finite images \(NaN or inf\): images \[0\] of"):
            pipe("a red circle", num_inference_steps=2, output_type=output_type)

    def poison(pipe, step, timestep, callback_kwargs):
        return {"latents": torch.full_like(callback_kwargs["latents"], NAN)}

    with pytest.raises(FloatingPointError, match="non-finite latents"):
        make_pipe()("a red circle", num_inference_steps=2, callback_on_step_end=poison, output_type=output_type)


@pytest.mark.parametrize("kind", FAMILIES)
def test_model_timesteps_and_inputs_are_checked(kind):
    model = make_model(kind)
    x, c, _ = make_inputs()
    lie, real = r"timestep must lie in \[0, 1000\).*got \[", r"timestep must hold real numbers.*got dtype torch\."
    for args, message in [
        ((x, c, -1), lie + "-1"),
        ((x, c, 1000), lie + "1000"),
        ((x, c, torch.tensor([5.0, 1e9])), lie + "1000000000"),
        ((x, c, torch.tensor([NAN, 5.0])), lie + r"nan\]"),
        ((x, c, INF), lie + "inf"),
        ((x, c, torch.tensor(True)), real + "bool"),
        ((x, c, torch.tensor([1 + 0j, 2 + 0j])), real + "complex64"),
        ((x.long(), c, 10), r"hidden_states must be a floating-point tensor, got torch.int64"),
        ((x, c.to(torch.uint8), 10), r"encoder_hidden_states must be a floating-point tensor, got torch.uint8"),
    ]:
        with pytest.raises(ValueError, match=message):
            model(*args)
    with torch.no_grad():
        assert torch.isfinite(model(x, c, torch.tensor([0.0, 999.5])).sample).all()  # float timesteps
        # As diffusers' own transformers do: each input meets its projection in that layer's dtype.
        for dtype in (torch.bfloat16, torch.float64):
            out = model(x.to(dtype), c.to(dtype), 10).sample
            assert out.dtype == torch.float32
            expected = model(x.to(dtype).float(), c.to(dtype).float(), 10).sample
            torch.testing.assert_close(out, expected, rtol=0, atol=0)


# fmt: off
POSITIVE = {"patch_size": [0], "sample_size": [0, -8, 8.0], "hidden_size": [0, -4], "in_channels": [0],
            "out_channels": [0], "text_seq_len": [0], "text_embed_dim": [0]}
BAD_CONFIGS = [({field: v}, rf"{field}={v} .*positive integer") for field, values in POSITIVE.items() for v in values]
BAD_CONFIGS += [({"mlp_ratio": 0}, r"mlp_ratio=0 .*positive finite number"),
                ({"mlp_ratio": -1.0}, r"mlp_ratio=-1.0 .*positive finite number"),
                ({"mlp_ratio": 0.01}, r"mlp_ratio=0.01 gives a channel MLP of int\(32 × 0.01\) = 0 hidden units"),
                ({"norm_eps": 0.0}, r"norm_eps=0.0 .*positive finite number"),
                ({"num_layers": -2}, r"num_layers must be even and >= 0.*got -2"),
                ({"num_layers": 3}, r"num_layers must be even and >= 0.*got 3"),
                ({"patch_size": 3}, r"sample_size \(8\) must be a multiple of patch_size \(3\)")]
BAD_CONFIGS = [(kind, *case) for case in BAD_CONFIGS for kind in FAMILIES]
BAD_CONFIGS += [("moe_mlp", {"num_experts": 0}, r"num_experts and num_heads must be >= 1, got 0 and 2"),
                ("moe_mlp", {"num_heads": 0}, r"num_experts and num_heads must be >= 1, got 3 and 0"),
                ("moe_mlp", {"num_heads": 3}, r"hidden_size \(32\) must be divisible by num_heads \(3\)")]
# fmt: on


@pytest.mark.parametrize("kind, config, message", BAD_CONFIGS)
def test_bad_configs_name_the_field(kind, config, message):
    with pytest.raises(ValueError, match=message):
        make_model(kind, **config)
