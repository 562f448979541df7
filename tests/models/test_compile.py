"""Compiled backbones give eager's numbers, with hooks and LoRA still applied on the papers' three models."""

from collections import Counter

import pytest
import torch
from test_models import KINDS
from test_peft import BLOCK_TARGETS, lora_config, make_inputs, make_model
from torch import nn


COMPILED = ["lmlp", "moe_mlp", "uvit"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", [kind for kind in KINDS if kind not in COMPILED])
def test_every_other_kind_compiles_to_the_same_output(kind):
    model, inputs = make_model(kind), make_inputs()
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model)(*inputs).sample, model(*inputs).sample, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["regional", "compile"])
@pytest.mark.parametrize("kind", COMPILED)
def test_compiled_model_keeps_lora_and_hooks(kind, mode):
    eager, compiled_model = make_model(kind), make_model(kind)
    calls = {eager: Counter(), compiled_model: Counter()}
    for model, counter in calls.items():
        model.add_adapter(lora_config(*BLOCK_TARGETS[kind]))
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear):
                module.register_forward_hook(lambda *_, name=name, counter=counter: counter.update([name]))
    compiled_model.load_state_dict(eager.state_dict())
    runner = compiled_model if mode == "regional" else torch.compile(compiled_model)
    if mode == "regional":
        compiled_model.compile_repeated_blocks()
    inputs = make_inputs()
    with torch.no_grad():
        expected = eager(*inputs).sample
        for _ in range(2):  # the second call runs the cached graph
            torch.testing.assert_close(runner(*inputs).sample, expected, rtol=1e-4, atol=1e-5)
        assert any("lora_A" in name for name in calls[compiled_model])
        assert {name: 2 * count for name, count in calls[eager].items()} == calls[compiled_model]
        compiled_model.disable_adapters()
        eager.disable_adapters()
        without = runner(*inputs).sample
        assert (without - expected).abs().max() > 1e-3  # else the compiled graph skipped the adapter
        torch.testing.assert_close(without, eager(*inputs).sample, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["regional", "compile"])
def test_pipeline_with_a_compiled_transformer_samples_the_same_images(make_pipe, mode):
    """docs/benchmarks.md's sampling recipes: `pipe.transformer.compile_repeated_blocks()` and `torch.compile`."""
    pipe = make_pipe("lmlp")
    call = dict(prompt=["a red circle", "a blue square"], num_inference_steps=3, output_type="np")
    expected = pipe(**call, generator=torch.Generator().manual_seed(0)).images
    if mode == "regional":
        pipe.transformer.compile_repeated_blocks()
    else:
        pipe.transformer = torch.compile(pipe.transformer)
    got = pipe(**call, generator=torch.Generator().manual_seed(0)).images
    assert got.shape == expected.shape and abs(got - expected).max() < 1e-4
