"""Inductor freezing (weights compiled in) never samples stale weights, however they change (vs. unfrozen)."""

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


def halve_output(pipe: LMLPPipeline) -> None:
    pipe.transformer.head.proj.register_forward_hook(lambda module, args, output: 0.5 * output)


def test_frozen_sampling_draws_the_unfrozen_images_for_any_batch_and_view_but_not_compiled(make_pipe, generate):
    pipe, unfrozen = make_pipe(), make_pipe()
    for p in (pipe, unfrozen):  # a hook present when freezing is traced into the graph
        halve_output(p)
    expected = generate(unfrozen)
    pipe.enable_inductor_freezing()
    close(generate(pipe), expected)
    compiled = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    prompts = ["a red circle", "a blue square", "a green triangle"]
    close(generate(pipe, prompt=prompts, seed=1), generate(unfrozen, prompt=prompts, seed=1))
    close(generate(pipe, num_images_per_prompt=2), generate(unfrozen, num_images_per_prompt=2))
    view = LMLPPipeline.from_pipe(pipe, scheduler=copy.deepcopy(pipe.scheduler))
    view.set_progress_bar_config(disable=True)
    assert view.inductor_freezing_enabled and view.transformer is pipe.transformer
    close(generate(view), expected)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == compiled, "a batch size or view compiled again"
    assert pipe._inductor_freezing.freezes == 1, "the same weights were frozen again"
    assert not is_compiled_module(pipe.transformer)  # save_pretrained, hooks and adapters see the module itself
    # No freezing passes on to another transformer, or when off.
    assert not LMLPPipeline.from_pipe(pipe, transformer=make_pipe(seed=1).transformer).inductor_freezing_enabled
    pipe.disable_inductor_freezing()
    assert not LMLPPipeline.from_pipe(pipe).inductor_freezing_enabled
    torch.testing.assert_close(generate(pipe), expected, rtol=0, atol=0)
    torch_compiled, offloaded = make_pipe(), make_pipe()
    torch_compiled.transformer = torch.compile(torch_compiled.transformer)
    add_hook_to_module(offloaded.transformer, ModelHook())
    with pytest.raises(ValueError, match=r"compiled already \(torch.compile\).*_orig_mod"):
        torch_compiled.enable_inductor_freezing()
    with pytest.raises(ValueError, match="model offloading.*remove_all_hooks"):
        offloaded.enable_inductor_freezing()


def test_every_change_after_freezing_is_sampled_with(make_pipe, generate, tmp_path):
    write_lora(make_pipe, tmp_path)
    other_weights = make_pipe(seed=3).transformer.state_dict()
    pipe, unfrozen = make_pipe(), make_pipe()
    pipe.enable_inductor_freezing()
    view = LMLPPipeline.from_pipe(pipe, scheduler=copy.deepcopy(pipe.scheduler))
    view.set_progress_bar_config(disable=True)
    previous = generate(unfrozen)
    close(generate(pipe), previous)
    changes = [  # (what, how, whether it changes the image); the view's change must reach the pipeline too
        ("load_state_dict through from_pipe", lambda p: p.transformer.load_state_dict(other_weights), True),
        ("a forward hook added", halve_output, True),
        ("LoRA load", lambda p: p.load_lora_weights(tmp_path, adapter_name="style"), True),
        ("LoRA rescale", lambda p: p.set_adapters("style", adapter_weights=0.5), True),
        ("LoRA fuse", lambda p: p.fuse_lora(), False),
        ("LoRA unfuse", lambda p: p.unfuse_lora(), False),
        ("LoRA disable", lambda p: p.disable_lora(), True),
        ("LoRA enable", lambda p: p.enable_lora(), True),
        ("LoRA unload", lambda p: p.unload_lora_weights(), True),
        ("a dtype change", lambda p: p.transformer.to(torch.bfloat16), False),  # may differ by less than ATOL
    ]
    for what, change, changes_image in changes:
        change(view if "from_pipe" in what else pipe)
        change(unfrozen)
        changed = generate(unfrozen)
        if changes_image:
            assert (changed - previous).abs().max() > 1e-3, f"{what} does not change the image"
        for p in (pipe, view):
            close(generate(p), changed, 0.02 if what == "a dtype change" else ATOL)
        previous = changed
    # A weight edited in place through .data (no version bump, same storage) is frozen in again: a NaN raises.
    freezes = pipe._inductor_freezing.freezes
    pipe.transformer.head.proj.weight.data[0, 0] = float("nan")
    assert weights_fingerprint(pipe.transformer) == weights_fingerprint(pipe.transformer)  # a NaN equals itself
    for _ in range(2):  # frozen again with the NaN, then the same graph
        with pytest.raises(FloatingPointError, match="non-finite latents"):
            pipe("a red circle", num_inference_steps=2)
    assert pipe._inductor_freezing.freezes == freezes + 1


def test_a_frozen_graph_keeps_its_weights_and_refreezing_past_the_recompile_limit_stays_frozen():
    # Why weights are fingerprinted; past Dynamo's `recompile_limit` (8, here 2) graphs, freezes stay frozen (reset).
    assert torch._dynamo.config.recompile_limit == 8
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)).eval()
    x = torch.randn(4, 8)
    freezing = FrozenTransformer()
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=2):
        for _ in range(4):
            frozen = freezing.for_sampling(model)
            expected = model(x)
            close(frozen(x), expected)
            model[2].bias.data.add_(0.5)  # in place through .data: no version bump, same storage
            close(frozen(x), expected)  # stale: the old weights are constants of the graph
            assert (model(x) - expected).abs().max() > 0.4
    assert freezing.freezes == 4
