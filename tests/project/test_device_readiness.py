"""GPU readiness on a fake device (FakeTensorMode): steps and calls keep every tensor there; bf16 is close to fp32."""

from unittest.mock import Mock, patch

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from diffusers import DDPMScheduler
from diffusers.optimization import get_scheduler
from diffusers.training_utils import EMAModel
from space_server import one_cpu_thread
from test_models import MODELS, TINY, make_model
from test_pipeline import LATENT_SHAPE, NATIVE, TEXT_SHAPE
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import diffusers_lmlp.models.backbone as backbone
import diffusers_lmlp.pipelines.pipeline_lmlp as pipeline_lmlp
import diffusers_lmlp.training.step as training_step_module
from diffusers_lmlp import FAMILIES
from diffusers_lmlp.pipelines import default_scheduler
from diffusers_lmlp.training.step import DivergenceError, LossOptions, training_step


DEVICE, CPU = torch.device("meta"), torch.device("cpu")  # the fake GPU, and the host
BATCH, MICRO_BATCH = 4, 2  # two micro-batches: gradient accumulation runs too
LATENT = (TINY["in_channels"], TINY["sample_size"], TINY["sample_size"])  # of test_models' tiny models
TEXT = (TINY["text_seq_len"], TINY["text_embed_dim"])


@pytest.fixture(autouse=True)
def one_thread():  # tiny models run fastest on one thread
    with one_cpu_thread():
        yield


# Ops that take tensors on two devices on a GPU too: copies between devices, and indexing with CPU indices.
aten = torch.ops.aten
CROSS_DEVICE_OPS = {aten._to_copy.default, aten.copy_.default, aten.index.Tensor, aten.index_put_.default,
                    aten._index_put_impl_.default}  # fmt: skip


class DeviceAudit(TorchDispatchMode):
    """What fake mode lets through but a GPU would refuse or wait for: `mixed`, ops given two devices' tensors (fake
    mode takes `embedding` with CPU ids); `reads`, values read or copied back from `DEVICE`."""

    def __init__(self):
        super().__init__()
        self.mixed, self.reads = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        devices = {t.device for t in tensors if t.ndim > 0 or t.device != CPU}
        if len(devices) > 1 and func not in CROSS_DEVICE_OPS:
            self.mixed.append(f"{func} on {sorted(map(str, devices))}")
        if func is aten._local_scalar_dense.default and tensors[0].device == DEVICE:
            self.reads.append(f"{func} of a {tuple(tensors[0].shape)} tensor")
        elif func is aten._to_copy.default and tensors[0].device == DEVICE and kwargs.get("device") == CPU:
            self.reads.append(f"{func} of a {tuple(tensors[0].shape)} tensor to the CPU")
        elif func is aten.copy_.default and tensors[0].device == CPU and tensors[1].device == DEVICE:
            self.reads.append(f"{func} of a {tuple(tensors[1].shape)} tensor to the CPU")
        return func(*args, **kwargs)


def to_fake(module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """Every parameter and buffer of `module` made a fake one on `device`, inside the fake mode (`.to` cannot)."""
    return module._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    return float((value.float() - reference).norm() / reference.norm())


def inputs_of(check: Mock) -> list[tuple]:  # the (device, shape) of the tensors each call of a replaced check got
    return [tuple((t.device, tuple(t.shape)) for t in c.args if torch.is_tensor(t)) for c in check.call_args_list]


@pytest.fixture
def timestep_checks(monkeypatch) -> Mock:
    """The backbone's timestep range check (which reads its input: it must be on the CPU), replaced by a recorder."""
    monkeypatch.setattr(backbone, "_check_timestep_values", check := Mock(return_value=None))
    return check


def loss_options(kind: str, max_grad_norm: float | None = 1.0) -> LossOptions:
    """Every loss term the family has (max_grad_norm None: the norm measured, not clipped)."""
    return LossOptions(
        snr_gamma=5.0, noise_offset=0.1, load_balance_weight=0.01 if kind == "moe_mlp" else 0.0,
        symmetry_breaking_weight=0.1 if kind == "asymmixer" else 0.0, max_grad_norm=max_grad_norm,
    )  # fmt: skip


def prepared(accelerator: Accelerator, model: torch.nn.Module):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return accelerator.prepare(model, optimizer, get_scheduler("constant", optimizer=optimizer))


@pytest.mark.slow
@pytest.mark.parametrize("max_grad_norm", [1.0, None], ids=["clipped", "norm-only"])
@pytest.mark.parametrize("kind", list(FAMILIES))
def test_a_training_step_keeps_every_tensor_on_the_model_device(kind, max_grad_norm, monkeypatch, timestep_checks):
    monkeypatch.setattr(training_step_module, "check_finite", finite := Mock(return_value=None))
    # The model is already on the fake device; the Accelerator runs as on a GPU otherwise.
    accelerator = Accelerator(cpu=True, device_placement=False, gradient_accumulation_steps=BATCH // MICRO_BATCH)
    with torch.device("meta"):
        model = MODELS[kind]().train()  # built without weights: the fake mode gives them below
    with FakeTensorMode():
        noise_scheduler = DDPMScheduler.from_config(default_scheduler().config)
        # As in the trainer, the EMA is made before the model moves to the device.
        ema = EMAModel([torch.nn.Parameter(torch.empty(p.shape)) for p in model.parameters()], foreach=True)
        model, optimizer, lr_scheduler = prepared(accelerator, to_fake(model, DEVICE))
        latents, text_states = torch.randn(BATCH, *LATENT, device=DEVICE), torch.randn(BATCH, *TEXT, device=DEVICE)
        generator = torch.Generator().manual_seed(0)  # the trainer's step generator, on the CPU
        with DeviceAudit() as audit:
            result = training_step(
                accelerator, model, optimizer, lr_scheduler, noise_scheduler, latents, text_states, generator,
                micro_batch_size=MICRO_BATCH, options=loss_options(kind, max_grad_norm), step=7, ema=ema,
            )  # fmt: skip

    # check_finite once, after the last micro-batch (the step's one read); one forward per micro-batch.
    assert inputs_of(finite) == [((DEVICE, ()), (DEVICE, ()))] and finite.call_args.args[2] == 7
    assert inputs_of(timestep_checks) == [((CPU, (MICRO_BATCH,)),)] * 2 and (audit.mixed, audit.reads) == ([], [])
    assert result.loss.dtype == result.grad_norm.dtype == torch.float32
    assert all(p.device == DEVICE and p.grad is None for p in model.parameters())
    assert all(shadow.device == DEVICE for shadow in ema.shadow_params) and ema.optimization_step == 1
    states = [optimizer.state[p] for p in model.parameters()]
    assert all(state["exp_avg"].device == state["exp_avg_sq"].device == DEVICE for state in states)
    assert all(state["step"].device == CPU for state in states)  # AdamW keeps its step count on the CPU by design


@pytest.mark.parametrize("output, inputs", [("pt", "prompt"), ("latent", "prompt"), ("pt", "tensors on the CPU")])
def test_a_pipeline_call_keeps_every_tensor_on_the_device(make_pipe, output, inputs, monkeypatch, timestep_checks):
    pipe = make_pipe()

    def first_step_index(timestep, schedule_timesteps=None):
        # The scheduler's lookup of the first timestep in its schedule (a read), made on the device.
        assert timestep.device == pipe.scheduler.timesteps.device == DEVICE, "the scheduler's timesteps"
        return 0

    set_timesteps, devices = pipe.scheduler.set_timesteps, []

    def set_timesteps_outside_fake_mode(*args, device=None, **kwargs):
        # diffusers' schedulers compute their schedules on the host, with NumPy: real tensors, out of fake mode.
        devices.append(device)
        with unset_fake_temporarily():
            set_timesteps(*args, device=device, **kwargs)

    monkeypatch.setattr(pipeline_lmlp, "_raise_if_not_finite", finite := Mock(return_value=None))
    monkeypatch.setattr(pipe.scheduler, "index_for_timestep", first_step_index)
    monkeypatch.setattr(pipe.scheduler, "set_timesteps", set_timesteps_outside_fake_mode)
    # Real tensors of the scheduler (its schedule, on the CPU or the meta device) become fake ones of their device.
    with FakeTensorMode(allow_non_fake_inputs=True):
        for component in (pipe.text_encoder, pipe.transformer, pipe.vae):
            to_fake(component, DEVICE)
        if inputs == "prompt":
            arguments = {"prompt": "a red circle", "generator": torch.Generator().manual_seed(0)}
        else:  # what a user may pass from elsewhere: text states and initial noise, on the CPU
            arguments = {name: torch.randn(1, *TEXT_SHAPE) for name in ("prompt_embeds", "negative_prompt_embeds")}
            arguments["latents"] = torch.randn(1, *LATENT_SHAPE)
        with DeviceAudit() as audit:
            images = pipe(num_inference_steps=2, guidance_scale=2.0, output_type=output, **arguments).images

    assert pipe._execution_device == DEVICE and devices == [DEVICE]  # so the scheduler's timesteps are on the device
    # The one copy back: the timesteps, once, for the backbone's range check on the CPU.
    assert (audit.mixed, audit.reads) == ([], ["aten._to_copy.default of a (2,) tensor to the CPU"])
    assert inputs_of(timestep_checks) == [((CPU, (2,)),)] * 2  # [unconditional | conditional], 2 steps
    assert images.device == DEVICE and images.dtype == torch.float32
    checked = [(1, *LATENT_SHAPE)] + ([] if output == "latent" else [(1, 3, NATIVE, NATIVE)])  # for NaN
    assert tuple(images.shape) == checked[-1] and inputs_of(finite) == [((DEVICE, shape),) for shape in checked]


def cpu_step(kind: str, mixed_precision: str = "no", bad: float = 0.0, max_grad_norm: float | None = 1.0):
    """One CPU step of a tiny `kind` in two micro-batches, `bad` added to its latents: what `training_step` returned or
    raised, each parameter's gradient at the optimizer step, its value before and after, and the training objects."""
    AcceleratorState._reset_state(reset_partial_state=True)  # a new mixed precision needs a new accelerate state
    accelerator = Accelerator(mixed_precision=mixed_precision, cpu=True, gradient_accumulation_steps=2)
    model = make_model(kind).train()
    names = {p: name for name, p in model.named_parameters()}
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    ema = EMAModel(model.parameters(), foreach=True)
    model, optimizer, lr_scheduler = prepared(accelerator, model)
    gradients = {}  # each parameter's, at the optimizer step
    optimizer.optimizer.register_step_pre_hook(
        lambda optimizer, args, kwargs: gradients.update(
            {names[p]: None if p.grad is None else p.grad.clone() for g in optimizer.param_groups for p in g["params"]}
        )
    )
    data = torch.Generator().manual_seed(0)
    latents, text_states = torch.randn(BATCH, *LATENT, generator=data), torch.randn(BATCH, *TEXT, generator=data)
    latents[1, 0, 2, 3] += bad
    noise_scheduler = DDPMScheduler.from_config(default_scheduler().config)
    try:
        result = training_step(
            accelerator, model, optimizer, lr_scheduler, noise_scheduler, latents, text_states,
            torch.Generator().manual_seed(1), micro_batch_size=MICRO_BATCH, options=loss_options(kind, max_grad_norm),
            step=5, ema=ema,
        )  # fmt: skip
    except DivergenceError as error:
        result = error
    after = {names[p]: p.detach().clone() for p in accelerator.unwrap_model(model).parameters()}
    return result, gradients, before, after, (model, optimizer, lr_scheduler, ema)


@pytest.mark.parametrize("max_grad_norm", [1.0, None], ids=["clipped", "norm-only"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_step_raises_and_leaves_the_weights_untouched(bad, max_grad_norm):
    error, gradients, before, after, (model, optimizer, scheduler, ema) = cpu_step("moe_mlp", "no", bad, max_grad_norm)
    assert isinstance(error, DivergenceError) and str(error) == "the loss is nan at step 5 (gradient norm nan)"
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    assert gradients == {} and all(p.grad is None for p in model.parameters())  # dropped, never applied
    assert not optimizer.state and scheduler.scheduler.last_epoch == 0 and ema.optimization_step == 0


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_a_bf16_training_step_trains_every_parameter_and_matches_fp32(kind):
    result, gradients, before, after, _ = cpu_step(kind, "bf16")
    reference, reference_gradients, reference_before, _, _ = cpu_step(kind, "no")
    assert torch.isfinite(result.loss) and set(gradients) == set(before)
    no_signal = [name for name, g in gradients.items() if g is None or not torch.isfinite(g).all() or not g.any()]
    assert not no_signal, f"parameters without a gradient in bf16: {no_signal}"
    unchanged = [name for name in before if torch.equal(after[name], before[name])]
    assert not unchanged, f"parameters the bf16 step did not change: {unchanged}"
    # Against fp32 (same weights, data, noise): the gradient is off ~0.5%, 2% only with a term dropped or mistyped.
    torch.testing.assert_close(before, reference_before, rtol=0, atol=0)
    torch.testing.assert_close(result.loss, reference.loss, rtol=1e-3, atol=0)
    gradient = torch.cat([gradients[name].flatten() for name in reference_gradients])
    assert relative_error(gradient, torch.cat([g.flatten() for g in reference_gradients.values()])) < 2e-2


def sample_recording_noise(pipe, generate) -> tuple[torch.Tensor, torch.Tensor]:
    """`generate`'s guided images, and the noise predictions the solver got (steps, B, C, h, w) in fp32."""
    with patch.object(pipe.scheduler, "step", autospec=True, side_effect=pipe.scheduler.step) as step:  # its signature
        images = generate(pipe, guidance_scale=2.0)
    return images, torch.stack([call.args[0].float() for call in step.call_args_list])


@pytest.mark.parametrize("bf16", ["weights", "autocast"])
def test_a_bf16_pipeline_call_gives_finite_images_close_to_fp32(make_pipe, generate, bf16):
    pipe = make_pipe()
    reference, reference_noise = sample_recording_noise(pipe, generate)
    reference_latents = generate(pipe, guidance_scale=2.0, output_type="latent")
    if bf16 == "weights":
        pipe.to(dtype=torch.bfloat16)
        assert {pipe.text_encoder.dtype, pipe.transformer.dtype, pipe.vae.dtype} == {torch.bfloat16}
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16 == "autocast"):
        images, noise = sample_recording_noise(pipe, generate)
        latents = generate(pipe, guidance_scale=2.0, output_type="latent")
    # The transformer's dtype: under autocast still fp32 (the solver computes x₀ in fp32).
    assert latents.dtype == (torch.bfloat16 if bf16 == "weights" else torch.float32)
    assert images.dtype == torch.bfloat16 and images.shape == reference.shape
    assert torch.isfinite(images).all() and images.min() >= 0 and images.max() <= 1
    # Predictions off 0.5-0.8% (float8 guidance: 2.8%); images ≤ 0.006, 0.0013 on average (5 and 1 grey levels).
    assert relative_error(noise, reference_noise) < 2e-2 and relative_error(latents, reference_latents) < 2e-2
    error = (images.float() - reference).abs()
    assert error.max() < 2e-2 and error.mean() < 4e-3, (error.max(), error.mean())
