"""The trainer's run: the components and their checks, batches, the training loop, validation, and the finished
pipeline. Its arguments are `training.arguments` (whose `DESCRIPTION` says what the trainer does); the command is
`diffusers_lmlp.train`.

Every random choice (data order, caption pick, caption dropout, noise, timesteps) is a function of (seed, step,
sample position), so a resumed run continues exactly as the uninterrupted one, and N accumulation steps of b
samples see the same samples and noise as one step of N·b.
"""

import argparse
import atexit
import contextlib
import faulthandler
import functools
import hashlib
import inspect
import itertools
import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import ProjectConfiguration, set_seed
from diffusers import AutoencoderKL, DDPMScheduler
from diffusers.optimization import get_scheduler
from diffusers.training_utils import EMAModel
from PIL import Image
from transformers import CLIPTextModel, CLIPTokenizer
from transformers.utils import logging as transformers_logging

from diffusers_lmlp import FAMILIES, LMLPPipeline, default_scheduler, symmetry_breaking_penalty
from diffusers_lmlp.evaluation import draw_captions, evaluate
from diffusers_lmlp.hub import write_model_card
from diffusers_lmlp.hub.lora_card import write_lora_card
from diffusers_lmlp.image_grid import make_image_grid
from diffusers_lmlp.models import family_of
from diffusers_lmlp.threads import apply_threads, choose_threads
from diffusers_lmlp.training import (
    FeatureStore,
    captions_of,
    checkpoint_step,
    encode_text,
    exclusive_output_dir,
    feature_store_key,
    format_run_summary,
    is_terminal,
    list_checkpoints,
    load_training_data,
    open_feature_store,
    preprocess_image,
    progress_bar,
    register_checkpoint_hooks,
    save_checkpoint,
    saved_train_seconds,
    warn_about_later_checkpoints,
)
from diffusers_lmlp.training.compilation import choose_compilation, plain_backbone
from diffusers_lmlp.training.lora import add_lora, lora_config, save_adapter
from diffusers_lmlp.training.precision import choose_precision, effective_precision
from diffusers_lmlp.training.sources import load_text_encoder, load_vae
from diffusers_lmlp.training.step import LossOptions, NonFiniteLossError, non_finite_parameters, training_step


logger = get_logger(__name__)

# A finished multi-process run's teardown that takes longer has hung: its Python stacks are dumped and it exits (1).
TEARDOWN_TIMEOUT_SECONDS = 120
# Arguments that never leave this process: kept out of trackers, logs, the model card and training_summary.json.
SECRET_ARGUMENTS = frozenset({"hub_token"})

# Images per caption (each from its own noise seed) in the final shapes evaluation: the intervals resample captions,
# so more seeds of the 32 held-out combinations narrow them.
FINAL_EVALUATION_SEEDS = {"train": 3, "held-out": 4}
# The shapes world's splits the scorer reads, and the captions of each (`draw_captions` sources).
SCORED_SPLITS = {"train": "shapes:train", "held-out": "shapes:heldout"}
# Where each validation of a shapes-world run appends its scores, inside the logging folder: the learning curves.
SCORES_FILE = "scores.jsonl"


# --------------------------------------------------------------------------------------------- model and components


def routes(model_class: type) -> bool:
    """Whether the backbone can report router probabilities for the load-balancing loss."""
    return "output_router_probs" in inspect.signature(model_class.forward).parameters


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    if args.pretrained_model_name_or_path:
        config = LMLPPipeline.load_config(args.pretrained_model_name_or_path, revision=args.revision)
        saved = family_of(config["transformer"][1]).name
        if args.model_type not in (None, saved):
            raise SystemExit(
                f"error: --model_type {args.model_type} conflicts with the base pipeline, whose backbone is "
                f"{config['transformer'][1]} (--model_type {saved}); fine-tuning keeps the saved backbone."
            )
        args.model_type = saved
        if args.load_balance_weight and not routes(FAMILIES[saved].model_class):
            raise SystemExit("error: --load_balance_weight applies to MoE-MLP backbones only")
        model = FAMILIES[saved].model_class.from_pretrained(
            args.pretrained_model_name_or_path, subfolder="transformer", revision=args.revision, variant=args.variant
        )
    else:
        model = build_new_model(args)
    if args.symmetry_breaking_weight:
        try:
            symmetry_breaking_penalty(model)  # refuses a backbone without symmetry-breaking weights
        except ValueError as error:
            raise SystemExit(f"error: --symmetry_breaking_weight: {error}") from None
    return model


def build_new_model(args: argparse.Namespace) -> torch.nn.Module:
    """A randomly initialised backbone of --model_type from --model_config and --model_overrides."""
    model_class = FAMILIES[args.model_type].model_class
    if args.load_balance_weight and not routes(model_class):
        raise SystemExit("error: --load_balance_weight applies to a backbone with routers (--model_type moe_mlp)")
    if args.model_config is None:
        build = functools.partial(model_class, **{**args.model_skeleton, **args.model_overrides})
    elif args.model_config_values is not None:  # a JSON file, read and checked at start-up
        build = functools.partial(model_class, **{**args.model_config_values, **args.model_overrides})
    else:
        build = functools.partial(model_class.from_named_config, args.model_config, **args.model_overrides)
    try:
        return build()
    except ValueError as error:  # a value the model refuses (hidden_size=0)
        source = f"--model_config {args.model_config}" if args.model_config else f"--model_type {args.model_type}"
        raise SystemExit(f"error: {source} with --model_overrides: {error}") from None


def load_components(args: argparse.Namespace) -> tuple[CLIPTokenizer, CLIPTextModel, AutoencoderKL]:
    """The frozen tokenizer, text encoder and VAE.

    A base pipeline's own, else the shapes world's (the embedded default), else the papers' SD VAE and CLIP L/14;
    `--pretrained_vae` / `--pretrained_text_encoder` replace either. Where each loads from was resolved at start-up
    (`args.text_encoder_source`, `args.vae_source`; see `diffusers_lmlp.training.sources`).
    """
    if args.pretrained_model_name_or_path:
        pipe = LMLPPipeline.from_pretrained(args.pretrained_model_name_or_path, revision=args.revision)
        tokenizer, text_encoder, vae = pipe.tokenizer, pipe.text_encoder, pipe.vae
    elif args.shapes_world:
        from diffusers_lmlp.shapes.text import shapes_components

        tokenizer, text_encoder, vae = shapes_components()
    text = args.text_encoder_source
    if text is not None:
        with loading_from("the text encoder", text.source, "--pretrained_text_encoder"):
            tokenizer, text_encoder = load_text_encoder(text)
    if args.vae_source is not None:
        with loading_from("the VAE", args.vae_source.source, "--pretrained_vae"):
            vae = load_vae(args.vae_source)
    if args.latent_scale is not None:
        vae.register_to_config(scaling_factor=args.latent_scale)
    return tokenizer, text_encoder.requires_grad_(False).eval(), vae.requires_grad_(False).eval()


@contextlib.contextmanager
def loading_from(what: str, source: str, option: str):
    """Turn a loader's `OSError` (a Hub id that cannot be fetched, a folder with broken files) or `ValueError` (a
    checkpoint that is not the component's) into one message that says what to do.

    Args:
        what (`str`): The component, for the message.
        source (`str`): The Hub id or folder it is loaded from.
        option (`str`): The option that sets it.
    """
    try:
        yield
    except ValueError as error:  # what the component's checkpoint holds is wrong (sources.load_text_encoder)
        raise SystemExit(f"error: {error}") from None
    except OSError as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        if Path(source).is_dir():
            raise SystemExit(f"error: could not load {what} from the folder {source}: {first}") from None
        from huggingface_hub import constants

        offline = " (HF_HUB_OFFLINE=1: only the Hugging Face cache is read)" if constants.HF_HUB_OFFLINE else ""
        raise SystemExit(
            f"error: could not load {what} from the Hub repo {source}{offline}: {first} Fetch its files once with "
            f"the README's `hf download {source} ...` line (Train on COCO), or pass a local folder with {option}."
        ) from None


def check_compatible(model, tokenizer, text_encoder, vae, resolution: int, fine_tuning: bool = False) -> None:
    """Refuse components and a resolution that do not fit the backbone, before any data is touched.

    The model mixes a fixed number of tokens, so the VAE must turn `resolution` px images into latents of exactly
    the model's `sample_size`. That size is measured from the VAE's layers, not only computed from its config: the
    pipeline sizes images by the config's factor, so a VAE whose layers downsample otherwise is refused too.

    Args:
        model: The backbone.
        tokenizer: The CLIP tokenizer.
        text_encoder: The CLIP text model.
        vae (`AutoencoderKL`): The VAE.
        resolution (`int`): `--resolution`, in pixels.
        fine_tuning (`bool`, *optional*, defaults to `False`): Whether the model is a saved one, whose `sample_size`
            is kept (so the message does not offer `--model_overrides`).

    Raises:
        `SystemExit`: With a message that says what to pass instead.
    """
    config = model.config
    factor = 2 ** (len(vae.config.block_out_channels) - 1)  # the factor LMLPPipeline sizes images by
    native = config.sample_size * factor
    if resolution != native:
        fix = f"pass --resolution {native}"
        if fine_tuning:
            fix += " (a fine-tuned model keeps its sample_size)"
        elif resolution % (factor * config.patch_size) == 0:
            fix += f", or --model_overrides sample_size={resolution // factor}"
        raise SystemExit(
            f"error: --resolution {resolution} does not match the model: sample_size {config.sample_size} × VAE "
            f"factor {factor} = {native} px. Token mixing is over a fixed number of tokens: {fix}."
        )
    height, width = vae_latent_size(vae, resolution)
    if (height, width) != (config.sample_size, config.sample_size):
        raise SystemExit(
            f"error: the VAE encodes {resolution}×{resolution} px images to {height}×{width} latents, but the "
            f"model's sample_size is {config.sample_size}: its config (block_out_channels of "
            f"{len(vae.config.block_out_channels)} entries) gives a factor of {factor}, its layers downsample by "
            f"{resolution // height}. Use a VAE whose config matches its layers (one down block per entry of "
            "block_out_channels)."
        )
    # LMLPPipeline's constructor checks text width, tokenizer length and latent channels with clear messages.
    try:
        LMLPPipeline(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=model, scheduler=None)
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None


def vae_latent_size(vae: AutoencoderKL, resolution: int) -> tuple[int, int]:
    """The (height, width) of the VAE encoder's output for a `resolution`² image, run on the meta device: shapes
    only, no memory for a copy of the weights and no arithmetic, even for SD's VAE at 512 px.

    Args:
        vae (`AutoencoderKL`): The VAE.
        resolution (`int`): The image side, in pixels.

    Raises:
        `SystemExit`: When the encoder cannot take images of that size.
    """
    encoder = vae.encoder
    tensors = {**dict(encoder.named_parameters()), **dict(encoder.named_buffers())}
    meta = {name: torch.empty_like(tensor, device="meta") for name, tensor in tensors.items()}
    image = torch.empty(1, vae.config.in_channels, resolution, resolution, dtype=vae.dtype, device="meta")
    try:
        with torch.no_grad():
            moments = torch.func.functional_call(encoder, meta, (image,))  # (1, 2C, h, w)
    except RuntimeError as error:
        raise SystemExit(f"error: the VAE cannot encode {resolution}×{resolution} px images: {error}") from None
    return tuple(moments.shape[-2:])


# ----------------------------------------------------------------------------------------------------------- data


def step_generator(seed: int, *keys: int) -> torch.Generator:
    """A generator that depends only on the seed and the keys (step, sample position, …): exact resume."""
    digest = hashlib.sha256(repr((seed, *keys)).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


def build_feature_store(args, dataset, tokenizer, text_encoder, vae, accelerator, cache_dir: Path) -> FeatureStore:
    """The feature store of this data and these components, extracted first by every process (each its shards).

    Args:
        args (`argparse.Namespace`): The parsed arguments (columns, resolution, `--cache_text_dtype`, workers).
        dataset (`datasets.Dataset`): The training data.
        tokenizer (`CLIPTokenizer`): The tokenizer.
        text_encoder (`CLIPTextModel`): The text encoder.
        vae (`AutoencoderKL`): The VAE.
        accelerator (`Accelerator`): The run's accelerator (rank, number of processes, barrier).
        cache_dir (`Path`): The store is `<cache_dir>/features/<key>`.
    """
    columns = dict(image_column=args.image_column, caption_column=args.caption_column, resolution=args.resolution)
    components = dict(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae)
    text_dtype = args.cache_text_dtype or "float32"
    key = feature_store_key(dataset, **columns, **components, text_dtype=text_dtype)
    try:
        return open_feature_store(
            cache_dir / "features" / key,
            dataset,
            process_index=accelerator.process_index,
            num_processes=accelerator.num_processes,
            wait_for_everyone=accelerator.wait_for_everyone,
            **columns,
            **components,
            text_dtype=text_dtype,
            num_workers=args.dataloader_num_workers,
        )
    except (OSError, ValueError) as error:  # a caption that is not one, a store other processes cannot see
        raise SystemExit(f"error: {error}") from None


class BatchReader:
    """The CPU half of making a batch, which runs in `DataLoader` worker processes: the caption pick, caption dropout
    and flip draws, then the samples, read from the feature store (latents re-sampled from the stored moments at
    every use, as the reference does) or decoded and cropped.

    A map-style dataset is read as an endless stream of per-epoch permutations (sample k of step s is a pure
    function of the seed and s), so resuming needs no data state. A streaming dataset is read in order from this
    process's shard, shuffled per epoch with a seeded buffer, skipping what the steps before `step` used; the stream
    is opened by the process that reads it.

    Args:
        args (`argparse.Namespace`): The parsed arguments (seed, columns, resolution, flips, batch sizes, streaming).
        dataset (`datasets.Dataset` or `datasets.IterableDataset`): The training data.
        store (`FeatureStore`, *optional*): The feature store of `dataset`, read instead of its images.
        process_index (`int`): This process's rank.
        num_processes (`int`): The number of training processes.
        step (`int`): The first step read.
    """

    def __init__(self, args, dataset, store: FeatureStore | None, process_index: int, num_processes: int, step: int):
        self.args, self.dataset, self.store = args, dataset, store
        self.process_index, self.num_processes, self.step = process_index, num_processes, step
        self._permutation = (-1, None)
        self._stream = None

    def sample_index(self, position: int) -> int:
        """Index of the sample at `position` of the endless stream of per-epoch permutations."""
        epoch, offset = divmod(position, len(self.dataset))
        if self._permutation[0] != epoch:
            generator = step_generator(self.args.seed, "epoch", epoch)
            self._permutation = (epoch, torch.randperm(len(self.dataset), generator=generator))
        return int(self._permutation[1][offset])

    def _next_records(self, count: int) -> list[dict]:
        if self._stream is None:
            self._stream = self._epochs()
            per_step = self.args.train_batch_size * self.args.gradient_accumulation_steps
            self._next_records(self.step * per_step)  # what the steps before a resume consumed
        return [next(self._stream) for _ in range(count)]

    def _epochs(self) -> Iterator[dict]:
        """This process's shard of the stream, shuffled, epoch after epoch, one record at a time.

        Read with `iter(batch_size=1)`: iterating the dataset itself in a `DataLoader` worker would let `datasets`
        split it between the workers, in another order than in the main process.
        """
        from datasets.distributed import split_dataset_by_node

        shard = split_dataset_by_node(self.dataset, self.process_index, self.num_processes)
        shard = shard.shuffle(seed=self.args.seed, buffer_size=1000)
        for epoch in itertools.count():
            shard.set_epoch(epoch)
            empty = True
            for batch in shard.iter(batch_size=1):
                empty = False
                yield {column: values[0] for column, values in batch.items()}
            if empty:
                raise ValueError(f"the stream of process {self.process_index} is empty: it has no records to train on")

    @torch.no_grad()
    def load(self, positions: list[int], generator: torch.Generator) -> dict:
        """The CPU half of the batch of the samples at `positions` of the sample stream.

        Args:
            positions (`list[int]`): The positions.
            generator (`torch.Generator`): The step's generator; `BatchSource.finish` continues where this leaves it.

        Returns:
            `dict`: `drop` (b,) (caption dropout), and `latents` (b, C, h, w) unscaled and `states` (b, T, D) from the
            store, or `pixels` (b, 3, H, W) and `texts` (b captions) to encode.
        """
        args = self.args
        choice = torch.rand(len(positions), generator=generator)  # caption pick
        drop = torch.rand(len(positions), generator=generator) < args.caption_dropout
        flip = torch.rand(len(positions), generator=generator) < 0.5
        if self.store is not None:
            moments, states = self.store.read([self.sample_index(p) for p in positions], choice)
            mean, logvar = moments.chunk(2, dim=1)  # (b, C, h, w) each
            noise = torch.randn(mean.shape, generator=generator)
            latents = mean + torch.exp(0.5 * logvar.clamp(-30.0, 20.0)) * noise  # (b, C, h, w)
            return {"drop": drop, "latents": latents, "states": states}
        if args.streaming:
            records = self._next_records(len(positions))
        else:
            records = [self.dataset[self.sample_index(p)] for p in positions]
        captions = [captions_of(r[args.caption_column]) for r in records]
        pixels = torch.stack(
            [
                preprocess_image(r[args.image_column], args.resolution, bool(f and args.random_flip))
                for r, f in zip(records, flip)
            ]
        )  # (b, 3, H, W)
        texts = [caps[int(c * len(caps))] for caps, c in zip(captions, choice)]
        return {"drop": drop, "pixels": pixels, "texts": texts}


class StepBatches(torch.utils.data.IterableDataset):
    """This process's `BatchReader.load` of steps `first` … `last - 1`, each with its step generator's state after it.

    Worker w of W makes steps first + w, first + w + W, …, and a `DataLoader` returns its workers' items in turn,
    so the steps come back in order. A stream, read in order, is read by one worker.

    Args:
        reader (`BatchReader`): Makes each step's batch.
        first (`int`): The first step.
        last (`int`): The step after the last.
    """

    def __init__(self, reader: BatchReader, first: int, last: int):
        self.reader, self.first, self.last = reader, first, last

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        args, rank = self.reader.args, self.reader.process_index
        per_step = args.train_batch_size * args.gradient_accumulation_steps  # per process
        for step in range(self.first + worker, self.last, workers):
            first = (step * self.reader.num_processes + rank) * per_step
            generator = step_generator(args.seed, "step", step, rank)
            yield self.reader.load(list(range(first, first + per_step)), generator), generator.get_state()


class BatchSource:
    """Produces the clean latents and conditioning of the samples at given positions of the sample stream.

    A `BatchReader` makes the CPU half (in `--dataloader_num_workers` worker processes, ahead of the training step
    that needs it); this process runs the encoders when there is no feature store, applies caption dropout and scales
    the latents. Every random draw comes from the step's generator, in one order whichever process makes it, so the
    batches, their noise and timesteps are the same with any number of workers, and a resumed run continues exactly.

    Args:
        args (`argparse.Namespace`): The parsed arguments.
        dataset (`datasets.Dataset` or `datasets.IterableDataset`): The training data.
        store (`FeatureStore`, *optional*): Its feature store.
        tokenizer (`CLIPTokenizer`): The tokenizer.
        text_encoder (`CLIPTextModel`): The text encoder (for "" and, without a store, every caption).
        vae (`AutoencoderKL`): The VAE (its config's scale and shift; without a store, it encodes every image).
        step (`int`): The first step.
        process_index (`int`, *optional*, defaults to 0): This process's rank.
        num_processes (`int`, *optional*, defaults to 1): The number of training processes.
    """

    def __init__(self, args, dataset, store, tokenizer, text_encoder, vae, step, process_index=0, num_processes=1):
        self.args, self.tokenizer, self.text_encoder, self.vae = args, tokenizer, text_encoder, vae
        self.reader = BatchReader(args, dataset, store, process_index, num_processes, step)
        self.empty_states = encode_text(tokenizer, text_encoder, [""])  # (1, T, D)

    def batch(self, positions: list[int], generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents (b, C, h, w) scaled by the latent scale, and text states (b, T, D), caption dropout applied.

        Args:
            positions (`list[int]`): Positions in the sample stream.
            generator (`torch.Generator`): The step's generator.
        """
        return self.finish(self.reader.load(positions, generator), generator)

    @torch.no_grad()
    def finish(self, loaded: dict, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents (b, C, h, w) scaled by the latent scale, and text states (b, T, D), caption dropout applied.

        Args:
            loaded (`dict`): What `BatchReader.load` made.
            generator (`torch.Generator`): The step's generator, where `load` left it.
        """
        if "pixels" in loaded:
            states = encode_text(self.tokenizer, self.text_encoder, loaded["texts"])  # (b, T, D)
            dist = self.vae.encode(loaded["pixels"].to(self.vae.device, self.vae.dtype)).latent_dist
            latents = dist.mean + dist.std * torch.randn(dist.mean.shape, generator=generator).to(dist.mean)
        else:
            latents, states = loaded["latents"], loaded["states"]
        states = states.float()
        empty = self.empty_states.float().to(states.device)
        states = torch.where(loaded["drop"].to(states.device)[:, None, None], empty, states)  # (b, T, D)
        config = self.vae.config
        latents = latents.float()
        if config.shift_factor is not None:
            latents = latents - config.shift_factor
        return latents * config.scaling_factor, states

    def steps(self, first: int, last: int) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Generator]]:
        """The batches of steps `first` … `last - 1`, read by `--dataloader_num_workers` worker processes.

        Args:
            first (`int`): The first step.
            last (`int`): The step after the last.

        Yields:
            `tuple`: Latents (b, C, h, w), text states (b, T, D) and the step's generator, where the batch left it
            (the step's noise and timesteps come next).
        """
        workers = self.args.dataloader_num_workers
        if self.args.streaming and workers > 1:
            logger.info(f"--dataloader_num_workers {workers}: a stream is read in order, by one worker process")
            workers = 1
        loader = torch.utils.data.DataLoader(
            StepBatches(self.reader, first, last),
            batch_size=None,  # items are batches already
            num_workers=workers,
            pin_memory=self.vae.device.type == "cuda",
            generator=torch.Generator().manual_seed(0),  # DataLoader would otherwise draw from the global RNG
        )
        for loaded, state in loader:
            generator = torch.Generator()
            generator.set_state(state)
            yield *self.finish(loaded, generator), generator


# ------------------------------------------------------------------------------------------ validation and output


@torch.no_grad()
def generate(pipe: LMLPPipeline, prompts: list[str], args, seed: int) -> list[Image.Image]:
    generator = torch.Generator().manual_seed(seed)
    pipe.set_progress_bar_config(disable=True)
    return pipe(
        prompts,
        num_inference_steps=args.validation_inference_steps,
        guidance_scale=args.validation_guidance_scale,
        generator=generator,
    ).images


def build_pipeline(model, tokenizer, text_encoder, vae) -> LMLPPipeline:
    return LMLPPipeline(
        vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=model, scheduler=default_scheduler()
    )


def default_validation_prompts(args) -> list[str]:
    """The validation grid's prompts: `--validation_prompts` (or the file's), else on the shapes world 6 training
    captions and 2 held-out combinations, else none (no validation during training, no sample grid at the end).

    Args:
        args (`argparse.Namespace`): The parsed arguments.
    """
    if args.validation_prompts:
        return args.validation_prompts
    if args.shapes_world:
        from diffusers_lmlp.shapes.world import held_out_specs, train_specs

        return [s.caption for s in train_specs()[:: max(1, len(train_specs()) // 6)][:6]] + [
            s.caption for s in held_out_specs()[:2]
        ]
    return []


def final_evaluation(pipe: LMLPPipeline, args) -> dict[str, dict]:
    """Evaluate the finished pipeline on the shapes world at the pipeline's default sampler settings (what a user
    gets from `pipe(caption)`; `--final_evaluation_inference_steps` changes the steps, for smoke runs): the shapes
    scorer's accuracies with 95% intervals over captions, and shapes-FID against renders of the same captions with its
    real-vs-real floor, each caption sampled `FINAL_EVALUATION_SEEDS` times.

    Args:
        pipe (`LMLPPipeline`): The trained pipeline.
        args (`argparse.Namespace`): The parsed arguments (the seed, the sampler steps).

    Returns:
        `dict[str, dict]`: The evaluation report of each split ("train", "held-out").
    """
    return evaluate_splits(
        pipe, args, FINAL_EVALUATION_SEEDS, args.final_evaluation_inference_steps, fid_reference="shapes"
    )


def evaluate_splits(
    pipe: LMLPPipeline,
    args,
    seeds: dict[str, int],
    num_inference_steps: int,
    guidance_scale: float | None = None,
    fid_reference: str | None = None,
    progress: bool = True,
) -> dict[str, dict]:
    """Sample and score the shapes model on each of `SCORED_SPLITS`: as many captions as there are held-out
    combinations (all of them, for the held-out split), each `seeds[split]` times.

    Args:
        pipe (`LMLPPipeline`): The pipeline.
        args (`argparse.Namespace`): The parsed arguments (the seed).
        seeds (`dict[str, int]`): Images per caption, by split.
        num_inference_steps (`int`): Sampler steps.
        guidance_scale (`float`, *optional*): The guidance; the pipeline's default when not given.
        fid_reference (`str`, *optional*): `"shapes"` for shapes-FID against renders of the captions; none without.
        progress (`bool`, *optional*, defaults to `True`): Show the sampling's progress.

    Returns:
        `dict[str, dict]`: The evaluation report of each split ("train", "held-out").
    """
    from diffusers_lmlp.shapes.world import held_out_specs

    sampler = {} if guidance_scale is None else {"guidance_scale": guidance_scale}
    return {
        split: evaluate(
            pipe,
            draw_captions(source, len(held_out_specs()), args.seed) * seeds[split],
            fid_reference=fid_reference,
            num_inference_steps=num_inference_steps,
            batch_size=64,
            seed=args.seed,
            progress=progress,
            **sampler,
        )[0]
        for split, source in SCORED_SPLITS.items()
    }


def score_summary(reports: dict[str, dict], suffix: str = "") -> dict[str, dict]:
    """The summary's entries for one final evaluation: the scorer's accuracies, their intervals and shapes-FID, each
    by split, under keys ending with `suffix` (`"_before"` for the base model of a LoRA run).

    Args:
        reports (`dict[str, dict]`): `final_evaluation`'s reports, by split.
        suffix (`str`, *optional*, defaults to `""`): Appended to each key.
    """
    return {
        f"scores{suffix}": {split: report["shapes"] for split, report in reports.items()},
        f"score_intervals{suffix}": {split: report["shapes_intervals"] for split, report in reports.items()},
        f"shapes_fid{suffix}": {
            split: {key: report[key] for key in ("fid", "fid_floor", "num_images")}
            for split, report in reports.items()
        },
    }


def allow_tf32() -> None:
    """Let float32 matmuls and cuDNN convolutions run on TF32 tensor cores (NVIDIA Ampere and newer), as diffusers'
    `--allow_tf32` does: several times faster, with a 10-bit mantissa. The matmul switch is the one that
    `torch.set_float32_matmul_precision("high")` sets. CPUs have no TF32: there it changes nothing."""
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    logger.info("TF32 allowed for float32 matmuls and convolutions (Ampere and newer GPUs)")


def use_threads(accelerator: Accelerator, num_threads: int | None) -> None:
    """Set this process's CPU threads by the package's rule (`diffusers_lmlp.threads`): `--num_threads`, else the
    `OMP_NUM_THREADS` you set, else every core for a one-process CPU run.

    `accelerate launch` sets `OMP_NUM_THREADS=1` for each process it starts unless you set it (right for several
    processes per machine, and on a GPU), which would leave a one-process CPU run on one core; on 2 idle cores the
    embedded default trains 1.3× faster with both. Several processes, or a GPU, keep their setting unless
    `--num_threads` is given.

    Args:
        accelerator (`Accelerator`): The run's accelerator.
        num_threads (`int`, *optional*): `--num_threads`.
    """
    one_cpu_process = accelerator.num_processes == 1 and accelerator.device.type == "cpu"
    if num_threads is None and not one_cpu_process:
        return
    apply_threads(choose_threads(num_threads), "training")


def train(args: argparse.Namespace) -> None:
    """Set up accelerate, then train into `--output_dir` (which no other run may use meanwhile).

    Args:
        args (`argparse.Namespace`): The checked arguments (`training.arguments.parse_args`).
    """
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
    use_threads(accelerator, args.num_threads)
    with exclusive_output_dir(accelerator, output_dir):
        run_training(args, accelerator, output_dir)


def run_training(args: argparse.Namespace, accelerator: Accelerator, output_dir: Path) -> None:
    """Train, checkpoint, validate, then save the pipeline (and push it with --push_to_hub).

    Args:
        args (`argparse.Namespace`): The parsed arguments.
        accelerator (`Accelerator`): The run's accelerator.
        output_dir (`Path`): The `--output_dir`, held by this run.
    """
    set_seed(args.seed)  # the initial weights; data, noise and timesteps come from per-step generators
    model = build_model(args)
    tokenizer, text_encoder, vae = load_components(args)
    check_compatible(model, tokenizer, text_encoder, vae, args.resolution, bool(args.pretrained_model_name_or_path))
    text_encoder.to(accelerator.device)
    vae.to(accelerator.device)
    model_class = type(model)
    if args.lora_rank:
        config = lora_config(model, args.lora_rank, args.lora_alpha, args.lora_dropout, args.lora_target_modules)
        adapted = add_lora(model, config)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        base = sum(p.numel() for p in model.parameters() if not p.requires_grad)  # the frozen backbone
        logger.info(
            f"LoRA rank {config.r}, alpha {config.lora_alpha:g}: {len(adapted)} layers adapted, {trainable:,} trainable "
            f"parameters ({trainable / base:.2%} of the backbone's {base:,})"
        )

    cache_dir = Path(args.cache_dir) if args.cache_dir else output_dir.parent / ".lmlp-cache"
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
                shapes_split=args.shapes_split,
                shapes_num_images=args.shapes_num_images,
            )
        except ValueError as error:
            raise SystemExit(f"error: {error}") from None
    store = None
    if args.cache_features:
        start = time.perf_counter()
        store = build_feature_store(args, dataset, tokenizer, text_encoder, vae, accelerator, cache_dir)
        logger.info(
            f"feature cache {store.path.name}: {len(store)} images ready in {time.perf_counter() - start:.1f} s "
            f"({store.nbytes() / len(store):,.0f} bytes per image, text states in {args.cache_text_dtype or 'float32'})"
        )

    if args.gradient_checkpointing:
        model.enable_gradient_checkpointing()
    model.train()
    ema = None
    if args.use_ema:
        ema = EMAModel(model.parameters(), decay=args.ema_decay, model_cls=model_class, model_config=model.config)
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],  # with LoRA, the adapter's
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        weight_decay=args.adam_weight_decay,
        eps=args.adam_epsilon,
    )
    lr_scheduler = get_scheduler(
        args.lr_scheduler,
        optimizer=optimizer,
        num_warmup_steps=args.lr_warmup_steps * accelerator.num_processes,
        num_training_steps=args.max_train_steps * accelerator.num_processes,
    )
    model, optimizer, lr_scheduler = accelerator.prepare(model, optimizer, lr_scheduler)
    register_checkpoint_hooks(accelerator, model_class, ema, lora=bool(args.lora_rank))
    noise_scheduler = DDPMScheduler.from_config(default_scheduler().config)

    global_step, seconds_before = 0, 0.0
    if args.resume_from_checkpoint:
        checkpoints = list_checkpoints(output_dir)
        path = (
            Path(args.resume_from_checkpoint)
            if args.resume_from_checkpoint != "latest"
            else (checkpoints[-1] if checkpoints else None)
        )
        if path is None:
            logger.info("--resume_from_checkpoint latest: no checkpoint yet, starting from scratch")
        else:
            accelerator.load_state(str(path))
            global_step, seconds_before = checkpoint_step(path), saved_train_seconds(path)
            logger.info(f"resumed from {path} at step {global_step}")
    warn_about_later_checkpoints(output_dir, global_step)
    if accelerator.is_main_process:
        keep_scores_until(output_dir / args.logging_dir / SCORES_FILE, global_step)

    source = BatchSource(
        args, dataset, store, tokenizer, text_encoder, vae, global_step,
        process_index=accelerator.process_index, num_processes=accelerator.num_processes,
    )  # fmt: skip
    batches = source.steps(global_step, args.max_train_steps)
    if accelerator.is_main_process:
        config = {k: v for k, v in public_args(args).items() if isinstance(v, int | float | str | bool)}
        accelerator.init_trackers(args.tracker_project_name, config=config)

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
    prompts = default_validation_prompts(args)
    fid_captions = (
        draw_captions(args.validation_fid_captions or "shapes:train", args.validation_fid_images, args.seed)
        if args.validation_fid_images
        else []
    )
    if not (prompts or fid_captions):
        logger.info(
            "no validation during training and no sample grid at the end: your data has no validation prompts (pass "
            "--validation_prompts or --validation_prompts_file to see samples every --validation_steps)"
        )
    start_time = time.perf_counter()
    try:
        while global_step < args.max_train_steps:
            # The samples of one optimizer step, for this process; the step draws their noise before the micro-batches
            # split them.
            latents, text_states, generator = next(batches)  # read ahead by the data loader's workers
            latents, text_states = latents.to(accelerator.device), text_states.to(accelerator.device)
            try:
                result = training_step(
                    accelerator, model, optimizer, lr_scheduler, noise_scheduler, latents, text_states, generator,
                    micro_batch_size=args.train_batch_size, options=loss_options, step=global_step + 1, ema=ema,
                )  # fmt: skip
            except NonFiniteLossError as error:
                raise SystemExit(diverged_message(error, args, output_dir, store)) from None
            global_step += 1
            logs = {
                "loss": result.loss.item(),
                "lr": lr_scheduler.get_last_lr()[0],
                "grad_norm": float(result.grad_norm),
            }
            progress.set_postfix(loss=f"{logs['loss']:.4f}", lr=f"{logs['lr']:.2e}", refresh=False)
            progress.update(1)  # after the postfix: the line written at this step shows this step's loss
            accelerator.log(logs, step=global_step)

            if global_step % args.checkpointing_steps == 0 or global_step == args.max_train_steps:
                require_finite_weights(
                    plain_backbone(accelerator, model), ema, global_step, output_dir, args.learning_rate
                )
                if accelerator.is_main_process:
                    seconds = seconds_before + time.perf_counter() - start_time
                    saved = save_checkpoint(
                        accelerator, output_dir, global_step, args.checkpoints_total_limit, seconds
                    )
                    logger.info(f"saved {saved}")
                accelerator.wait_for_everyone()
            if (prompts or fid_captions) and accelerator.is_main_process and global_step % args.validation_steps == 0:
                validate(
                    accelerator,
                    model,
                    ema,
                    tokenizer,
                    text_encoder,
                    vae,
                    prompts,
                    fid_captions,
                    args,
                    output_dir,
                    global_step,
                    seconds_before + time.perf_counter() - start_time,
                )
    finally:  # also when a step fails: the workers exit and the bar is closed now, not at interpreter exit
        batches.close()
        progress.close()
    train_seconds = seconds_before + time.perf_counter() - start_time  # over every segment of a resumed run

    accelerator.wait_for_everyone()
    in_sync = ranks_in_sync(accelerator, model)
    if accelerator.is_main_process:
        finish(accelerator, model, ema, tokenizer, text_encoder, vae, args, output_dir, train_seconds, in_sync)
    # Every process leaves together: a rank that tears down its process group while the main process still saves
    # leaves the main process waiting for it at exit (seen with gloo).
    accelerator.wait_for_everyone()
    if accelerator.num_processes > 1:  # everything is saved: a teardown that hangs must not hold the job forever
        faulthandler.dump_traceback_later(TEARDOWN_TIMEOUT_SECONDS, exit=True)
    accelerator.end_training()


def diverged_message(error: NonFiniteLossError, args: argparse.Namespace, output_dir: Path, store) -> str:
    """What to say when the loss or the gradient norm of a step is NaN or inf: where the good work is, and what to
    try.

    Args:
        error (`NonFiniteLossError`): The failed step.
        args (`argparse.Namespace`): The parsed arguments.
        output_dir (`Path`): The `--output_dir`.
        store (`FeatureStore`, *optional*): The feature store the run reads, if any.
    """
    checkpoints = list_checkpoints(output_dir)
    kept = (
        f"the last checkpoint, {checkpoints[-1]}, is intact: resume from it with --resume_from_checkpoint latest"
        if checkpoints
        else "no checkpoint had been written yet"
    )
    tries = [f"a lower --learning_rate (now {args.learning_rate:g})"]
    if args.max_grad_norm is None:
        tries.append("gradient clipping, --max_grad_norm 1.0")
    if args.mixed_precision == "fp16":
        tries.append("--mixed_precision bf16 or no (fp16 overflows)")
    if store is not None:
        tries.append(
            f"if the loss is not finite from the first steps, the cached features may be corrupted: delete {store.path} "
            "and run again to extract them anew"
        )
    return (
        f"error: {error}. Training stopped before this step's update was applied, and nothing of it was written; "
        f"{kept}. Try {'; '.join(tries)}."
    )


def require_finite_weights(model, ema, step: int, output_dir: Path, learning_rate: float) -> None:
    """Stop before a checkpoint or the pipeline is written with NaN or inf weights.

    Every process checks its own copy (they are equal), so all of them stop together.

    Args:
        model: The backbone, unwrapped.
        ema (`EMAModel`, *optional*): The EMA weights.
        step (`int`): The step about to be saved.
        output_dir (`Path`): The `--output_dir`.
        learning_rate (`float`): The `--learning_rate`, for the advice.
    """
    bad = non_finite_parameters(model, ema=ema)
    if bad:
        checkpoints = list_checkpoints(output_dir)
        kept = f"the last checkpoint, {checkpoints[-1]}, is intact" if checkpoints else "no checkpoint was written"
        raise SystemExit(
            f"error: after step {step}, {len(bad)} weight tensor(s) hold NaN or inf ({', '.join(bad[:3])}"
            f"{', ...' if len(bad) > 3 else ''}), so nothing was saved; {kept}. Try a lower --learning_rate (now "
            f"{learning_rate:g}) or --max_grad_norm 1.0."
        )


def public_args(args: argparse.Namespace) -> dict:
    """The arguments without the secrets (`SECRET_ARGUMENTS`): all that trackers, the card and the summary see.

    Args:
        args (`argparse.Namespace`): The parsed arguments.
    """
    return {name: value for name, value in vars(args).items() if name not in SECRET_ARGUMENTS}


def ranks_in_sync(accelerator: Accelerator, model) -> bool:
    """Whether every process ended with the same weights (a wrong multi-process launch trains them separately)."""
    flat = torch.cat([p.detach().float().flatten() for p in plain_backbone(accelerator, model).parameters()])
    digest = torch.tensor([flat.sum().item(), (flat * flat).sum().item()], dtype=torch.float64, device=flat.device)
    gathered = accelerator.gather(digest[None]).view(-1, 2)
    return bool((gathered == gathered[0]).all())


@contextlib.contextmanager
def ema_weights(model, ema: EMAModel | None):
    """Temporarily swap the EMA weights into the model."""
    if ema is None:
        yield
        return
    ema.store(model.parameters())
    ema.copy_to(model.parameters())
    try:
        yield
    finally:
        ema.restore(model.parameters())


def validate(
    accelerator,
    model,
    ema,
    tokenizer,
    text_encoder,
    vae,
    prompts,
    fid_captions,
    args,
    output_dir: Path,
    step: int,
    seconds: float,
):
    """Sample the prompts (EMA weights if any) and save `validation/step-<step>.png`, a grid captioned with them;
    log the samples to tensorboard (one tiled image, tag "validation") and wandb (one image per prompt, captioned).
    With `--validation_fid_images`, also sample the FID captions and log their FID ("fid"). On the shapes world, also
    score one image of every held-out combination and of as many training captions (`log_scores`).

    Args:
        accelerator (`Accelerator`): The run's accelerator; its trackers receive the images.
        model: The prepared backbone.
        ema (`EMAModel`, *optional*): The EMA weights, swapped in for sampling.
        tokenizer, text_encoder, vae: The frozen components.
        prompts (`list[str]`): The validation prompts (none: no grid).
        fid_captions (`list[str]`): The captions FID samples (none: no FID).
        args (`argparse.Namespace`): The parsed arguments (seed, sampling steps, guidance scale, FID reference).
        output_dir (`Path`): The `--output_dir`.
        step (`int`): The optimizer step, the images' step in the trackers.
        seconds (`float`): The time since the run started (over every segment of a resumed run).
    """
    unwrapped = plain_backbone(accelerator, model)  # sampled uncompiled: no recompilation for the sampler's batches
    unwrapped.eval()
    pipe = build_pipeline(unwrapped, tokenizer, text_encoder, vae)
    with ema_weights(unwrapped, ema):
        if args.shapes_world:
            log_scores(accelerator, pipe, args, output_dir, step, seconds)
        images = generate(pipe, prompts, args, seed=args.seed) if prompts else []
        if fid_captions:
            report, _ = evaluate(
                pipe,
                fid_captions,
                fid_reference=args.validation_fid_reference or "shapes",
                num_inference_steps=args.validation_inference_steps,
                guidance_scale=args.validation_guidance_scale,
                seed=args.seed,
                progress=False,
            )
            accelerator.log({"fid": report["fid"]}, step=step)
            logger.info(
                f"step {step}: FID {report['fid']:.3f} ({len(fid_captions)} images, {report['fid_extractor']})"
            )
    unwrapped.train()
    if not prompts:
        return
    grid = make_image_grid(images, captions=prompts)
    path = output_dir / "validation" / f"step-{step:07d}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    grid.save(path)
    for tracker in accelerator.trackers:
        if tracker.name == "tensorboard":
            tracker.writer.add_images(
                "validation", np.stack([np.asarray(i) for i in images]), step, dataformats="NHWC"
            )
        elif tracker.name == "wandb":
            import wandb

            tracker.log({"validation": [wandb.Image(i, caption=p) for i, p in zip(images, prompts)]}, step=step)
    logger.info(f"validation grid: {path}")


def keep_scores_until(path: Path, step: int) -> None:
    """Keep the scores that a run starting at `step` continues: none for a new run (an overwritten run's are removed),
    those up to `step` for a resumed one (the later ones were scored by weights that the resumed run trains again).

    Args:
        path (`Path`): The run's `scores.jsonl`.
        step (`int`): The step the run starts from.
    """
    if not path.is_file():
        return
    lines = path.read_text(encoding="utf-8").splitlines()
    kept = [line for line in lines if step and line and json.loads(line)["step"] <= step]
    path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")


def log_scores(accelerator, pipe: LMLPPipeline, args, output_dir: Path, step: int, seconds: float) -> None:
    """Score the shapes model being trained: one image of each held-out combination and of as many training
    captions, at the validation sampler settings; log the accuracies to the trackers (`scores/<split>/<attribute>`)
    and append them, with the step and the minutes since the run started, to `<logging_dir>/scores.jsonl`, the
    learning curves that `benchmarks/learning_curves.py` plots.

    Args:
        accelerator (`Accelerator`): The run's accelerator (its trackers).
        pipe (`LMLPPipeline`): The pipeline of the model's current (EMA) weights.
        args (`argparse.Namespace`): The parsed arguments (the seed, the validation sampler settings).
        output_dir (`Path`): The `--output_dir`.
        step (`int`): The optimizer step.
        seconds (`float`): The time since the run started.
    """
    reports = evaluate_splits(
        pipe,
        args,
        dict.fromkeys(SCORED_SPLITS, 1),
        args.validation_inference_steps,
        guidance_scale=args.validation_guidance_scale,
        progress=False,
    )
    record = {"step": step, "minutes": round(seconds / 60, 3)}
    for split, report in reports.items():
        record[split] = report["shapes"]
        accelerator.log({f"scores/{split}/{name}": value for name, value in report["shapes"].items()}, step=step)
    path = output_dir / args.logging_dir / SCORES_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
    held_out, train = record["held-out"], record["train"]
    logger.info(
        f"step {step}: held-out shape {held_out['shape']:.0%}, all {held_out['all']:.0%}; train all {train['all']:.0%}"
    )


def finish(accelerator, model, ema, tokenizer, text_encoder, vae, args, output_dir: Path, seconds, in_sync) -> None:
    """Save the pipeline (EMA weights unless EMA is off) with a model card; score it on the shapes world."""
    unwrapped = plain_backbone(accelerator, model)
    if ema is not None:
        ema.copy_to(unwrapped.parameters())
    unwrapped.eval()
    pipe = build_pipeline(unwrapped, tokenizer, text_encoder, vae)
    if args.lora_rank:
        save_adapter(unwrapped, output_dir)
    else:
        pipe.save_pretrained(output_dir)

    summary = {
        **({"base_model": args.pretrained_model_name_or_path} if args.lora_rank else {}),
        "num_processes": accelerator.num_processes,
        "ranks_in_sync": in_sync,
        "steps": args.max_train_steps,
        "train_seconds": round(seconds, 1),
    }
    prompts = default_validation_prompts(args)
    grid_path = None
    if prompts:
        summary["sample_prompts"] = prompts  # the card's usage snippet samples the first
        images = generate(pipe, prompts, args, seed=args.seed)
        grid_path = output_dir / "samples.png"
        make_image_grid(images, captions=prompts).save(grid_path)
    if args.shapes_world:
        reports = final_evaluation(pipe, args)
        summary.update(score_summary(reports))
        if args.lora_rank:  # the base model, by the same evaluation: what the adapter changed
            unwrapped.disable_adapters()
            before = final_evaluation(pipe, args)
            unwrapped.enable_adapters()
            summary.update(score_summary(before, suffix="_before"))
        summary["images_per_caption"] = FINAL_EVALUATION_SEEDS
        summary["evaluation_sampler"] = reports["train"]["sampler"]
        # The whole reports go to the logs folder (the scores are in the summary, which the run prints at the end).
        reports_path = output_dir / args.logging_dir / "evaluation.json"
        reports_path.parent.mkdir(parents=True, exist_ok=True)
        whole = {"adapted": reports, "base": before} if args.lora_rank else reports
        reports_path.write_text(json.dumps(whole, indent=1), encoding="utf-8")
    with open(output_dir / "training_summary.json", "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)
    if args.lora_rank:
        write_lora_card(output_dir, unwrapped, args=public_args(args), summary=summary, sample_grid=grid_path)
        logger.info(f"saved the LoRA adapter to {output_dir}")
    else:
        write_model_card(output_dir, pipe, args=public_args(args), summary=summary, sample_grid=grid_path)
        logger.info(f"saved the pipeline to {output_dir}")

    hub_url = None
    if args.push_to_hub:
        # The same upload as `python -m diffusers_lmlp.hub push`: safetensors, configs, tokenizer, images and the
        # card (its usage block names the repo), never checkpoints, logs or pickles; one commit.
        from diffusers_lmlp.hub import push_lora, push_pipeline

        push = push_lora if args.lora_rank else push_pipeline
        commit = push(
            output_dir, args.hub_model_id or output_dir.name, token=args.hub_token, commit_message="End of training"
        )
        logger.info(f"pushed to the Hub: {commit.commit_url}")
        hub_url = commit.commit_url
    # The last words of the run, for a person: where everything is, the scores and how to load the pipeline.
    logging_dir, validation_dir = output_dir / args.logging_dir, output_dir / "validation"
    text = format_run_summary(
        summary,
        output_dir,
        sample_grid=grid_path,
        validation_dir=validation_dir if validation_dir.is_dir() else None,
        logging_dir=logging_dir if logging_dir.is_dir() else None,
        hub_url=hub_url,
    )
    print(f"\n{text}", flush=True)


def leave_finished_process() -> None:
    """End a process of a finished multi-process run without the interpreter's finalization.

    By then everything is saved and closed and the process group is destroyed. The exit handlers still run
    (`atexit`: logging, file locks, multiprocessing children); what is skipped is the teardown of modules and C++
    statics, where torch's autograd and gloo threads can race the GIL's destruction and hang a process forever after a
    complete run (pytorch/pytorch#190489; seen here as a 2-process CPU run that never exited after saving everything).
    """
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
