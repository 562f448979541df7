"""GPU readiness without a GPU: the training step and the pipeline keep every tensor on the model's device and read
nothing back but their checks (run in `FakeTensorMode` on a fake "meta" device, the checks that read a value replaced
by stand-ins asserting where their input lies); bf16 trains and samples end to end, close to fp32."""

import functools

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from diffusers import DDPMScheduler
from diffusers.optimization import get_scheduler
from diffusers.training_utils import EMAModel
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


DEVICE = torch.device("meta")  # the fake GPU
CPU = torch.device("cpu")
BATCH, MICRO_BATCH = 4, 2  # two micro-batches: gradient accumulation runs too
LATENT = (TINY["in_channels"], TINY["sample_size"], TINY["sample_size"])  # of test_models' tiny models
TEXT = (TINY["text_seq_len"], TINY["text_embed_dim"])


@pytest.fixture(autouse=True)
def one_thread():  # tiny models run fastest on one thread
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


# Ops that take tensors on two devices on a GPU too: copies between devices, and indexing with CPU indices.
aten = torch.ops.aten
CROSS_DEVICE_OPS = {aten._to_copy.default, aten.copy_.default, aten.index.Tensor, aten.index_put_.default,
                    aten._index_put_impl_.default}  # fmt: skip


class DeviceAudit(TorchDispatchMode):
    """Record what fake mode lets through but a GPU would refuse or wait for: `mixed`, ops given tensors on two
    devices (fake mode takes `embedding` with CPU ids); `reads`, values read or copied back from `DEVICE`."""

    def __init__(self):
        super().__init__()
        self.mixed: list[str] = []
        self.reads: list[str] = []

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


def assert_on(tensor: torch.Tensor, device: torch.device, what: str) -> None:
    assert tensor.device == device, f"{what}: on {tensor.device}, expected on {device}"


@pytest.fixture
def timestep_checks(monkeypatch) -> list[torch.Tensor]:
    """The backbone's timestep range check, recording its input, which must be on the CPU."""
    checked = []

    def check(timestep):
        assert_on(timestep, CPU, "the timesteps whose range the backbone checks")
        checked.append(timestep)

    monkeypatch.setattr(backbone, "_check_timestep_values", check)
    return checked


def loss_options(kind: str, max_grad_norm: float | None = 1.0) -> LossOptions:
    """Every loss term the family has (max_grad_norm None: the norm measured, not clipped)."""
    return LossOptions(
        snr_gamma=5.0, noise_offset=0.1, load_balance_weight=0.01 if kind == "moe_mlp" else 0.0,
        symmetry_breaking_weight=0.1 if kind == "asymmixer" else 0.0, max_grad_norm=max_grad_norm,
    )  # fmt: skip


def prepared(accelerator: Accelerator, model: torch.nn.Module, learning_rate: float = 1e-3):
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
    return accelerator.prepare(model, optimizer, get_scheduler("constant", optimizer=optimizer))


@pytest.mark.slow
@pytest.mark.parametrize("max_grad_norm", [1.0, None], ids=["clipped", "norm-only"])
@pytest.mark.parametrize("kind", list(FAMILIES))
def test_a_training_step_keeps_every_tensor_on_the_model_device(kind, max_grad_norm, monkeypatch, timestep_checks):
    checks = []

    def check_on_device(loss, grad_norm, step, history=None):
        for name, value in (("loss", loss), ("gradient norm", grad_norm)):
            assert_on(value, DEVICE, f"the step's {name}")
            assert value.shape == () and value.dtype == torch.float32, (name, value.shape, value.dtype)
        checks.append(step)

    monkeypatch.setattr(training_step_module, "check_finite", check_on_device)
    # The model is already on the fake device; the Accelerator runs as on a GPU otherwise.
    accelerator = Accelerator(cpu=True, device_placement=False, gradient_accumulation_steps=BATCH // MICRO_BATCH)
    with torch.device("meta"):
        model = MODELS[kind]().train()  # built without weights: the fake mode gives them below
    with FakeTensorMode():
        noise_scheduler = DDPMScheduler.from_config(default_scheduler().config)
        # As in the trainer, the EMA is made before the model moves to the device.
        ema = EMAModel([torch.nn.Parameter(torch.empty(p.shape)) for p in model.parameters()], foreach=True)
        model, optimizer, lr_scheduler = prepared(accelerator, to_fake(model, DEVICE))
        latents = torch.randn(BATCH, *LATENT, device=DEVICE)
        text_states = torch.randn(BATCH, *TEXT, device=DEVICE)
        generator = torch.Generator().manual_seed(0)  # the trainer's step generator, on the CPU
        with DeviceAudit() as audit:
            result = training_step(
                accelerator, model, optimizer, lr_scheduler, noise_scheduler, latents, text_states, generator,
                micro_batch_size=MICRO_BATCH, options=loss_options(kind, max_grad_norm), step=7, ema=ema,
            )  # fmt: skip

    assert checks == [7]  # once, after the last micro-batch
    assert len(timestep_checks) == BATCH // MICRO_BATCH  # one forward per micro-batch
    assert audit.mixed == []
    assert audit.reads == []  # check_finite is the step's one read
    assert result.loss.device == result.grad_norm.device == DEVICE
    parameters = list(model.parameters())
    assert all(p.device == DEVICE and p.grad is None for p in parameters)
    assert all(shadow.device == DEVICE for shadow in ema.shadow_params), "the EMA did not follow the model"
    assert ema.optimization_step == 1
    states = [optimizer.state[p] for p in parameters]
    assert all(state["exp_avg"].device == DEVICE and state["exp_avg_sq"].device == DEVICE for state in states)
    assert all(state["step"].device == CPU for state in states)  # AdamW keeps its step count on the CPU by design


@pytest.mark.parametrize("output_type, inputs", [("pt", "prompt"), ("latent", "prompt"), ("pt", "tensors on the CPU")])
def test_a_pipeline_call_keeps_every_tensor_on_the_model_device(
    make_pipe, output_type, inputs, monkeypatch, timestep_checks
):
    pipe = make_pipe()
    finite_checks = []

    def check_on_device(images, message):
        assert_on(images, DEVICE, "the images checked for NaN")
        finite_checks.append(images.shape)

    def first_step_index(timestep, schedule_timesteps=None):
        # The scheduler's lookup of the first timestep in its schedule (a read), made on the device.
        assert_on(timestep, DEVICE, "the scheduler's timestep")
        assert_on(pipe.scheduler.timesteps, DEVICE, "the scheduler's timesteps")
        return 0

    set_timesteps, devices = pipe.scheduler.set_timesteps, []

    def set_timesteps_outside_fake_mode(*args, device=None, **kwargs):
        # diffusers' schedulers compute their schedules on the host, with NumPy: real tensors, out of fake mode.
        devices.append(device)
        with unset_fake_temporarily():
            set_timesteps(*args, device=device, **kwargs)

    monkeypatch.setattr(pipeline_lmlp, "_raise_if_not_finite", check_on_device)
    monkeypatch.setattr(pipe.scheduler, "index_for_timestep", first_step_index)
    monkeypatch.setattr(pipe.scheduler, "set_timesteps", set_timesteps_outside_fake_mode)
    # Real tensors of the scheduler (its schedule, on the CPU or the meta device) become fake ones of their device.
    with FakeTensorMode(allow_non_fake_inputs=True):
        for component in (pipe.text_encoder, pipe.transformer, pipe.vae):
            to_fake(component, DEVICE)
        if inputs == "prompt":
            arguments = {"prompt": "a red circle", "generator": torch.Generator().manual_seed(0)}
        else:  # what a user may pass from elsewhere: text states and initial noise, on the CPU
            arguments = {
                "prompt_embeds": torch.randn(1, *TEXT_SHAPE),
                "negative_prompt_embeds": torch.randn(1, *TEXT_SHAPE),
                "latents": torch.randn(1, *LATENT_SHAPE),
            }
        with DeviceAudit() as audit:
            images = pipe(num_inference_steps=2, guidance_scale=2.0, output_type=output_type, **arguments).images

    assert pipe._execution_device == DEVICE
    assert devices == [DEVICE]  # so the scheduler's timesteps are on the device
    # The one copy back: the timesteps, once, for the backbone's range check on the CPU.
    assert audit.mixed == []
    assert audit.reads == ["aten._to_copy.default of a (2,) tensor to the CPU"]
    assert [tuple(t.shape) for t in timestep_checks] == [(2,), (2,)]  # [unconditional | conditional], 2 steps
    assert_on(images, DEVICE, "the images")
    assert images.dtype == torch.float32
    if output_type == "latent":
        assert images.shape == (1, *LATENT_SHAPE) and finite_checks == [images.shape]
    else:
        assert images.shape == (1, 3, NATIVE, NATIVE) and finite_checks == [(1, *LATENT_SHAPE), images.shape]


@pytest.mark.parametrize("max_grad_norm", [1.0, None], ids=["clipped", "norm-only"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_step_raises_and_leaves_the_weights_untouched(bad, max_grad_norm):
    accelerator = Accelerator(cpu=True)
    model = make_model("moe_mlp").train()
    ema = EMAModel(model.parameters(), foreach=True)
    model, optimizer, lr_scheduler = prepared(accelerator, model)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    latents = torch.randn(BATCH, *LATENT, generator=torch.Generator().manual_seed(0))
    latents[1, 0, 2, 3] = bad
    text_states = torch.randn(BATCH, *TEXT, generator=torch.Generator().manual_seed(1))
    noise_scheduler = DDPMScheduler.from_config(default_scheduler().config)
    with pytest.raises(DivergenceError, match=r"^the loss is nan at step 5 \(gradient norm nan\)$"):
        training_step(
            accelerator, model, optimizer, lr_scheduler, noise_scheduler, latents, text_states,
            torch.Generator().manual_seed(0), micro_batch_size=BATCH, options=loss_options("moe_mlp", max_grad_norm),
            step=5, ema=ema,
        )  # fmt: skip
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, before[name], rtol=0, atol=0, msg=name)
        assert p.grad is None, name  # the gradients are dropped, never applied
    assert not optimizer.state and lr_scheduler.scheduler.last_epoch == 0
    assert ema.optimization_step == 0


def train_one_step(kind: str, mixed_precision: str) -> tuple[torch.Tensor, dict, dict, dict]:
    """One CPU training step of a tiny `kind`: its loss, and each parameter's gradient, value before and after."""
    AcceleratorState._reset_state(reset_partial_state=True)  # a new mixed precision needs a new accelerate state
    accelerator = Accelerator(mixed_precision=mixed_precision, cpu=True, gradient_accumulation_steps=2)
    model = make_model(kind).train()
    names = {p: name for name, p in model.named_parameters()}
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    ema = EMAModel(model.parameters(), foreach=True)
    model, optimizer, lr_scheduler = prepared(accelerator, model)
    gradients = {}

    def keep_gradients(optimizer, args, kwargs):
        for p in (p for group in optimizer.param_groups for p in group["params"]):
            gradients[names[p]] = None if p.grad is None else p.grad.clone()

    optimizer.optimizer.register_step_pre_hook(keep_gradients)
    data = torch.Generator().manual_seed(0)
    latents, text_states = torch.randn(BATCH, *LATENT, generator=data), torch.randn(BATCH, *TEXT, generator=data)
    noise_scheduler = DDPMScheduler.from_config(default_scheduler().config)
    result = training_step(
        accelerator, model, optimizer, lr_scheduler, noise_scheduler, latents, text_states,
        torch.Generator().manual_seed(1), micro_batch_size=MICRO_BATCH, options=loss_options(kind), step=1, ema=ema,
    )  # fmt: skip
    after = {names[p]: p.detach().clone() for p in accelerator.unwrap_model(model).parameters()}
    return result.loss, gradients, before, after


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_a_bf16_training_step_trains_every_parameter_and_matches_fp32(kind):
    loss, gradients, before, after = train_one_step(kind, "bf16")
    reference_loss, reference_gradients, reference_before, _ = train_one_step(kind, "no")

    assert torch.isfinite(loss)
    assert set(gradients) == set(before)
    no_signal = [name for name, g in gradients.items() if g is None or not torch.isfinite(g).all() or not g.any()]
    assert not no_signal, f"parameters without a gradient in bf16: {no_signal}"
    unchanged = [name for name in before if torch.equal(after[name], before[name])]
    assert not unchanged, f"parameters the bf16 step did not change: {unchanged}"
    # The same weights, data and noise in fp32. Each bf16 rounding is ≤ 2⁻⁹ ≈ 0.2%; the gradient is off by ~0.5%
    # here, so 2% fails only on a term in the wrong dtype or dropped. The loss, mostly the noise's MSE: within 0.1%.
    torch.testing.assert_close(before, reference_before, rtol=0, atol=0)
    torch.testing.assert_close(loss, reference_loss, rtol=1e-3, atol=0)
    gradient = torch.cat([gradients[name].flatten() for name in reference_gradients])
    assert relative_error(gradient, torch.cat([g.flatten() for g in reference_gradients.values()])) < 2e-2


def sample_recording_noise(pipe, generate, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """`generate`'s guided images, and the noise predictions the solver got (steps, B, C, h, w) in fp32."""
    step, predictions = pipe.scheduler.step, []

    @functools.wraps(step)  # the same signature: the pipeline looks for a `generator` argument
    def recording_step(model_output, *args, **step_kwargs):
        predictions.append(model_output.float())
        return step(model_output, *args, **step_kwargs)

    pipe.scheduler.step = recording_step
    try:
        return generate(pipe, guidance_scale=2.0, **kwargs), torch.stack(predictions)
    finally:
        del pipe.scheduler.step


@pytest.mark.parametrize("bf16", ["weights", "autocast"])
def test_a_bf16_pipeline_call_gives_finite_images_close_to_fp32(make_pipe, generate, bf16):
    pipe = make_pipe()
    reference, reference_noise = sample_recording_noise(pipe, generate)
    reference_latents = generate(pipe, guidance_scale=2.0, output_type="latent")
    if bf16 == "weights":
        pipe.to(dtype=torch.bfloat16)
        assert {pipe.text_encoder.dtype, pipe.transformer.dtype, pipe.vae.dtype} == {torch.bfloat16}
        images, noise = sample_recording_noise(pipe, generate)
        latents = generate(pipe, guidance_scale=2.0, output_type="latent")
        assert latents.dtype == torch.bfloat16  # the transformer's dtype
    else:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            images, noise = sample_recording_noise(pipe, generate)
            latents = generate(pipe, guidance_scale=2.0, output_type="latent")
        assert latents.dtype == torch.float32  # still the transformer's: the solver computes x₀ in fp32
    assert images.dtype == torch.bfloat16 and images.shape == reference.shape
    assert torch.isfinite(images).all() and images.min() >= 0 and images.max() <= 1
    # The predictions are off by 0.5-0.8%: 2% fails on a coarser cast (float8 guidance: 2.8%) or a wrong scale. The
    # images are off by 0.006 at most, 0.0013 on average: bounds of five 8-bit grey levels and one.
    assert relative_error(noise, reference_noise) < 2e-2
    assert relative_error(latents, reference_latents) < 2e-2
    error = (images.float() - reference).abs()
    assert error.max() < 2e-2 and error.mean() < 4e-3, (error.max(), error.mean())
