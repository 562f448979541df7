"""The trainer: the run, from the accelerator's set-up to the finished pipeline, and its loop of optimizer steps.
`run_training` sets the parts up in the order they depend on each other (the components, the data and feature store,
the optimizer, the checkpoint to resume from), then `take_steps` loops: a step, checkpoints, validations, and every
`--logging_steps` the mean loss, gradient norm and learning rate to the trackers (`TrackerLogs`). Every random choice
is a function of (seed, step, sample position), so a resumed run continues exactly as the uninterrupted one.
"""

import dataclasses
import logging
import sys
import time
from collections.abc import Callable, Generator
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import ProjectConfiguration, set_seed
from diffusers import DDPMScheduler
from diffusers.optimization import get_scheduler
from diffusers.training_utils import EMAModel
from transformers.utils import logging as transformers_logging

from diffusers_lmlp import default_scheduler
from diffusers_lmlp.allocator import keep_freed_memory
from diffusers_lmlp.progress import is_terminal, progress_bar
from diffusers_lmlp.threads import set_threads
from diffusers_lmlp.training import components, data, finishing, validation
from diffusers_lmlp.training.arguments import TrainingConfig
from diffusers_lmlp.training.checkpoints import (
    checkpoint_step,
    checkpoint_to_resume,
    diverged_message,
    exclusive_output_dir,
    register_checkpoint_hooks,
    remove_earlier_run,
    require_finite_weights,
    save_checkpoint,
    saved_train_seconds,
    warn_about_later_checkpoints,
)
from diffusers_lmlp.training.components import add_lora, lora_config
from diffusers_lmlp.training.data import load_training_data
from diffusers_lmlp.training.features import FeatureStore
from diffusers_lmlp.training.step import (
    DivergenceError,
    LossOptions,
    choose_compilation,
    choose_precision,
    divergence_history,
    effective_precision,
    follow_device,
    fused_adamw,
    plain_backbone,
    training_step,
)


logger = get_logger(__name__)


@dataclasses.dataclass
class Run:
    """What the steps of a run share, set up by `run_training`: `model` is the prepared (wrapped, perhaps compiled)
    backbone, `frozen` the tokenizer, text encoder and VAE, `store` the feature store or None."""

    args: TrainingConfig
    accelerator: Accelerator
    output_dir: Path
    model: torch.nn.Module
    ema: EMAModel | None
    optimizer: torch.optim.Optimizer
    lr_scheduler: object
    noise_scheduler: DDPMScheduler
    frozen: tuple
    store: FeatureStore | None


def allow_tf32() -> None:
    """Let float32 matmuls and cuDNN convolutions use TF32 (NVIDIA Ampere and newer), as diffusers' `--allow_tf32`
    does: faster, with a 10-bit mantissa; no effect on CPU."""
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    logger.info("TF32 allowed for float32 matmuls and convolutions (Ampere and newer GPUs)")


def train(args: TrainingConfig, exit_when_done: bool = False) -> None:
    """Set up accelerate, then train into `--output_dir`, which no other run may use meanwhile. With `exit_when_done`,
    end the process once the run is saved and every process has finished, before its objects are torn down (the
    command does so in multi-process runs; a caller that goes on after `train` must not)."""
    output_dir = Path(args.output_dir)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s", level=logging.INFO)
    mixed_precision, why = choose_precision(args.mixed_precision)
    dynamo_backend, why_compiled = choose_compilation(args.torch_compile, args.max_train_steps)
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        mixed_precision=mixed_precision,
        dynamo_backend=dynamo_backend,
        log_with=None if args.report_to == "none" else args.report_to,
        project_config=ProjectConfiguration(
            project_dir=str(output_dir), logging_dir=str(output_dir / args.logging_dir)
        ),
    )
    if not is_terminal(sys.stderr):  # a log file: the libraries' own bars (transformers' "Writing model shards" when
        transformers_logging.disable_progress_bar()  # saving, Hub downloads) would redraw with carriage returns there
    logger.info(
        f"{accelerator.num_processes} process(es), {accelerator.distributed_type}, {accelerator.device}, "
        f"mixed precision {effective_precision(accelerator, args)}{why}, "
        f"torch.compile {accelerator.state.dynamo_plugin.backend.value.lower()}{why_compiled}"
    )
    if args.allow_tf32:
        allow_tf32()
    set_threads(args.num_threads, "training", accelerator.num_processes == 1 and accelerator.device.type == "cpu")
    keep_freed_memory(accelerator.device)
    with exclusive_output_dir(accelerator, output_dir):
        run_training(args, accelerator, output_dir, exit_when_done)


def run_training(args: TrainingConfig, accelerator: Accelerator, output_dir: Path, exit_when_done: bool) -> None:
    """Train, checkpoint, validate, then save the pipeline (and push it with --push_to_hub)."""
    if args.overwrite_output_dir and accelerator.is_main_process:
        remove_earlier_run(output_dir)
    accelerator.wait_for_everyone()
    set_seed(args.seed)  # the initial weights; data, noise and timesteps come from per-step generators
    model, frozen = prepare_model(args, accelerator)
    cache_dir = Path(args.cache_dir) if args.cache_dir else output_dir.parent / ".lmlp-cache"
    dataset, store = load_data(args, accelerator, frozen, cache_dir)
    model, ema, optimizer, lr_scheduler = prepare_optimization(args, accelerator, model)
    noise_scheduler = DDPMScheduler.from_config(default_scheduler().config)
    global_step, seconds_before = resume(args, accelerator, optimizer, lr_scheduler, output_dir)

    source = data.BatchSource(
        args, dataset, store, *frozen, global_step,
        process_index=accelerator.process_index, num_processes=accelerator.num_processes,
    )  # fmt: skip
    step_batches = source.steps(global_step, args.max_train_steps)
    if accelerator.is_main_process:
        config = {k: v for k, v in finishing.public_args(args).items() if isinstance(v, int | float | str | bool)}
        accelerator.init_trackers(args.tracker_project_name, config=config)
    run = Run(args, accelerator, output_dir, model, ema, optimizer, lr_scheduler, noise_scheduler, frozen, store)
    train_seconds = take_steps(run, step_batches, global_step, seconds_before)  # over every segment of a resumed run
    finishing.end_run(accelerator, model, ema, *frozen, args, output_dir, train_seconds, exit_when_done)


def prepare_model(args: TrainingConfig, accelerator: Accelerator) -> tuple[torch.nn.Module, tuple]:
    """The backbone (with its LoRA adapter under `--lora_rank`) and the frozen (tokenizer, text encoder, VAE) on the
    run's device, checked against each other."""
    model = components.build_model(args)
    tokenizer, text_encoder, vae = components.load_components(args)
    fine_tuning = bool(args.pretrained_model_name_or_path)
    components.check_compatible(model, tokenizer, text_encoder, vae, args.resolution, fine_tuning)
    text_encoder.to(accelerator.device)
    vae.to(accelerator.device)
    if args.lora_rank:
        config = lora_config(model, args.lora_rank, args.lora_alpha, args.lora_dropout, args.lora_target_modules)
        adapted = add_lora(model, config)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        base = sum(p.numel() for p in model.parameters() if not p.requires_grad)  # the frozen backbone
        logger.info(
            f"LoRA rank {config.r}, alpha {config.lora_alpha:g}: {len(adapted)} layers adapted, {trainable:,} trainable "
            f"parameters ({trainable / base:.2%} of the backbone's {base:,})"
        )
    return model, (tokenizer, text_encoder, vae)


def load_data(args: TrainingConfig, accelerator: Accelerator, frozen: tuple, cache_dir: Path) -> tuple:
    """The training data (read or downloaded by the main process first), and its `FeatureStore` with
    `--cache_features`, else None."""
    with accelerator.main_process_first():
        try:
            dataset = load_training_data(
                dataset_name=args.dataset_name,
                dataset_config_name=args.dataset_config_name,
                train_data_dir=args.train_data_dir,
                data_layout=args.data_layout,
                image_column=args.image_column,
                caption_column=args.caption_column,
                max_train_samples=args.max_train_samples,
                streaming=args.streaming,
                seed=args.seed,
                cache_dir=str(cache_dir / "datasets"),
                world=args.world,
                shapes_split=args.shapes_split,
                shapes_num_images=args.shapes_num_images,
            )
        except ValueError as error:
            raise SystemExit(f"error: {error}") from None
    if not args.cache_features:
        return dataset, None
    start = time.perf_counter()
    store = data.build_feature_store(args, dataset, *frozen, accelerator, cache_dir)
    logger.info(
        f"feature cache {store.path.name}: {len(store)} images ready in {time.perf_counter() - start:.1f} s "
        f"({store.nbytes() / len(store):,.0f} bytes per image, text states in {args.cache_text_dtype or 'float32'})"
    )
    return dataset, store


def prepare_optimization(args: TrainingConfig, accelerator: Accelerator, model: torch.nn.Module) -> tuple:
    """The backbone in training mode, its `EMAModel` (or None), AdamW and the learning-rate schedule, prepared by
    accelerate, whose checkpoints then save and load the EMA and the LoRA adapter too."""
    model_class = type(model)
    if args.gradient_checkpointing:
        model.enable_gradient_checkpointing()
    model.train()
    ema = None
    if args.use_ema:
        # foreach: one multi-tensor update of every weight per step, not a Python loop of three ops per tensor.
        ema = EMAModel(
            model.parameters(), decay=args.ema_decay, model_cls=model_class, model_config=model.config, foreach=True
        )
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],  # with LoRA, the adapter's
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        weight_decay=args.adam_weight_decay,
        eps=args.adam_epsilon,
        fused=fused_adamw(accelerator.device),
    )
    lr_scheduler = get_scheduler(
        args.lr_scheduler,
        optimizer=optimizer,
        num_warmup_steps=args.lr_warmup_steps * accelerator.num_processes,
        num_training_steps=args.max_train_steps * accelerator.num_processes,
    )
    model, optimizer, lr_scheduler = accelerator.prepare(model, optimizer, lr_scheduler)
    register_checkpoint_hooks(accelerator, model_class, ema, lora=bool(args.lora_rank))
    return model, ema, optimizer, lr_scheduler


def resume(
    args: TrainingConfig,
    accelerator: Accelerator,
    optimizer: torch.optim.Optimizer,
    lr_scheduler,
    output_dir: Path,
) -> tuple[int, float]:
    """Load `--resume_from_checkpoint` (if given and found) into the prepared objects and keep the scores up to its
    step; return the step the run starts from and the training seconds before it."""
    global_step, seconds_before = 0, 0.0
    if args.resume_from_checkpoint:
        path = checkpoint_to_resume(output_dir, args.resume_from_checkpoint)
        if path is None:
            logger.info("--resume_from_checkpoint latest: no checkpoint yet, starting from scratch")
        else:
            accelerator.load_state(str(path))
            follow_device(optimizer, accelerator.device)
            apply_learning_rate(optimizer, lr_scheduler, args.learning_rate)
            global_step, seconds_before = checkpoint_step(path), saved_train_seconds(path)
            logger.info(f"resumed from {path} at step {global_step}")
    warn_about_later_checkpoints(output_dir, global_step)
    if accelerator.is_main_process:
        validation.keep_scores_until(output_dir / args.logging_dir / validation.SCORES_FILE, global_step)
    return global_step, seconds_before


def apply_learning_rate(optimizer: torch.optim.Optimizer, lr_scheduler, learning_rate: float) -> None:
    """After a checkpoint is loaded: train at `--learning_rate`, not the learning rate the checkpoint's schedule was
    built with (the schedule's shape and warm-up come from the command line already)."""
    schedule = getattr(lr_scheduler, "scheduler", lr_scheduler)  # accelerate's wrapper holds torch's LambdaLR
    saved = schedule.base_lrs[0]
    if saved == learning_rate:
        return
    schedule.base_lrs = [learning_rate] * len(schedule.base_lrs)
    for group, lr_lambda in zip(optimizer.param_groups, schedule.lr_lambdas):  # diffusers' schedules are LambdaLR
        group["lr"], group["initial_lr"] = learning_rate * lr_lambda(schedule.last_epoch), learning_rate
    logger.warning(f"resuming at --learning_rate {learning_rate:g}; the checkpoint's run trained at {saved:g}")


def take_steps(run: Run, step_batches: Generator, global_step: int, seconds_before: float) -> float:
    """The loop: the optimizer steps after `global_step` up to `--max_train_steps`, with a checkpoint every
    `--checkpointing_steps` (and at the last step) and a validation every `--validation_steps`. Returns the training
    seconds, over every segment of a resumed run."""
    args, accelerator = run.args, run.accelerator
    loss_options = LossOptions(
        snr_gamma=args.snr_gamma,
        noise_offset=args.noise_offset,
        load_balance_weight=args.load_balance_weight,
        symmetry_breaking_weight=args.symmetry_breaking_weight,
        max_grad_norm=args.max_grad_norm,
    )
    # tqdm's bar in a terminal; in a log file, a plain line at every 5% of the steps and at least one a minute.
    progress = progress_bar(
        args.max_train_steps, "steps", initial=global_step, disable=not accelerator.is_local_main_process
    )
    prompts, fid_captions = validation.validation_inputs(args)
    tracker_logs = TrackerLogs(accelerator, args.logging_steps)
    parameters = list(run.model.parameters())  # the EMA's, listed once: the same tensors at every step
    history = divergence_history()
    start_time = time.perf_counter()

    def seconds() -> float:
        return seconds_before + time.perf_counter() - start_time

    try:
        while global_step < args.max_train_steps:
            # One optimizer step's samples for this process; their noise is drawn before micro-batches split them.
            latents, text_states, generator = next(step_batches)  # read ahead by the data loader's workers
            latents, text_states = latents.to(accelerator.device), text_states.to(accelerator.device)
            try:
                result = training_step(
                    accelerator, run.model, run.optimizer, run.lr_scheduler, run.noise_scheduler, latents, text_states,
                    generator, micro_batch_size=args.train_batch_size, options=loss_options, step=global_step + 1,
                    ema=run.ema, parameters=parameters, history=history,
                )  # fmt: skip
            except DivergenceError as error:
                raise SystemExit(diverged_message(error, args, run.output_dir, run.store)) from None
            global_step += 1
            loss, lr = result.loss.item(), run.lr_scheduler.get_last_lr()[0]
            progress.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", refresh=False)
            progress.update(1)  # after the postfix: the line written at this step shows this step's loss
            tracker_logs.add(global_step, loss, float(result.grad_norm), lr)

            if global_step % args.checkpointing_steps == 0 or global_step == args.max_train_steps:
                checkpoint(run, global_step, seconds)
            if (prompts or fid_captions) and accelerator.is_main_process and global_step % args.validation_steps == 0:
                validation.validate(
                    accelerator, run.model, run.ema, *run.frozen, prompts, fid_captions, args, run.output_dir,
                    global_step, seconds(),
                )  # fmt: skip
    finally:  # also when a step fails: the workers exit and the bar is closed now, not at interpreter exit
        step_batches.close()
        progress.close()
        tracker_logs.send()  # the steps since the last log, also when the loop stops early
    return seconds()


def checkpoint(run: Run, step: int, seconds: Callable[[], float]) -> None:
    """Write the checkpoint of `step` (on the main process) once every process has found its weights finite."""
    args, accelerator = run.args, run.accelerator
    require_finite_weights(plain_backbone(accelerator, run.model), run.ema, step, run.output_dir, args.learning_rate)
    if accelerator.is_main_process:
        last = step == args.max_train_steps
        saved = save_checkpoint(accelerator, run.output_dir, step, args.checkpoints_total_limit, seconds(), last)
        logger.info(f"saved {saved}")
    accelerator.wait_for_everyone()


class TrackerLogs:
    """The step values a run gathers for its trackers, sent every `every` (`--logging_steps`) steps."""

    def __init__(self, accelerator, every: int):
        self.accelerator, self.every = accelerator, every
        self.losses: list[float] = []
        self.grad_norms: list[float] = []
        self.step = self.lr = None

    def add(self, step: int, loss: float, grad_norm: float, lr: float) -> None:
        """Gather the values of `step` (1-based); at the end of a window, send them."""
        self.losses.append(loss)
        self.grad_norms.append(grad_norm)
        self.step, self.lr = step, lr
        if step % self.every == 0:
            self.send()

    def send(self) -> None:
        """Send what has been gathered since the last log, at the last step gathered (nothing when nothing is)."""
        if not self.losses:
            return
        logs = {
            "loss": sum(self.losses) / len(self.losses),
            "lr": self.lr,
            "grad_norm": sum(self.grad_norms) / len(self.grad_norms),
        }
        self.losses.clear()
        self.grad_norms.clear()
        self.accelerator.log(logs, step=self.step)
