"""The batches of a run: each optimizer step's samples, caption dropout, noise and latents, read ahead by
`DataLoader` workers from the feature store (`build_feature_store`) or from the images themselves.

Every random choice (data order, caption pick, caption dropout, flips, latent noise) is a function of (seed, step,
sample position) through `step_generator`, so a resumed run continues exactly as the uninterrupted one, and the
batches are the same with any number of workers.
"""

import hashlib
import itertools
from collections.abc import Iterator
from pathlib import Path

import torch
from accelerate.logging import get_logger

from diffusers_lmlp.evaluation.captions import captions_of
from diffusers_lmlp.training.data import preprocess_image
from diffusers_lmlp.training.feature_extraction import encode_text, open_feature_store
from diffusers_lmlp.training.features import FeatureStore, feature_store_key


logger = get_logger(__name__)


def step_generator(seed: int, *keys: int) -> torch.Generator:
    """A generator that depends only on the seed and the keys (step, sample position, …): exact resume."""
    digest = hashlib.sha256(repr((seed, *keys)).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


def build_feature_store(args, dataset, tokenizer, text_encoder, vae, accelerator, cache_dir: Path) -> FeatureStore:
    """The feature store `<cache_dir>/features/<key>` of this data and these components, extracted first if needed
    (each process its shards)."""
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
    """The CPU half of making a batch, run in `DataLoader` workers: the random draws, then the samples from the
    feature store (latents re-sampled from the stored moments, as the reference does) or decoded images.

    A map-style dataset is an endless stream of seeded per-epoch permutations, so resuming needs no data state; a
    streaming one is read in order from this process's shard, skipping what the steps before `step` used.
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
            # As a NumPy array: much cheaper to index than a tensor.
            self._permutation = (epoch, torch.randperm(len(self.dataset), generator=generator).numpy())
        return int(self._permutation[1][offset])

    def _next_records(self, count: int) -> list[dict]:
        if self._stream is None:
            self._stream = self._epochs()
            per_step = self.args.train_batch_size * self.args.gradient_accumulation_steps
            self._next_records(self.step * per_step)  # what the steps before a resume consumed
        return [next(self._stream) for _ in range(count)]

    def _epochs(self) -> Iterator[dict]:
        """This process's shard of the stream, shuffled, epoch after epoch, one record at a time.

        Read with `iter(batch_size=1)`: iterating the dataset in a worker lets `datasets` split it between workers.
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
        """The CPU half of the batch at `positions` of the sample stream: `drop` (b,) and either `latents`/`states`
        from the store or `pixels`/`texts` to encode; `BatchSource.finish` continues with `generator`."""
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

    Worker w of W makes steps first + w, first + w + W, …; a `DataLoader` returns its workers' items in turn, in order.
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
    """The clean latents and conditioning of the samples at given positions of the sample stream.

    A `BatchReader` makes the CPU half in worker processes, ahead of the step; this process runs the encoders when
    there is no feature store, applies caption dropout and scales the latents. Every draw comes from the step's
    generator, so the batches are the same with any number of workers and a resumed run continues exactly.
    """

    def __init__(self, args, dataset, store, tokenizer, text_encoder, vae, step, process_index=0, num_processes=1):
        self.args, self.tokenizer, self.text_encoder, self.vae = args, tokenizer, text_encoder, vae
        self.reader = BatchReader(args, dataset, store, process_index, num_processes, step)
        self.empty_states = encode_text(tokenizer, text_encoder, [""])  # (1, T, D)

    def batch(self, positions: list[int], generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents (b, C, h, w) scaled by the latent scale, and text states (b, T, D), caption dropout applied."""
        return self.finish(self.reader.load(positions, generator), generator)

    @torch.no_grad()
    def finish(self, loaded: dict, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """`batch` from what `BatchReader.load` made, with the generator where `load` left it."""
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
        """The latents, text states and generator (where the batch left it) of steps `first` … `last - 1`, read by
        `--dataloader_num_workers` worker processes."""
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
