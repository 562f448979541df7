"""Dynamic int8 quantization reaches every nn.Linear; saving, bf16 casts, LoRA and freezing are refused with the fix."""

import pytest
import torch
from space_server import shapes_lora, shapes_pipeline
from test_models import make_inputs, make_model
from torch import nn
from torch.ao.quantization import quantize_dynamic

from diffusers_lmlp import FAMILIES
from diffusers_lmlp.evaluation.captions import draw_captions
from diffusers_lmlp.models.loading import dynamically_quantized_layers, is_dynamically_quantized
from diffusers_lmlp.shapes.scorer import score_images


# torch marks its eager quantization deprecated (in favour of torchao), and it still runs.
pytestmark = pytest.mark.filterwarnings(
    "ignore:torch.ao.quantization is deprecated:DeprecationWarning", "ignore:torch.quantize_per_tensor:UserWarning"
)


def quantized(model: nn.Module) -> nn.Module:
    return quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8, inplace=False)


def quantized_shapes_pipeline(pipe=None):
    pipe = pipe or shapes_pipeline()
    pipe.transformer = quantized(pipe.transformer)
    return pipe


def sample(pipe, steps: int = 4) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return pipe("a red circle at the center", num_inference_steps=steps, generator=generator, output_type="pt").images


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_dynamic_quantization_reaches_every_linear_and_keeps_the_prediction(kind):
    model = make_model(kind)
    linears = sorted(name for name, module in model.named_modules() if isinstance(module, nn.Linear))
    int8 = quantized(model)
    assert sorted(name for name, module in int8.named_modules() if is_dynamically_quantized(module)) == linears
    assert not any(type(module) is nn.Linear for module in int8.modules())  # no layer skipped
    reference, output = model(*make_inputs()).sample, int8(*make_inputs()).sample
    error = ((output - reference).norm() / reference.norm()).item()
    assert 0 < error < 0.05, error  # int8 rounding, not a weight left random or zero (about 100%)


def test_saving_a_quantized_model_or_pipeline_writes_nothing(tmp_path):
    with pytest.raises(ValueError, match=r"safetensors cannot store .*Save the model before quantizing it"):
        quantized(make_model("lmlp")).save_pretrained(tmp_path / "transformer")
    for component, name in [("transformer", "LMLPTransformer2DModel"), ("text_encoder", "CLIPTextModel")]:
        pipe = shapes_pipeline()
        setattr(pipe, component, quantized(getattr(pipe, component)))
        with pytest.raises(ValueError, match=rf"{name} holds state that safetensors cannot store"):
            pipe.save_pretrained(tmp_path / "pipeline")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_the_quantized_pipeline_draws_held_out_captions_and_refuses_a_cast_to_bf16_before_any_model_runs():
    pipe, captions = quantized_shapes_pipeline(), draw_captions("shapes:heldout", 8, seed=3)
    images = pipe(captions, num_inference_steps=10, generator=torch.Generator().manual_seed(0)).images
    assert score_images(images, captions)["all"] >= 7 / 8
    expected = sample(pipe)
    pipe.to(torch.bfloat16)
    calls = []
    pipe.transformer.register_forward_pre_hook(lambda module, args: calls.append(1))
    with pytest.raises(ValueError, match=r"dynamic quantization replaced \(embed.text_adapter, .*torch.bfloat16"):
        sample(pipe)
    assert calls == []
    pipe.transformer.to(torch.float32)  # the message's fix
    assert dynamically_quantized_layers(pipe.transformer)  # the int8 layers stayed
    images = sample(pipe)  # the text encoder and the VAE run in bf16 now
    assert torch.isfinite(images).all() and (images.float() - expected).abs().mean() < 0.01


@pytest.mark.slow
def test_a_lora_and_freezing_are_refused_by_a_quantized_transformer_and_the_fixes_work(tmp_path):
    shapes_lora(tmp_path / "lora", std=0.05)  # a LoRA that changes the images well beyond int8's rounding
    with pytest.raises(ValueError, match=r"torch's dynamic quantization \(quantize_dynamic\) replaced.*fuse it"):
        quantized_shapes_pipeline().load_lora_weights(tmp_path / "lora")
    pipe = shapes_pipeline()  # the fix: load into the float model, fuse, unload the adapter, then quantize
    pipe.load_lora_weights(tmp_path / "lora")
    pipe.fuse_lora()
    pipe.unload_lora_weights()
    fused_float = sample(pipe)
    quantized_shapes_pipeline(pipe)
    assert not any(type(module) is nn.Linear or "lora" in name for name, module in pipe.transformer.named_modules())
    fused_int8, base_int8 = sample(pipe), sample(quantized_shapes_pipeline())
    assert (fused_int8 - fused_float).abs().mean() < (fused_int8 - base_int8).abs().mean() / 4
    # Freezing is refused before compiling: the int8 layers break dynamo's graph, and would sample slower frozen.
    pipe = quantized_shapes_pipeline()
    with pytest.raises(ValueError, match=r"dynamic quantization replaced \(embed.text_adapter, .*without freezing"):
        pipe.enable_inductor_freezing()
    assert not pipe.inductor_freezing_enabled
    pipe = shapes_pipeline()  # quantized after freezing was enabled: the call refuses before anything compiles
    pipe.enable_inductor_freezing()
    quantized_shapes_pipeline(pipe)
    with pytest.raises(ValueError, match="Freezing cannot compile"):
        sample(pipe, steps=2)
    assert pipe._inductor_freezing.freezes == 0
    pipe.disable_inductor_freezing()  # the message's fix
    assert torch.isfinite(sample(pipe, steps=2)).all()
