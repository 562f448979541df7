"""The on-disk feature store (`diffusers_lmlp.training.features`) and the training script's data-loading workers."""

import errno
import hashlib
import json
import os
import pickle
import re
import shutil
import threading
from pathlib import Path
from types import SimpleNamespace

import accelerate
import datasets
import numpy as np
import psutil
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from test_train_text_to_image import assert_same_weights, train_here, weights

from diffusers_lmlp import LMLPPipeline
from diffusers_lmlp.durable import hold_lock
from diffusers_lmlp.tiny import build_tiny_pipeline
from diffusers_lmlp.training import (
    FeatureStore,
    encode_text,
    extract_features,
    feature_store_key,
    features,
    open_feature_store,
    preprocess_image,
)
from diffusers_lmlp.training.data import BatchReader
from diffusers_lmlp.training.features import FORMAT, checksums_path, shard_name, write_manifest


def write_store(
    folder: Path, moments: torch.Tensor, text_states: torch.Tensor, counts: list[int], shard_size: int = 1024
) -> FeatureStore:
    """A store of moments (N, 2C, h, w) and float32 text states (M, T, D), `counts[i]` captions of image i."""
    folder.mkdir(parents=True, exist_ok=True)
    offsets = torch.tensor([0, *counts]).cumsum(0)  # (N + 1,)
    for shard, start in enumerate(range(0, len(counts), shard_size)):
        stop = min(start + shard_size, len(counts))
        tensors = {"moments": moments[start:stop], "caption_offsets": offsets[start : stop + 1] - offsets[start],
                   "text_states": text_states[offsets[start] : offsets[stop]]}  # fmt: skip
        features.write_shard(folder / shard_name(shard), tensors)
    write_manifest(folder, num_images=len(counts), shard_size=shard_size, text_dtype="float32")
    return FeatureStore(folder)


@pytest.fixture(scope="module")
def pipe() -> LMLPPipeline:
    return build_tiny_pipeline()


@pytest.fixture(scope="module")
def dataset() -> datasets.Dataset:
    """10 images of 20×18 px; image i has 1 + i % 3 captions, "caption k of image i"."""
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 255, (20, 18, 3), dtype=np.uint8)) for _ in range(10)]
    captions = [[f"caption {k} of image {i}" for k in range(1 + i % 3)] for i in range(10)]
    return datasets.Dataset.from_dict({"image": images, "text": captions}).cast_column("image", datasets.Image())


def arguments(pipe, **changes) -> dict:
    """The extraction's arguments: `pipe`'s components, 16 px, 4 images per shard, 2 per batch."""
    components = dict(tokenizer=pipe.tokenizer, text_encoder=pipe.text_encoder, vae=pipe.vae)
    return dict(image_column="image", caption_column="text", resolution=16, shard_size=4, batch_size=2, **components,
                **changes)  # fmt: skip


def extract(path: Path, dataset, pipe, **kwargs) -> None:
    extract_features(path, dataset, **arguments(pipe, **kwargs))


def store_files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def complete_shards(*indices: int) -> list[str]:
    """The files of complete shards `indices`: each with its checksums file."""
    return sorted(name for i in indices for name in (shard_name(i), checksums_path(Path(shard_name(i))).name))


def counting_vae_calls(pipe, monkeypatch) -> list[int]:
    """The batch size of each later call of `pipe`'s VAE encoder."""
    calls, encode = [], pipe.vae.encode
    monkeypatch.setattr(pipe.vae, "encode", lambda pixels: calls.append(len(pixels)) or encode(pixels))
    return calls


@pytest.fixture(scope="module")
def straight(tmp_path_factory, dataset, pipe) -> Path:
    """A store extracted in one go by one process: the reference of the others."""
    path = tmp_path_factory.mktemp("straight") / "store"
    extract(path, dataset, pipe)
    return path


def copy_store(straight: Path, tmp_path: Path) -> Path:
    shutil.copytree(straight, tmp_path / "store")
    return tmp_path / "store"


def overwrite(file: Path, tensor: str, at: int, data: bytes) -> None:
    """Overwrite bytes of a tensor of a shard in place, `at` bytes into it."""
    reader = features.ShardReader(file)
    reader.close()
    with open(file, "r+b") as f:
        f.seek(reader.tensors[tensor][0] + at)
        f.write(data)


def test_shards_are_safetensors_files_of_each_images_moments_and_caption_states(straight, dataset, pipe):
    shards = [shard_name(s) for s in range(3)]
    assert sorted(store_files(straight)) == ["manifest.json", *complete_shards(0, 1, 2)]
    counts = [len(captions) for captions in dataset["text"]]
    pixels = torch.stack([preprocess_image(image, 16, False) for image in dataset["image"]])  # (10, 3, 16, 16)
    with torch.no_grad():
        moments = pipe.vae.encode(pixels).latent_dist.parameters  # (10, 8, 8, 8)
    states = encode_text(pipe.tokenizer, pipe.text_encoder, sum(dataset["text"], []))  # (19, 16, 32)
    manifest = json.loads((straight / "manifest.json").read_text())
    assert (manifest["num_images"], manifest["text_dtype"], FeatureStore(straight).num_captions) == (10, "float32", 19)
    for shard, record, start in zip(shards, manifest["shards"], range(0, 10, 4)):
        tensors = load_file(straight / shard)
        n, first = min(4, 10 - start), sum(counts[:start])
        offsets = torch.tensor([0, *counts[start : start + n]]).cumsum(0)
        assert tensors["caption_offsets"].tolist() == offsets.tolist()
        torch.testing.assert_close(tensors["moments"], moments[start : start + n], rtol=0, atol=1e-5)
        torch.testing.assert_close(tensors["text_states"], states[first : first + int(offsets[-1])], rtol=0, atol=1e-5)
        raw = (straight / shard).read_bytes()  # its size and SHA-256, next to the shard and in the manifest
        expected = {"bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
        assert json.loads(checksums_path(straight / shard).read_text()).items() >= expected.items()
        assert record == {"file": shard, "num_captions": int(offsets[-1]), **expected}
    got_moments, got_states = FeatureStore(straight).read([9, 4, 5], torch.tensor([0.99, 0.0, 0.5]))
    torch.testing.assert_close(got_moments, moments[[9, 4, 5]], rtol=0, atol=1e-5)
    # image 9: last of its 1 caption; image 4: first of 2; image 5: caption ⌊0.5 · 3⌋ = 1 of 3
    rows = [sum(counts[:9]), sum(counts[:4]), sum(counts[:5]) + 1]
    torch.testing.assert_close(got_states, states[rows], rtol=0, atol=1e-5)


@pytest.mark.parametrize("fails", ["encoding", "checksums"])
def test_an_interrupted_extraction_resumes_at_its_first_incomplete_shard(
    tmp_path, straight, dataset, pipe, monkeypatch, fails
):
    # Killed in shard 1's second batch (nothing of it is on disk), or once shard 1 is renamed into place but before
    # its checksums file is written: shard 0 is complete, shard 1 is not.
    calls, encode, write_json = [], pipe.vae.encode, features.write_json_durably

    def encoding(pixels):
        calls.append(len(pixels))
        if len(calls) == 4 and fails == "encoding":
            raise KeyboardInterrupt
        return encode(pixels)

    def checksums(path, value):
        if len(calls) == 4:  # shard 1's
            raise KeyboardInterrupt
        write_json(path, value)

    monkeypatch.setattr(pipe.vae, "encode", encoding)
    monkeypatch.setattr(features, "write_json_durably", checksums)
    with pytest.raises(KeyboardInterrupt):
        extract(tmp_path / "store", dataset, pipe)
    left = complete_shards(0) + ([shard_name(1)] if fails == "checksums" else [])
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == sorted(left)
    monkeypatch.undo()
    calls = counting_vae_calls(pipe, monkeypatch)
    extract(tmp_path / "store", dataset, pipe)
    assert calls == [2, 2, 2]  # shard 1 (images 4-7) and shard 2 (images 8, 9): shard 0 is not extracted again
    assert store_files(tmp_path / "store") == store_files(straight)


def test_a_batch_reads_only_its_own_rows(straight, monkeypatch):
    store, read, preadv = FeatureStore(straight), [], os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, buffers, offset: read.append(sum(memoryview(b).nbytes for b in buffers)) or preadv(fd, buffers, offset))  # fmt: skip
    picks = torch.tensor([0.2, 0.7, 0.9])
    moments, states = store.read([1, 8, 6], picks)  # shards 0, 2 and 1 of 4, 2 and 4 images
    image = [moments[0].numel() * 4, states[0].numel() * 4]  # its moments, then one text state
    # Each shard's caption offsets are read once while it is open.
    assert read == [(4 + 1) * 8, *image, (2 + 1) * 8, *image, (4 + 1) * 8, *image]
    read.clear()
    again, _ = store.read([6, 1, 8], picks)  # the same shards: their images' rows only
    assert read == 3 * image
    torch.testing.assert_close(again, moments[[2, 0, 1]], rtol=0, atol=0)


def test_each_process_writes_its_own_shards_and_the_main_process_the_manifest(tmp_path, straight, dataset, pipe):
    path, barriers = tmp_path / "store", []
    extract(path, dataset, pipe, process_index=1, num_processes=2, wait_for_everyone=lambda: barriers.append(1))
    assert sorted(p.name for p in path.iterdir()) == complete_shards(1)  # no manifest
    extract(path, dataset, pipe, process_index=0, num_processes=2, wait_for_everyone=lambda: barriers.append(0),
            num_workers=2)  # fmt: skip
    assert barriers == [1, 1, 0, 0]  # all wait before the manifest and after it
    assert store_files(path) == store_files(straight)  # two workers decode the images alike too


def test_float16_text_states_take_half_the_bytes_and_read_back_close_or_are_refused_beyond_its_range(
    tmp_path, straight, dataset, pipe, monkeypatch
):
    extract(tmp_path / "store", dataset, pipe, text_dtype="float16")
    half, full = load_file(tmp_path / "store" / shard_name(0)), load_file(straight / shard_name(0))
    assert half["text_states"].dtype == torch.float16 and half["moments"].dtype == torch.float32
    assert half["text_states"].nbytes * 2 == full["text_states"].nbytes
    torch.testing.assert_close(half["moments"], full["moments"], rtol=0, atol=0)
    torch.testing.assert_close(half["text_states"].float(), full["text_states"], rtol=1e-3, atol=1e-3)
    _, states = FeatureStore(tmp_path / "store").read([3], torch.tensor([0.0]))
    assert states.dtype == torch.float16
    encode_text = features.encode_text

    def huge_for_one_caption(tokenizer, text_encoder, texts):
        states = encode_text(tokenizer, text_encoder, texts)  # (m, T, D)
        return torch.stack([s * 1e6 if t == "caption 1 of image 7" else s for s, t in zip(states, texts)])

    monkeypatch.setattr(features, "encode_text", huge_for_one_caption)
    extract(tmp_path / "fp32", dataset, pipe)  # in float32 they fit
    with pytest.raises(ValueError, match=re.escape("image 7: the text states of its caption 'caption 1 of image 7' "
                                                   "are not finite (NaN or inf) (or beyond float16's range")):  # fmt: skip
        extract(tmp_path / "fp16", dataset, pipe, text_dtype="float16")


def test_the_key_changes_with_the_data_the_resolution_and_the_dtype(dataset, pipe):
    def key(data=dataset, **changes):
        fields = {**arguments(pipe), "text_dtype": "float32", **changes}
        return feature_store_key(data, **{k: v for k, v in fields.items() if k not in ("shard_size", "batch_size")})

    assert key() == key()
    others = [key(dataset.select(range(9))), key(resolution=32), key(text_dtype="float16"), key(caption_column="c")]
    assert len({key(), *others}) == 5


def test_a_second_run_on_one_cache_waits_for_the_first_to_build_the_store_then_reads_it(
    tmp_path, dataset, pipe, caplog
):
    store, opened = tmp_path / "features" / "store", []
    store.parent.mkdir()
    building = hold_lock(store.parent / ".store.lock")  # as another run that builds this store holds it
    with caplog.at_level("INFO"):
        thread = threading.Thread(target=lambda: opened.append(open_feature_store(store, dataset, **arguments(pipe))))
        thread.start()
        thread.join(timeout=2)
        assert thread.is_alive() and not store.exists()  # it waits, and writes nothing
        building.close()
        thread.join(timeout=120)
        again = open_feature_store(store, dataset, **arguments(pipe))  # read, not extracted again
    assert not thread.is_alive() and len(opened[0]) == len(again) == 10 and again.num_captions == 19
    assert f"waiting for another run that builds the feature cache {store}" in caplog.text
    assert [r.message for r in caplog.records].count(f"building the feature cache {store}") == 1


# ------------------------------------------------------------------------------------------------------- integrity


@pytest.mark.parametrize(
    "shard, damage, problem",
    [  # zeroed caption offsets once trained with exit code 0, every image paired with one caption
        (1, lambda f: overwrite(f, "caption_offsets", 0, bytes(8 * 5)), ": its SHA-256 is not the one its extraction"),
        (2, lambda f: overwrite(f, "text_states", 1000, b"\x00\x00\x80\x7f"), ": its SHA-256 is not the one"),  # inf
        (0, lambda f: f.write_bytes(b"\xff" * 8 + f.read_bytes()[8:]), " is not a safetensors file"),
        (1, lambda f: os.truncate(f, f.stat().st_size - 100), " is {cut} bytes where its extraction wrote {size}"),
    ],
    ids=["zeroed-offsets", "inf", "header", "truncated"],
)  # fmt: skip
def test_a_damaged_shard_is_refused_and_the_advice_re_extracts_only_it(
    tmp_path, straight, dataset, pipe, monkeypatch, shard, damage, problem
):
    store = copy_store(straight, tmp_path)
    size = (store / shard_name(shard)).stat().st_size
    damage(store / shard_name(shard))
    with pytest.raises(ValueError) as error:
        FeatureStore(store)
    assert str(error.value).startswith(f"{store / shard_name(shard)}{problem.format(cut=f'{size - 100:,}', size=f'{size:,}')}")  # fmt: skip
    [(file, manifest)] = re.findall(
        r"Delete (\S+) and (\S+): the next run extracts that shard again", str(error.value)
    )
    assert (file, manifest) == (str(store / shard_name(shard)), str(store / "manifest.json"))
    for path in (file, manifest):
        Path(path).unlink()
    calls = counting_vae_calls(pipe, monkeypatch)
    repaired = open_feature_store(store, dataset, **arguments(pipe))
    assert calls == [2] * (2 if shard < 2 else 1)  # that shard's images alone
    assert store_files(store) == store_files(straight)
    picks = torch.rand(10, generator=torch.Generator().manual_seed(0))
    for got, expected in zip(repaired.read(list(range(10)), picks), FeatureStore(straight).read(range(10), picks)):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize(
    "edit, problem",
    [
        (lambda m: m["shards"][1].update(sha256="0" * 63), "is not a valid '{FORMAT}' manifest ('shards[1]' missing or"),
        (lambda m: m.update(text_dtype="int8", num_images="10"), "manifest ('num_images', 'text_dtype' missing or wrong)"),
        (lambda m: m.update(format="diffusers-lmlp feature store v2"),
         "is not a '{FORMAT}' manifest: delete {store} to extract it again"),
        (None, "{store} is not a complete feature store: manifest.json is missing. On several machines, put --cache_dir"),
    ],
    ids=["not-hex", "wrong-types", "previous-format", "missing"],
)  # fmt: skip
def test_a_manifest_that_is_missing_of_another_format_or_wrong_is_refused_with_the_fix(
    tmp_path, straight, edit, problem
):
    store = copy_store(straight, tmp_path)
    manifest = json.loads((store / "manifest.json").read_text())
    (store / "manifest.json").unlink()
    if edit:
        edit(manifest)
        (store / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError if edit else FileNotFoundError) as error:
        FeatureStore(store)
    assert problem.format(FORMAT=FORMAT, store=store) in str(error.value)


def test_a_missing_shard_or_checksums_file_stops_the_manifest_with_the_fix(tmp_path, straight):
    store = copy_store(straight, tmp_path)
    (store / "manifest.json").unlink()
    sidecar = checksums_path(store / shard_name(2))
    sidecar.write_text(json.dumps({**json.loads(sidecar.read_text()), "sha256": {}}))  # checks nothing
    with pytest.raises(ValueError, match=re.escape(f"{sidecar} is not a shard's checksums file: delete it and")):
        write_manifest(store, num_images=10, shard_size=4, text_dtype="float32")
    (store / shard_name(1)).unlink()
    with pytest.raises(FileNotFoundError, match=f"{shard_name(1)} is missing after the extraction.*--cache_dir"):
        write_manifest(store, num_images=10, shard_size=4, text_dtype="float32")
    assert not (store / "manifest.json").exists()


def test_a_store_of_another_format_is_reported_with_its_size_when_a_new_one_is_made(
    tmp_path, straight, dataset, pipe, caplog
):
    old = copy_store(straight, tmp_path / "features")
    manifest = json.loads((old / "manifest.json").read_text())
    (old / "manifest.json").write_text(json.dumps({**manifest, "format": "diffusers-lmlp feature store v2"}))
    size = sum(file.stat().st_size for file in old.iterdir())
    with caplog.at_level("WARNING"):
        open_feature_store(tmp_path / "features" / "new", dataset.select(range(2)), **arguments(pipe))
    assert [r.message for r in caplog.records if r.levelname == "WARNING"] == [
        f"{old} is a feature store of another format ('diffusers-lmlp feature store v2', not '{FORMAT}'), which this "
        f"version does not read: delete it to free {size / 1e9:.2f} GB"
    ]


def test_checksums_are_checked_once_per_run_shared_among_its_processes(tmp_path, straight, dataset, pipe, monkeypatch):
    store_path, events = copy_store(straight, tmp_path), []
    verify_shard = FeatureStore.verify_shard

    def counting(self, index):
        events.append(shard_name(index))
        verify_shard(self, index)

    monkeypatch.setattr(FeatureStore, "verify_shard", counting)
    stores = [
        open_feature_store(store_path, dataset, process_index=rank, num_processes=2,
                           wait_for_everyone=lambda: events.append("wait"), **arguments(pipe))
        for rank in (0, 1)
    ]  # fmt: skip
    # Rank 0 hashes shards 0 and 2, rank 1 shard 1, each before the barrier that precedes any read.
    assert events[:2] == ["wait", "wait"] and sorted(events[2:4]) == [shard_name(0), shard_name(2)]
    assert events[4:] == ["wait", "wait", "wait", shard_name(1), "wait"]
    del events[:]
    for store in [*stores, *(pickle.loads(pickle.dumps(store)) for store in stores)]:  # as DataLoader workers get it
        store.read(list(range(10)), torch.rand(10))
    assert events == []  # reading never hashes again


def test_a_nan_moment_is_refused_at_extraction_naming_the_image_file(tmp_path, dataset, pipe, monkeypatch):
    for i, image in enumerate(dataset["image"]):
        image.save(tmp_path / f"{i}.png")
    paths = [str(tmp_path / f"{i}.png") for i in range(10)]
    image_files = datasets.Dataset.from_dict({"image": paths, "text": dataset["text"]}).cast_column("image", datasets.Image())  # fmt: skip
    encode = pipe.vae.encode

    def overflowing(pixels):  # image 5 (the 2nd of the 3rd batch) overflows, as an fp16 VAE can
        output = encode(pixels)
        if len(calls) == 2:
            output.latent_dist.parameters[1, 0, 3, 3] = float("nan")
        calls.append(1)
        return output

    calls = []
    monkeypatch.setattr(pipe.vae, "encode", overflowing)
    with pytest.raises(ValueError) as error:
        extract(tmp_path / "store", image_files, pipe)
    assert str(error.value).startswith(f"image 5 ({tmp_path / '5.png'}): its VAE moments are not finite (NaN or inf)")
    # Shard 1 (images 4-7) is refused at its first batch: nothing of it is written.
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == complete_shards(0)


# ----------------------------------------------------------------------------------------- the training script


def recording_pids(monkeypatch, method: str, pids: Path) -> None:
    """Append the id of each process that calls `BatchReader.<method>` to `pids`."""
    original = getattr(BatchReader, method)

    def recording(self, *args):
        with open(pids, "a") as f:
            f.write(f"{os.getpid()}\n")
        return original(self, *args)

    monkeypatch.setattr(BatchReader, method, recording)


@pytest.mark.slow
@pytest.mark.parametrize("cache", ["--cache_features", "--no-cache_features"])
def test_a_resumed_run_with_two_workers_equals_an_uninterrupted_run_without(workspace, monkeypatch, cache):
    name = cache.strip("-")
    steps = ["--max_train_steps", "4", "--checkpointing_steps", "2", cache]
    train_here(workspace, f"{name}-straight", *steps, "--dataloader_num_workers", "0")

    resumed = workspace / f"{name}-resumed"
    shutil.copytree(workspace / f"{name}-straight" / "checkpoint-2", resumed / "checkpoint-2")
    recording_pids(monkeypatch, "load", workspace / f"{name}-pids")
    train_here(workspace, resumed, *steps, "--dataloader_num_workers", "2", "--resume_from_checkpoint", "latest")
    readers = (workspace / f"{name}-pids").read_text().split()
    assert len(readers) == 2 and len(set(readers)) == 2 and str(os.getpid()) not in readers  # steps 3, 4: 2 workers
    assert_same_weights(weights(resumed), weights(workspace / f"{name}-straight"))


def test_a_run_that_fails_mid_training_leaves_no_worker_processes(workspace, monkeypatch):
    def full_disk(output_dir, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(output_dir))

    monkeypatch.setattr(accelerate.accelerator, "save_accelerator_state", full_disk)  # the first checkpoint fails
    before = {child.pid for child in psutil.Process().children(recursive=True)}
    args = ["--max_train_steps", "6", "--checkpointing_steps", "2", "--dataloader_num_workers", "2"]
    with pytest.raises(SystemExit, match="no space left on the device") as failure:
        train_here(workspace, "fails", *args)
    assert failure.value is not None  # the failure is still held, as a caller's handler would, and no worker is left
    assert [child for child in psutil.Process().children(recursive=True) if child.pid not in before] == []


@pytest.mark.slow
def test_a_stream_is_read_by_one_worker_and_resumes_exactly(workspace, monkeypatch):
    def run(out: str, *extra: str) -> None:
        steps = ["--streaming", "--max_train_steps", "8", "--checkpointing_steps", "3"]
        train_here(workspace, out, *steps, *extra, data_option="--dataset_name")

    run("stream-straight")
    shutil.copytree(workspace / "stream-straight" / "checkpoint-3", workspace / "stream-resumed" / "checkpoint-3")
    recording_pids(monkeypatch, "_next_records", workspace / "stream-pids")
    run("stream-resumed", "--dataloader_num_workers", "2", "--resume_from_checkpoint", "latest")
    readers = set((workspace / "stream-pids").read_text().split())
    assert len(readers) == 1 and str(os.getpid()) not in readers  # one worker reads the stream, in order
    # 12 samples skipped, then 5 more steps through the epoch boundary, as without workers
    assert_same_weights(weights(workspace / "stream-resumed"), weights(workspace / "stream-straight"))


def test_an_empty_stream_is_an_error_not_an_endless_wait():
    empty = datasets.IterableDataset.from_generator(lambda: iter(()), features=datasets.Features({"text": datasets.Value("string")}))  # fmt: skip
    args = SimpleNamespace(seed=0, train_batch_size=2, gradient_accumulation_steps=1, streaming=True)
    with pytest.raises(ValueError, match="the stream of process 0 is empty"):
        BatchReader(args, empty, None, 0, 1, 0)._next_records(2)


@pytest.mark.slow
def test_float16_storage_trains_like_float32(workspace):
    runs = {}
    for dtype in ("float32", "float16"):
        out = workspace / f"fp-{dtype}"
        train_here(workspace, out, "--max_train_steps", "5", "--cache_features", "--cache_text_dtype", dtype)
        runs[dtype] = weights(out)
    initial = build_tiny_pipeline().transformer.state_dict()  # the workspace's "tiny" pipeline, before training
    moved = sum(float((runs["float32"][k] - initial[k]).norm() ** 2) for k in initial) ** 0.5
    apart = sum(float((runs["float16"][k] - runs["float32"][k]).norm() ** 2) for k in initial) ** 0.5
    assert 0 < apart < 0.01 * moved  # float16 text states: a trace of the change 5 steps of training make


@pytest.mark.slow
def test_a_damaged_feature_store_stops_the_run_naming_the_shard(workspace, tmp_path):
    steps = ["--max_train_steps", "1", "--cache_features", "--cache_dir", str(tmp_path / "cache")]
    train_here(workspace, tmp_path / "first", *steps)
    [shard] = (tmp_path / "cache" / "features").glob(f"*/{shard_name(0)}")
    overwrite(shard, "caption_offsets", 0, bytes(8 * 25))  # the workspace's 24 images: 25 offsets
    with pytest.raises(SystemExit) as stopped:
        train_here(workspace, tmp_path / "second", *steps)
    assert str(stopped.value.code).startswith(f"error: {shard}: its SHA-256 is not the one")
    assert not (tmp_path / "second" / "checkpoint-1").exists()
