"""The trainer: `train` sets up accelerate, then `run_training` reads as the run."""

import collections
import logging
import sys
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import ProjectConfiguration, set_seed
from diffusers import DDPMScheduler
from diffusers.optimization import get_scheduler
from diffusers.training_utils import EMAModel
from transformers.utils import logging as transformers_logging

from diffusers_lmlp import LMLPPipeline, default_scheduler
from diffusers_lmlp.allocator import keep_freed_memory
from diffusers_lmlp.progress import is_terminal, progress_bar
from diffusers_lmlp.threads import set_threads
from diffusers_lmlp.training import checkpoints, components, data, finishing, step, validation
from diffusers_lmlp.training.arguments import TrainingConfig, checkpoint_step
from diffusers_lmlp.training.data import load_training_data
from diffusers_lmlp.training.step import effective_precision, plain_backbone, training_step  # the benchmark patches


logger = get_logger(__name__)


def train(args: TrainingConfig, exit_when_done: bool = False) -> None:
    """Set up accelerate, then train into `--output_dir`; `exit_when_done` ends the process once all have saved."""
    output_dir = Path(args.output_dir)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s", level=logging.INFO)
    mixed_precision, why = step.choose_precision(args.mixed_precision)
    dynamo_backend, why_compiled = step.choose_compilation(args.torch_compile, args.max_train_steps)
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps, mixed_precision=mixed_precision,
        dynamo_backend=dynamo_backend, log_with=None if args.report_to == "none" else args.report_to,
        project_config=ProjectConfiguration(project_dir=str(output_dir), logging_dir=str(output_dir / args.logging_dir))
    )  # fmt: skip
    if not is_terminal(sys.stderr):  # in a log file the libraries' own bars would redraw with carriage returns
        transformers_logging.disable_progress_bar()
    precision = effective_precision(
        accelerator, args.mixed_precision, args.mixed_precision_from_preset and args.preset
    )
    logger.info(
        f"{accelerator.num_processes} process(es), {accelerator.distributed_type}, {accelerator.device}, "
        f"mixed precision {precision}{why}, "
        f"torch.compile {accelerator.state.dynamo_plugin.backend.value.lower()}{why_compiled}"
    )
    if args.allow_tf32:  # as diffusers' --allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        logger.info("TF32 allowed for float32 matmuls and convolutions (Ampere and newer GPUs)")
    set_threads(args.num_threads, "training", accelerator.num_processes == 1 and accelerator.device.type == "cpu")
    keep_freed_memory(accelerator.device)
    with checkpoints.exclusive_output_dir(accelerator, output_dir, overwrite=args.overwrite_output_dir):
        run_training(args, accelerator, exit_when_done)


def run_training(args: TrainingConfig, accelerator: Accelerator, exit_when_done: bool) -> None:
    """Train, checkpoint, validate, then save the pipeline (and push it with --push_to_hub)."""
    output_dir = Path(args.output_dir)
    set_seed(args.seed)  # the initial weights; data, noise and timesteps come from per-step generators

    pretrained, revision = args.pretrained_model_name_or_path, args.revision
    model = components.build_model(
        args.model_type, args.model_config, args.model_overrides, pretrained=pretrained, revision=revision,
        values=args.model_config_values or args.model_skeleton, variant=args.variant,
        load_balance_weight=args.load_balance_weight, symmetry_breaking_weight=args.symmetry_breaking_weight,
    )  # fmt: skip
    frozen = tokenizer, text_encoder, vae = components.load_components(
        pretrained=pretrained, revision=revision, world=args.world, text_encoder=args.text_encoder_source,
        vae=args.vae_source, latent_scale=args.latent_scale,
    )  # fmt: skip
    components.check_compatible(model, *frozen, args.resolution, bool(pretrained))
    text_encoder.to(accelerator.device)
    vae.to(accelerator.device)
    if args.lora_rank:
        lora = components.lora_config(
            model, args.lora_rank, args.lora_alpha, args.lora_dropout, args.lora_target_modules
        )
        adapted = components.add_lora(model, lora)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        frozen_count = sum(p.numel() for p in model.parameters() if not p.requires_grad)
        logger.info(
            f"LoRA rank {lora.r}, alpha {lora.lora_alpha:g}: {len(adapted)} layers adapted, {trainable:,} "
            f"trainable parameters ({trainable / frozen_count:.2%} of the backbone's {frozen_count:,})"
        )

    cache_dir = Path(args.cache_dir) if args.cache_dir else output_dir.parent / ".lmlp-cache"
    with accelerator.main_process_first():  # the main process reads or downloads the data first
        try:
            dataset = load_training_data(
                dataset_name=args.dataset_name, dataset_config_name=args.dataset_config_name,
                train_data_dir=args.train_data_dir, data_layout=args.data_layout, image_column=args.image_column,
                caption_column=args.caption_column, max_train_samples=args.max_train_samples,
                streaming=args.streaming, seed=args.seed, cache_dir=str(cache_dir / "datasets"), world=args.world,
                shapes_split=args.shapes_split, shapes_num_images=args.shapes_num_images,
            )  # fmt: skip
        except ValueError as error:
            raise SystemExit(f"error: {error}") from None
    store = None
    if args.cache_features:
        start = time.perf_counter()
        store = data.build_feature_store(
            dataset, *frozen, accelerator, cache_dir, image_column=args.image_column, resolution=args.resolution,
            caption_column=args.caption_column, text_dtype=args.cache_text_dtype,
            num_workers=args.dataloader_num_workers,
        )  # fmt: skip
        logger.info(
            f"feature cache {store.path.name}: {len(store)} images ready in {time.perf_counter() - start:.1f} s "
            f"({store.nbytes() / len(store):,.0f} bytes per image, text states in {args.cache_text_dtype or 'float32'})"
        )

    model, ema, optimizer, lr_scheduler = prepare_optimization(args, accelerator, model)
    noise_scheduler = DDPMScheduler.from_config(default_scheduler().config)
    # What validations sample and the end saves: the backbone without wrappers, with the default scheduler.
    pipe = LMLPPipeline(vae, text_encoder, tokenizer, plain_backbone(accelerator, model), default_scheduler())

    global_step, seconds_before = 0, 0.0
    if args.resume_from_checkpoint:
        path = checkpoints.checkpoint_to_resume(output_dir, args.resume_from_checkpoint)
        if path is None:
            logger.info("--resume_from_checkpoint latest: no checkpoint yet, starting from scratch")
        else:
            accelerator.load_state(str(path))
            step.follow_device(optimizer, accelerator.device)
            apply_learning_rate(optimizer, lr_scheduler, args.learning_rate)
            global_step, seconds_before = checkpoint_step(path), checkpoints.saved_train_seconds(path)
            logger.info(f"resumed from {path} at step {global_step}")
    checkpoints.warn_about_later_checkpoints(output_dir, global_step)
    if accelerator.is_main_process:
        validation.keep_scores_until(output_dir / args.logging_dir / validation.SCORES_FILE, global_step)
        config = {k: v for k, v in finishing.public_args(args).items() if isinstance(v, int | float | str | bool)}
        accelerator.init_trackers(args.tracker_project_name, config=config)

    reader = data.BatchReader(
        dataset, store, seed=args.seed, per_step=args.train_batch_size * args.gradient_accumulation_steps,
        caption_dropout=args.caption_dropout, image_column=args.image_column, caption_column=args.caption_column,
        resolution=args.resolution, random_flip=args.random_flip, streaming=args.streaming,
        process_index=accelerator.process_index, num_processes=accelerator.num_processes, step=global_step,
    )  # fmt: skip
    source = data.BatchSource(reader, *frozen, num_workers=args.dataloader_num_workers)
    step_batches = source.steps(global_step, args.max_train_steps)
    loss_options = step.LossOptions(
        args.snr_gamma, args.noise_offset, args.load_balance_weight, args.symmetry_breaking_weight, args.max_grad_norm
    )
    # tqdm's bar in a terminal; in a log file, a plain line at every 5% of the steps and at least one a minute.
    progress = progress_bar(
        args.max_train_steps, "steps", initial=global_step, disable=not accelerator.is_local_main_process
    )
    prompts, fid_captions = validation.validation_inputs(
        args.validation_prompts, world=args.world, fid_images=args.validation_fid_images,
        fid_captions=args.validation_fid_captions, seed=args.seed,
    )  # fmt: skip
    sampling = dict(num_inference_steps=args.validation_inference_steps, seed=args.seed)
    sampling["guidance_scale"] = args.validation_guidance_scale
    history = collections.deque(maxlen=step.EXPLOSION_WINDOW)  # the recent steps' (loss, gradient norm)
    losses, grad_norms, lr = [], [], None  # the steps since the last tracker log
    start_time = time.perf_counter()

    def seconds() -> float:  # the training time, over every segment of a resumed run
        return seconds_before + time.perf_counter() - start_time

    def send_logs() -> None:
        if losses:
            mean_loss, mean_norm = sum(losses) / len(losses), sum(grad_norms) / len(grad_norms)
            accelerator.log({"loss": mean_loss, "lr": lr, "grad_norm": mean_norm}, step=global_step)
            losses.clear()
            grad_norms.clear()

    try:
        while global_step < args.max_train_steps:
            latents, text_states, generator = next(step_batches)  # read ahead by the data loader's workers
            latents, text_states = latents.to(accelerator.device), text_states.to(accelerator.device)
            try:
                result = training_step(
                    accelerator, model, optimizer, lr_scheduler, noise_scheduler, latents, text_states, generator,
                    micro_batch_size=args.train_batch_size, options=loss_options, step=global_step + 1, ema=ema,
                    history=history,
                )  # fmt: skip
            except step.DivergenceError as error:
                message = checkpoints.diverged_message(
                    error, output_dir, learning_rate=args.learning_rate, max_grad_norm=args.max_grad_norm,
                    mixed_precision=args.mixed_precision, store_path=None if store is None else store.path,
                )  # fmt: skip
                raise SystemExit(message) from None
            global_step += 1
            loss, lr = result.loss.item(), lr_scheduler.get_last_lr()[0]
            progress.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", refresh=False)
            progress.update(1)  # after the postfix: the line written at this step shows this step's loss
            losses.append(loss)
            grad_norms.append(float(result.grad_norm))
            if global_step % args.logging_steps == 0:
                send_logs()
            last = global_step == args.max_train_steps
            if global_step % args.checkpointing_steps == 0 or last:
                # Every process checks its own, equal weights first, so all of them stop together.
                checkpoints.require_finite_weights(pipe.transformer, ema, global_step, output_dir, args.learning_rate)
                if accelerator.is_main_process:
                    limit = args.checkpoints_total_limit
                    saved = checkpoints.save_checkpoint(accelerator, output_dir, global_step, limit, seconds(), last)
                    logger.info(f"saved {saved}")
                accelerator.wait_for_everyone()
            if (prompts or fid_captions) and accelerator.is_main_process and global_step % args.validation_steps == 0:
                validation.validate(
                    accelerator, pipe, ema, prompts, fid_captions, step=global_step, seconds=seconds(),
                    output_dir=output_dir, logging_dir=args.logging_dir, world=args.world,
                    fid_reference=args.validation_fid_reference, **sampling,
                )  # fmt: skip
    finally:  # also when a step fails: the workers exit and the bar is closed now, not at interpreter exit
        step_batches.close()
        progress.close()
        send_logs()  # the steps since the last log, also when the loop stops early
    finishing.end_run(
        accelerator, pipe, ema, seconds(), exit_when_done, output_dir=output_dir, logging_dir=args.logging_dir,
        card_args=finishing.public_args(args), steps=args.max_train_steps, prompts=prompts, world=args.world,
        lora_base=pretrained if args.lora_rank else None, final_inference_steps=args.final_evaluation_inference_steps,
        push_to=(args.hub_model_id or output_dir.name) if args.push_to_hub else None, hub_token=args.hub_token,
        **sampling,
    )  # fmt: skip


def prepare_optimization(args: TrainingConfig, accelerator: Accelerator, model: torch.nn.Module) -> tuple:
    """The backbone in training mode, its `EMAModel` (or None), AdamW and the LR schedule, prepared by accelerate."""
    model_class = type(model)
    if args.gradient_checkpointing:
        model.enable_gradient_checkpointing()
    model.train()
    ema_options = dict(decay=args.ema_decay, model_cls=model_class, model_config=model.config, foreach=True)
    ema = EMAModel(model.parameters(), **ema_options) if args.use_ema else None  # foreach: one multi-tensor update
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=args.learning_rate,  # with LoRA, the adapter's
        betas=(args.adam_beta1, args.adam_beta2), weight_decay=args.adam_weight_decay, eps=args.adam_epsilon,
        fused=step.fused_adamw(accelerator.device),
    )  # fmt: skip
    lr_scheduler = get_scheduler(
        args.lr_scheduler, optimizer=optimizer, num_warmup_steps=args.lr_warmup_steps * accelerator.num_processes,
        num_training_steps=args.max_train_steps * accelerator.num_processes
    )  # fmt: skip
    model, optimizer, lr_scheduler = accelerator.prepare(model, optimizer, lr_scheduler)
    checkpoints.register_checkpoint_hooks(accelerator, model_class, ema, lora=bool(args.lora_rank))
    return model, ema, optimizer, lr_scheduler


def apply_learning_rate(optimizer: torch.optim.Optimizer, lr_scheduler, learning_rate: float) -> None:
    """After a checkpoint is loaded: train at `--learning_rate`, not the one the checkpoint's schedule was built with."""
    schedule = getattr(lr_scheduler, "scheduler", lr_scheduler)  # accelerate's wrapper holds torch's LambdaLR
    saved = schedule.base_lrs[0]
    if saved == learning_rate:
        return
    schedule.base_lrs = [learning_rate] * len(schedule.base_lrs)
    for group, lr_lambda in zip(optimizer.param_groups, schedule.lr_lambdas):  # diffusers' schedules are LambdaLR
        group["lr"], group["initial_lr"] = learning_rate * lr_lambda(schedule.last_epoch), learning_rate
    logger.warning(f"resuming at --learning_rate {learning_rate:g}; the checkpoint's run trained at {saved:g}")
