"""`LMLPPipeline.enable_inductor_freezing()`: the transformer compiled with its weights as constants.

What must never happen is a sample drawn with weights that have since changed: every way of changing them (through
`.data`, `load_state_dict`, a LoRA operation, a dtype change, a hook) is checked against an unfrozen pipeline.
"""

import copy

import pytest
import torch
from accelerate.hooks import ModelHook, add_hook_to_module
from diffusers.utils.torch_utils import is_compiled_module
from test_lora_loading import write_lora
from torch import nn

from diffusers_lmlp import LMLPPipeline
from diffusers_lmlp.pipelines.freezing import FrozenTransformer, weights_fingerprint


pytestmark = pytest.mark.slow  # every test compiles

ATOL = 1e-4  # freezing fuses biases and GELUs into the GEMMs: float32 rounding differs in the last bits


def close(actual: torch.Tensor, expected: torch.Tensor, atol: float = ATOL) -> None:
    torch.testing.assert_close(actual, expected, rtol=0, atol=atol)


def graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def test_frozen_sampling_draws_the_unfrozen_images_for_every_batch_size(make_pipe, generate):
    pipe = make_pipe()
    expected = generate(pipe)
    pipe.enable_inductor_freezing()
    close(generate(pipe), expected)
    compiled = graphs()
    prompts = ["a red circle", "a blue square", "a green triangle"]
    close(generate(pipe, prompt=prompts, seed=1), generate(make_pipe(), prompt=prompts, seed=1))
    close(generate(pipe, num_images_per_prompt=2), generate(make_pipe(), num_images_per_prompt=2))
    assert graphs() == compiled, "a new batch size compiled again"
    assert pipe._inductor_freezing.freezes == 1, "the same weights were frozen again"
    assert not is_compiled_module(pipe.transformer)  # save_pretrained, hooks and adapters see the module itself
    pipe.disable_inductor_freezing()
    torch.testing.assert_close(generate(pipe), expected, rtol=0, atol=0)


def test_a_frozen_graph_keeps_its_weights_and_refreezing_again_and_again_stays_frozen():
    # Why the pipeline fingerprints the weights; and without a dynamo reset at each freeze, the ninth would run eagerly.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)).eval()
    x = torch.randn(4, 8)
    freezing = FrozenTransformer()
    with torch.no_grad():
        frozen = freezing.for_sampling(model)
        before = frozen(x)
        model[0].weight.data.mul_(2.0)  # in place through .data: no version bump, same storage
        close(frozen(x), before)  # stale: the old weights are constants of the graph
        assert (model(x) - before).abs().max() > 1e-2
        for _ in range(10):
            frozen = freezing.for_sampling(model)
            close(frozen(x), model(x))
            model[2].bias.data.add_(0.5)
        close(frozen(x), model(x) - 0.5)  # the last graph is frozen too: it still has the previous bias
    assert freezing.freezes == 11


def add_output_hook(pipe):
    pipe.transformer.head.proj.register_forward_hook(lambda module, args, output: 0.5 * output)


def load_other_weights(pipe, make_pipe):
    pipe.transformer.load_state_dict(make_pipe(seed=3).transformer.state_dict())


CHANGES = {
    "weights edited in place through .data": (lambda pipe, _: pipe.transformer.head.proj.weight.data.mul_(1.5), ATOL),
    "load_state_dict": (load_other_weights, ATOL),
    "a forward hook added": (lambda pipe, _: add_output_hook(pipe), ATOL),
    "a dtype change": (lambda pipe, _: pipe.transformer.to(torch.bfloat16), 0.02),
}


@pytest.mark.parametrize("change", CHANGES)
def test_a_change_after_freezing_is_sampled_with(make_pipe, generate, change):
    make_change, atol = CHANGES[change]
    pipe, unfrozen = make_pipe(), make_pipe()
    pipe.enable_inductor_freezing()
    close(generate(pipe), generate(unfrozen))
    make_change(pipe, make_pipe)
    make_change(unfrozen, make_pipe)
    changed = generate(unfrozen)
    if atol == ATOL:  # a bfloat16 image may differ from the float32 one by less than the check's margin
        assert (changed - generate(make_pipe())).abs().max() > 1e-3, "the change does not change the image"
    close(generate(pipe), changed, atol)
    assert pipe._inductor_freezing.freezes == 2


def test_every_lora_operation_after_freezing_is_sampled_with(make_pipe, generate, tmp_path):
    write_lora(make_pipe, tmp_path)
    pipe, unfrozen = make_pipe(), make_pipe()
    pipe.enable_inductor_freezing()
    generate(pipe)
    steps = {
        "load": lambda p: p.load_lora_weights(tmp_path, adapter_name="style"),
        "rescale": lambda p: p.set_adapters("style", adapter_weights=0.5),
        "fuse": lambda p: p.fuse_lora(),
        "unfuse": lambda p: p.unfuse_lora(),
        "disable": lambda p: p.disable_lora(),
        "enable": lambda p: p.enable_lora(),
        "unload": lambda p: p.unload_lora_weights(),
    }
    images = {}
    for name, step in steps.items():
        step(pipe)
        step(unfrozen)
        images[name] = generate(unfrozen)
        close(generate(pipe), images[name])
    assert (images["load"] - images["rescale"]).abs().max() > 1e-3
    assert (images["load"] - images["disable"]).abs().max() > 1e-3


def test_a_hook_present_when_freezing_is_in_the_graph(make_pipe, generate):
    pipe, unfrozen = make_pipe(), make_pipe()
    for p in (pipe, unfrozen):
        add_output_hook(p)
    pipe.enable_inductor_freezing()
    close(generate(pipe), generate(unfrozen))


def test_a_nan_weight_frozen_into_the_graph_raises_and_returns_no_image(make_pipe):
    pipe = make_pipe()
    pipe.enable_inductor_freezing()
    pipe("a red circle", num_inference_steps=2)  # frozen with finite weights
    pipe.transformer.head.proj.weight.data[0, 0] = float("nan")
    assert weights_fingerprint(pipe.transformer) == weights_fingerprint(pipe.transformer)  # a NaN equals itself
    for _ in range(2):  # frozen again with the NaN, then the same graph
        with pytest.raises(FloatingPointError, match="non-finite latents"):
            pipe("a red circle", num_inference_steps=2, output_type="pil")
    assert pipe._inductor_freezing.freezes == 2


def test_freezing_refuses_a_compiled_or_offloaded_transformer(make_pipe):
    pipe = make_pipe()
    pipe.transformer = torch.compile(pipe.transformer)
    with pytest.raises(ValueError, match=r"compiled already \(torch.compile\).*_orig_mod"):
        pipe.enable_inductor_freezing()
    pipe = make_pipe()
    add_hook_to_module(pipe.transformer, ModelHook())
    with pytest.raises(ValueError, match=r"model offloading.*remove_all_hooks"):
        pipe.enable_inductor_freezing()


def test_a_pipeline_made_with_from_pipe_samples_with_the_same_frozen_graph(make_pipe, generate):
    pipe = make_pipe()
    expected = generate(pipe)
    pipe.enable_inductor_freezing()
    generate(pipe)
    compiled = graphs()
    view = LMLPPipeline.from_pipe(pipe, scheduler=copy.deepcopy(pipe.scheduler))
    view.set_progress_bar_config(disable=True)
    assert view.inductor_freezing_enabled and view.transformer is pipe.transformer
    close(generate(view), expected)
    assert graphs() == compiled, "the shared graph compiled again"
    # What must never happen: a change made through one pipeline, sampled with stale weights by the other.
    load_other_weights(view, make_pipe)
    unfrozen = make_pipe()
    load_other_weights(unfrozen, make_pipe)
    changed = generate(unfrozen)
    assert (changed - expected).abs().max() > 1e-3, "the change does not change the image"
    close(generate(pipe), changed)
    close(generate(view), changed)
    assert pipe._inductor_freezing.freezes == 2
    # No freezing passes on when off, or to another transformer.
    assert not LMLPPipeline.from_pipe(pipe, transformer=make_pipe(seed=1).transformer).inductor_freezing_enabled
    pipe.disable_inductor_freezing()
    assert not pipe.inductor_freezing_enabled and not LMLPPipeline.from_pipe(pipe).inductor_freezing_enabled


def test_a_pipeline_frozen_past_the_recompile_limit_still_samples_frozen(make_pipe, generate):
    # Dynamo keeps at most `recompile_limit` (8) graphs for the forward every model of the class shares, then runs it
    # eagerly; lowered to 2 here, the third pipeline frozen is past it.
    assert torch._dynamo.config.recompile_limit == 8
    with torch._dynamo.config.patch(recompile_limit=2):
        for index in range(3):
            pipe = make_pipe(seed=index)
            pipe.enable_inductor_freezing()
            compiled = graphs()
            generate(pipe)
            assert graphs() > compiled, f"pipeline {index + 1} ran eagerly"
