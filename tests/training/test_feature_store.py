"""Reading the training data (imagefolders whatever their file names, saved datasets, COCO-2014 folders, the checks at
start-up), the on-disk feature store (`diffusers_lmlp.training.features`) and the data-loading workers."""

import csv
import errno
import hashlib
import json
import os
import pickle
import re
import shutil
import threading
from pathlib import Path

import accelerate
import datasets
import numpy as np
import psutil
import pyarrow
import pyarrow.parquet
import pytest
import torch
from coco_fixture import write_coco2014
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
from diffusers_lmlp.training.data import BatchReader, load_coco2014, load_training_data
from diffusers_lmlp.training.features import FORMAT, checksums_path, shard_name, write_manifest


def write_store(folder: Path, moments, text_states, counts: list[int], shard_size: int = 1024) -> FeatureStore:
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
    return dict(image_column="image", caption_column="text", resolution=16, shard_size=4, batch_size=2,
                tokenizer=pipe.tokenizer, text_encoder=pipe.text_encoder, vae=pipe.vae, **changes)  # fmt: skip


def extract(path: Path, dataset, pipe, **kwargs) -> None:
    extract_features(path, dataset, **arguments(pipe, **kwargs))


def store_files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def complete_shards(*indices: int) -> list[str]:  # each shard with its checksums file
    return sorted(name for i in indices for name in (shard_name(i), checksums_path(Path(shard_name(i))).name))


def counting_vae_calls(pipe, monkeypatch) -> list[int]:
    """The batch size of each later call of `pipe`'s VAE encoder."""
    calls, encode = [], pipe.vae.encode
    monkeypatch.setattr(pipe.vae, "encode", lambda pixels: calls.append(len(pixels)) or encode(pixels))
    return calls


@pytest.fixture(scope="module")
def straight(tmp_path_factory, dataset, pipe) -> Path:
    """A store extracted in one go by one process: the reference of the others."""
    extract(path := tmp_path_factory.mktemp("straight") / "store", dataset, pipe)
    return path


def overwrite(file: Path, tensor: str, at: int, data: bytes) -> None:
    """Overwrite bytes of a tensor of a shard in place, `at` bytes into it."""
    (reader := features.ShardReader(file)).close()
    with open(file, "r+b") as f:
        f.seek(reader.tensors[tensor][0] + at)
        f.write(data)


def test_shards_are_safetensors_files_of_each_images_moments_and_caption_states(straight, dataset, pipe, monkeypatch):
    assert sorted(store_files(straight)) == ["manifest.json", *complete_shards(0, 1, 2)]
    counts = [len(captions) for captions in dataset["text"]]
    pixels = torch.stack([preprocess_image(image, 16, False) for image in dataset["image"]])  # (10, 3, 16, 16)
    with torch.no_grad():
        moments = pipe.vae.encode(pixels).latent_dist.parameters  # (10, 8, 8, 8)
    states = encode_text(pipe.tokenizer, pipe.text_encoder, sum(dataset["text"], []))  # (19, 16, 32)
    manifest = json.loads((straight / "manifest.json").read_text())
    assert (manifest["num_images"], manifest["text_dtype"], FeatureStore(straight).num_captions) == (10, "float32", 19)
    for shard, record, start in zip(map(shard_name, range(3)), manifest["shards"], range(0, 10, 4)):
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
    store, read, preadv = FeatureStore(straight), [], os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, buffers, offset: read.append(sum(memoryview(b).nbytes for b in buffers)) or preadv(fd, buffers, offset))  # fmt: skip
    got_moments, got_states = store.read([9, 4, 5], torch.tensor([0.99, 0.0, 0.5]))
    torch.testing.assert_close(got_moments, moments[[9, 4, 5]], rtol=0, atol=1e-5)
    # image 9: last of its 1 caption; image 4: first of 2; image 5: caption ⌊0.5 · 3⌋ = 1 of 3
    rows = [sum(counts[:9]), sum(counts[:4]), sum(counts[:5]) + 1]
    torch.testing.assert_close(got_states, states[rows], rtol=0, atol=1e-5)
    # A batch reads only its rows: its moments, then one text state; a shard's caption offsets once while it is open.
    image = [moments[0].numel() * 4, states[0].numel() * 4]
    assert read == [(2 + 1) * 8, *image, (4 + 1) * 8, *image, *image]
    read.clear()
    store.read([5, 9, 4], torch.tensor([0.0, 0.0, 0.0]))
    assert read == 3 * image


@pytest.mark.parametrize("fails", ["encoding", "checksums"])
def test_a_killed_extraction_resumes_at_its_unfinished_shard(tmp_path, straight, dataset, pipe, monkeypatch, fails):
    # Killed in shard 1's second batch (none of it on disk), or after its rename but before its checksums file.
    target, name, at = (pipe.vae, "encode", 4) if fails == "encoding" else (features, "write_json_durably", 2)
    original, calls = getattr(target, name), []

    def failing(*args):
        calls.append(1)
        if len(calls) == at:
            raise KeyboardInterrupt
        return original(*args)

    monkeypatch.setattr(target, name, failing)
    with pytest.raises(KeyboardInterrupt):
        extract(tmp_path / "store", dataset, pipe)
    left = complete_shards(0) + ([shard_name(1)] if fails == "checksums" else [])
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == sorted(left)
    monkeypatch.undo()
    calls = counting_vae_calls(pipe, monkeypatch)
    extract(tmp_path / "store", dataset, pipe)
    assert calls == [2, 2, 2]  # shard 1 (images 4-7) and shard 2 (images 8, 9): shard 0 is not extracted again
    assert store_files(tmp_path / "store") == store_files(straight)


def test_each_process_extracts_and_verifies_its_own_shards(tmp_path, straight, dataset, pipe, monkeypatch):
    path, events, verify_shard = tmp_path / "store", [], FeatureStore.verify_shard
    extract(path, dataset, pipe, process_index=1, num_processes=2, wait_for_everyone=lambda: events.append(1))
    assert sorted(p.name for p in path.iterdir()) == complete_shards(1)  # no manifest
    extract(path, dataset, pipe, process_index=0, num_processes=2, wait_for_everyone=lambda: events.append(0),
            num_workers=2)  # fmt: skip
    assert events == [1, 1, 0, 0]  # all wait before the manifest and after it
    assert store_files(path) == store_files(straight)  # two workers decode the images alike too
    verifying = lambda self, i: events.append(shard_name(i)) or verify_shard(self, i)  # noqa: E731
    monkeypatch.setattr(FeatureStore, "verify_shard", verifying)
    events.clear()
    ranks = dict(num_processes=2, wait_for_everyone=lambda: events.append("wait"), **arguments(pipe))
    stores = [open_feature_store(path, dataset, process_index=rank, **ranks) for rank in (0, 1)]
    # Checksums are checked once per run: rank 0 hashes shards 0 and 2, rank 1 shard 1, before the barrier of any read.
    assert events[:2] == ["wait", "wait"] and sorted(events[2:4]) == [shard_name(0), shard_name(2)]
    assert events[4:] == ["wait", "wait", "wait", shard_name(1), "wait"]
    events.clear()
    for store in [*stores, *(pickle.loads(pickle.dumps(store)) for store in stores)]:  # as DataLoader workers get it
        store.read(list(range(10)), torch.rand(10))
    assert events == []  # reading never hashes again


def test_float16_text_states_take_half_the_bytes_or_are_refused(tmp_path, straight, dataset, pipe, monkeypatch):
    extract(tmp_path / "store", dataset, pipe, text_dtype="float16")
    half, full = load_file(tmp_path / "store" / shard_name(0)), load_file(straight / shard_name(0))
    assert half["text_states"].dtype == torch.float16 and half["text_states"].nbytes * 2 == full["text_states"].nbytes
    torch.testing.assert_close(half["moments"], full["moments"], rtol=0, atol=0)  # float32 still
    torch.testing.assert_close(half["text_states"].float(), full["text_states"], rtol=1e-3, atol=1e-3)
    assert FeatureStore(tmp_path / "store").read([3], torch.tensor([0.0]))[1].dtype == torch.float16
    encode_text = features.encode_text

    def huge_for_one_caption(tokenizer, text_encoder, texts):
        states = encode_text(tokenizer, text_encoder, texts)  # (m, T, D)
        return torch.stack([s * 1e6 if t == "caption 1 of image 7" else s for s, t in zip(states, texts)])

    monkeypatch.setattr(features, "encode_text", huge_for_one_caption)
    extract(tmp_path / "fp32", dataset, pipe)  # in float32 they fit
    with pytest.raises(ValueError, match=re.escape("'caption 1 of image 7' are not finite (NaN or inf) (or beyond")):
        extract(tmp_path / "fp16", dataset, pipe, text_dtype="float16")


def test_the_key_changes_with_the_data_the_resolution_and_the_dtype(dataset, pipe):
    fields = {k: v for k, v in arguments(pipe, text_dtype="float32").items() if k not in ("shard_size", "batch_size")}
    key = lambda data=dataset, **changes: feature_store_key(data, **{**fields, **changes})  # noqa: E731
    others = [key(dataset.select(range(9))), key(resolution=32), key(text_dtype="float16"), key(caption_column="c")]
    assert key() == key() and len({key(), *others}) == 5


def test_a_second_run_waits_for_the_first_to_build_the_store_then_reads_it(tmp_path, dataset, pipe, caplog):
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
def test_a_damaged_shard_is_refused_and_redone(tmp_path, straight, dataset, pipe, monkeypatch, shard, damage, problem):
    store = shutil.copytree(straight, tmp_path / "store")
    size = (store / shard_name(shard)).stat().st_size
    damage(store / shard_name(shard))
    with pytest.raises(ValueError) as error:
        FeatureStore(store)
    file, problem = store / shard_name(shard), problem.format(cut=f"{size - 100:,}", size=f"{size:,}")
    assert str(error.value).startswith(f"{file}{problem}")
    assert f"Delete {file} and {store / 'manifest.json'}: the next run extracts that shard again" in str(error.value)
    file.unlink()
    (store / "manifest.json").unlink()
    calls = counting_vae_calls(pipe, monkeypatch)
    assert len(open_feature_store(store, dataset, **arguments(pipe))) == 10
    assert calls == [2] * (2 if shard < 2 else 1) and store_files(store) == store_files(straight)  # that shard alone


@pytest.mark.parametrize(
    "edit, problem",
    [
        (lambda m: m["shards"][1].update(sha256="0" * 63), "is not a valid '{FORMAT}' manifest ('shards[1]'"),
        (lambda m: m.update(text_dtype="int8", num_images="10"), "('num_images', 'text_dtype' missing or wrong)"),
        (lambda m: m.update(format="diffusers-lmlp feature store v2"),
         "is not a '{FORMAT}' manifest: delete {store} to extract it again"),
        (None, "{store} is not a complete feature store: manifest.json is missing. On several machines, put --cache"),
    ],
    ids=["not-hex", "wrong-types", "previous-format", "missing"],
)  # fmt: skip
def test_a_missing_wrong_or_other_format_manifest_is_refused_with_the_fix(tmp_path, straight, edit, problem):
    store = shutil.copytree(straight, tmp_path / "store")
    manifest = json.loads((store / "manifest.json").read_text())
    (store / "manifest.json").unlink()
    if edit:
        edit(manifest)
        (store / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError if edit else FileNotFoundError) as error:
        FeatureStore(store)
    assert problem.format(FORMAT=FORMAT, store=store) in str(error.value)


def test_a_missing_shard_or_checksums_file_stops_the_manifest_with_the_fix(tmp_path, straight):
    store = shutil.copytree(straight, tmp_path / "store")
    (store / "manifest.json").unlink()
    sidecar = checksums_path(store / shard_name(2))
    sidecar.write_text(json.dumps({**json.loads(sidecar.read_text()), "sha256": {}}))  # checks nothing
    with pytest.raises(ValueError, match=re.escape(f"{sidecar} is not a shard's checksums file: delete it and")):
        write_manifest(store, num_images=10, shard_size=4, text_dtype="float32")
    (store / shard_name(1)).unlink()
    with pytest.raises(FileNotFoundError, match=f"{shard_name(1)} is missing after the extraction.*--cache_dir"):
        write_manifest(store, num_images=10, shard_size=4, text_dtype="float32")
    assert not (store / "manifest.json").exists()


def test_a_store_of_another_format_is_reported_with_its_size(tmp_path, straight, dataset, pipe, caplog):
    old = shutil.copytree(straight, tmp_path / "features" / "store")
    manifest = json.loads((old / "manifest.json").read_text())
    (old / "manifest.json").write_text(json.dumps({**manifest, "format": "diffusers-lmlp feature store v2"}))
    size = sum(file.stat().st_size for file in old.iterdir())
    with caplog.at_level("WARNING"):
        open_feature_store(tmp_path / "features" / "new", dataset.select(range(2)), **arguments(pipe))
    message = f"{old} is a feature store of another format ('diffusers-lmlp feature store v2', not '{FORMAT}')"
    assert message in caplog.text and f"does not read: delete it to free {size / 1e9:.2f} GB" in caplog.text


def test_a_nan_moment_is_refused_at_extraction_naming_the_image_file(tmp_path, dataset, pipe, monkeypatch):
    paths = [str(tmp_path / f"{i}.png") for i in range(10)]
    for path, image in zip(paths, dataset["image"]):
        image.save(path)
    image_files = datasets.Dataset.from_dict({"image": paths, "text": dataset["text"]}).cast_column("image", datasets.Image())  # fmt: skip
    encode, calls = pipe.vae.encode, []

    def overflowing(pixels):  # image 5 (the 2nd of the 3rd batch) overflows, as an fp16 VAE can
        output = encode(pixels)
        if len(calls) == 2:
            output.latent_dist.parameters[1, 0, 3, 3] = float("nan")
        calls.append(1)
        return output

    monkeypatch.setattr(pipe.vae, "encode", overflowing)
    with pytest.raises(ValueError) as error:
        extract(tmp_path / "store", image_files, pipe)
    assert str(error.value).startswith(f"image 5 ({tmp_path / '5.png'}): its VAE moments are not finite (NaN or inf)")
    # Shard 1 (images 4-7) is refused at its first batch: nothing of it is written.
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == complete_shards(0)


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra, data_option, plan",  # its steps, the checkpoint it resumes from, what reads, and in how many workers
    [(["--cache_features"], "--train_data_dir", (4, 2, "load", 2)),
     (["--no-cache_features"], "--train_data_dir", (4, 2, "load", 2)),
     # one worker reads a stream, in order: 12 samples skipped, then 5 more steps through the epoch boundary
     (["--streaming"], "--dataset_name", (8, 3, "_next_records", 1))],
    ids=["features", "images", "stream"],
)  # fmt: skip
def test_a_resumed_run_with_workers_equals_one_without(workspace, tmp_path, monkeypatch, extra, data_option, plan):
    steps, checkpoint, method, readers = plan
    run = ["--max_train_steps", str(steps), "--checkpointing_steps", str(checkpoint), *extra]
    train_here(workspace, tmp_path / "straight", *run, "--dataloader_num_workers", "0", data_option=data_option)
    shutil.copytree(tmp_path / "straight" / f"checkpoint-{checkpoint}", tmp_path / f"resumed/checkpoint-{checkpoint}")
    original, pids = getattr(BatchReader, method), tmp_path / "pids"

    def recording(self, *args):  # the id of each process that reads
        with open(pids, "a") as f:
            f.write(f"{os.getpid()}\n")
        return original(self, *args)

    monkeypatch.setattr(BatchReader, method, recording)
    train_here(workspace, tmp_path / "resumed", *run, "--dataloader_num_workers", "2", "--resume_from_checkpoint",
               "latest", data_option=data_option)  # fmt: skip
    assert len(set(pids.read_text().split())) == readers and str(os.getpid()) not in pids.read_text().split()
    assert_same_weights(weights(tmp_path / "resumed"), weights(tmp_path / "straight"))


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


def test_an_empty_stream_is_an_error_not_an_endless_wait():
    empty = datasets.IterableDataset.from_generator(lambda: iter(()), features=datasets.Features({"text": datasets.Value("string")}))  # fmt: skip
    with pytest.raises(ValueError, match="the stream of process 0 is empty"):
        BatchReader(empty, None, seed=0, per_step=2, streaming=True)._next_records(2)


@pytest.mark.slow
def test_float16_storage_trains_like_float32_and_a_damaged_store_stops_the_run_naming_the_shard(workspace, tmp_path):
    runs, steps = {}, ["--max_train_steps", "5", "--cache_features", "--cache_dir", str(tmp_path / "cache")]
    for dtype in ("float32", "float16"):  # a store each, built once: the third run reads the float32 one
        log = train_here(workspace, tmp_path / dtype, *steps, "--cache_text_dtype", dtype).stderr
        assert "building the feature cache" in log and "24 images ready" in log
        runs[dtype] = weights(tmp_path / dtype)
    initial = build_tiny_pipeline().transformer.state_dict()  # the workspace's "tiny" pipeline, before training
    moved = sum(float((runs["float32"][k] - initial[k]).norm() ** 2) for k in initial) ** 0.5
    apart = sum(float((runs["float16"][k] - runs["float32"][k]).norm() ** 2) for k in initial) ** 0.5
    assert 0 < apart < 0.01 * moved  # float16 text states: a trace of the change 5 steps of training make
    shards = (tmp_path / "cache" / "features").glob(f"*/{shard_name(0)}")
    [shard] = [shard for shard in shards if '"float32"' in (shard.parent / "manifest.json").read_text()]
    overwrite(shard, "caption_offsets", 0, bytes(8 * 25))  # the workspace's 24 images: 25 offsets
    with pytest.raises(SystemExit) as stopped:
        train_here(workspace, tmp_path / "damaged", *steps)
    assert str(stopped.value.code).startswith(f"error: {shard}: its SHA-256 is not the one")
    assert not (tmp_path / "damaged" / "checkpoint-1").exists()


FORMATS = ("jsonl", "csv", "parquet")


def colour(path: str) -> tuple[int, int, int]:
    """The colour of the image written at a path: a function of the path alone."""
    value = sum(ord(c) * 31**k for k, c in enumerate(path))
    return (value % 7 * 36, value // 7 % 7 * 36, value // 49 % 7 * 36)


def write_images(folder: Path, names: list[str]) -> None:
    for path in (folder / name for name in names):
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (12, 10), colour(str(path))).save(path)


def write_metadata(folder: Path, rows: list[dict], fmt: str) -> Path:
    """`folder/metadata.<fmt>` with these rows (a CSV has "" where a row has no column)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"metadata.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    elif fmt == "csv":
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(key for row in rows for key in row)))
            writer.writeheader()
            writer.writerows(rows)
    else:
        pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), path)
    return path


def write_imagefolder(folder: Path, captions: dict[str, str], fmt: str = "jsonl") -> dict[str, str]:
    write_images(folder, list(captions))
    write_metadata(folder, [{"file_name": name, "text": text} for name, text in captions.items()], fmt)
    return captions


def load(folder: Path | None, tmp_path: Path, **kwargs) -> datasets.Dataset:
    """The training split of `--train_data_dir folder`, as the trainer reads it."""
    arguments = dict(dataset_name=None, dataset_config_name=None, train_data_dir=folder and str(folder), seed=0,
                     image_column="image", caption_column="text", max_train_samples=None, streaming=False,
                     cache_dir=str(tmp_path / "cache"))  # fmt: skip
    return load_training_data(**{**arguments, **kwargs})


def refusal(folder: Path | None, tmp_path: Path, **kwargs) -> str:
    with pytest.raises(ValueError) as error:
        load(folder, tmp_path, **kwargs)
    return str(error.value)


def captions_by_file(dataset: datasets.Dataset, folder: Path) -> dict[str, str]:
    """Each row's image file (relative to `folder`) and caption, after checking that its pixels are that file's."""
    found, paths = {}, dataset.cast_column("image", datasets.Image(decode=False))["image"]
    for row, path in zip(dataset, paths):
        name = Path(path["path"]).relative_to(folder).as_posix()
        assert np.abs(np.asarray(row["image"], dtype=int)[5, 6] - colour(path["path"])).max() <= 3, name
        assert name not in found, f"{name} is read twice"
        found[name] = row["text"]
    return found


NAMES = {  # datasets alone takes a train split from the names COCO_train2014_… and drops the metadata and captions
    "coco": [f"COCO_train2014_{i:012d}.jpg" for i in (9, 25, 30, 34)],
    # also under folders whose names are split names, when the metadata above them list them
    "subfolders": ["sub/a.png", "sub/deeper/b.png", "train2014/COCO_train2014_1.png", "val2014/COCO_val2014_2.png"],
    "split-words": ["plain-4.png", *(name.format(word) for word in ("test", "val", "dev", "train")
                                     for name in ("{}_0001.png", "img-{}-2.png", "{}.3.png"))],
}  # fmt: skip


@pytest.mark.parametrize("names, fmt", [(names, fmt) for names in NAMES for fmt in FORMATS][:-2])
def test_images_are_read_with_their_captions_whatever_their_names(tmp_path, names, fmt):
    captions = write_imagefolder(tmp_path / "data", {name: f"caption of {name}" for name in NAMES[names]}, fmt)
    assert captions_by_file(load(tmp_path / "data", tmp_path), tmp_path / "data") == captions


def test_train_and_test_folders_train_on_the_train_folder_alone(tmp_path):
    data = tmp_path / "data"
    train = write_imagefolder(data / "train", {f"COCO_train2014_{i}.jpg": f"train caption {i}" for i in range(3)})
    write_imagefolder(data / "test", {f"COCO_train2014_{i}.jpg": f"test caption {i}" for i in range(2)})
    with open(data / "test" / "metadata.jsonl", "a") as f:  # the test split's problems are not the training's
        f.write(json.dumps({"file_name": "gone.jpg", "text": ""}) + "\n")
    assert captions_by_file(load(data, tmp_path), data) == {f"train/{name}": text for name, text in train.items()}


def test_a_local_imagefolder_given_as_dataset_name_points_to_train_data_dir(tmp_path):
    # --dataset_name is read by datasets as it is, split by file names: the message says which flag reads it right.
    write_imagefolder(tmp_path / "data", {"COCO_train2014_1.jpg": "a dog", "COCO_train2014_2.jpg": "a cat"})
    message = "its columns are ['image'] (a local imagefolder: --train_data_dir reads its captions whatever its"
    assert message in refusal(None, tmp_path, dataset_name=str(tmp_path / "data"))


def saved_dataset(tmp_path: Path, as_dict: bool, split: str = "train") -> tuple[Path, datasets.Dataset]:
    """An imagefolder read by `datasets`, then written by `save_to_disk`: a `Dataset`, or a `DatasetDict`."""
    write_imagefolder(tmp_path / "data", {f"{i}.png": f"caption {i}" for i in range(6)})
    original = load(tmp_path / "data", tmp_path)
    saved = datasets.DatasetDict({split: original}) if as_dict else original
    saved.save_to_disk(str(tmp_path / "saved"))
    return tmp_path / "saved", original


@pytest.mark.parametrize("as_dict", [False, True], ids=["Dataset", "DatasetDict"])
def test_a_folder_written_by_save_to_disk_is_read_as_it_was_saved(tmp_path, as_dict):
    folder, original = saved_dataset(tmp_path, as_dict)  # which datasets' load_dataset refuses
    dataset = load(None, tmp_path, dataset_name=str(folder))
    assert list(dataset["text"]) == list(original["text"])
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(dataset["image"], original["image"]))
    # The same fingerprint at every load: the feature store is found again by the next run.
    assert load(None, tmp_path, dataset_name=str(folder))._fingerprint == dataset._fingerprint
    streamed = load(None, tmp_path, dataset_name=str(folder), streaming=True, max_train_samples=4)
    assert isinstance(streamed, datasets.IterableDataset)
    assert [row["text"] for row in streamed] == list(original["text"])[:4]


def test_a_saved_dataset_without_a_train_split_or_with_a_config_name_is_refused(tmp_path):
    folder, _ = saved_dataset(tmp_path, as_dict=True, split="validation")
    message = f"--dataset_name {folder} has the splits ['validation'] and no 'train' split, which is what the trainer"
    assert message in refusal(None, tmp_path, dataset_name=str(folder))
    message = refusal(None, tmp_path, dataset_name=str(folder), dataset_config_name="default")
    assert re.search(r"written by save_to_disk, .* drop --dataset_config_name default", message), message


# A parquet file was once not checked at all, and pandas reads "null", "NA" … of a CSV file as missing values.
BAD_ROWS = [
    ("parquet", {"text": None}, "a caption must be a non-empty string or a non-empty list of them, got None"),
    ("parquet", {"text": ""}, "got ''"), ("parquet", {"text": ["a dog", " "]}, "got ['a dog', ' ']"),
    ("parquet", {"text": []}, "got []"),
    ("csv", {"text": "null"}, "its caption 'null' reads as a missing value (datasets reads metadata.csv with pandas)"),
    ("csv", {"text": "NA"}, "its caption 'NA' reads as a missing value"),
    ("jsonl", {"file_name": None}, "it has no file_name (the image's path relative to the metadata file)"),
    ("jsonl", {"file_name": "../0.png"}, "its file_name must be a path inside"),
    *((fmt, {"file_name": "sub/gone.png"}, "its image {data}/sub/gone.png is missing") for fmt in FORMATS)
]  # fmt: skip


@pytest.mark.parametrize("fmt, change, problem", BAD_ROWS)
def test_a_bad_metadata_row_is_refused_by_file_and_row_before_any_read(tmp_path, fmt, change, problem, monkeypatch):
    write_images(tmp_path / "data", ["0.png", "1.png", "2.png"])
    (tmp_path / "0.png").write_bytes((tmp_path / "data" / "0.png").read_bytes())  # ../0.png exists
    rows = [{"file_name": f"{i}.png", "text": f"caption {i}"} for i in range(3)]
    if isinstance(change.get("text"), list):  # a list column: every row holds a list
        rows = [{**row, "text": [row["text"]]} for row in rows]
    rows[2] = {key: value for key, value in {**rows[2], **change}.items() if value is not None or key == "text"}
    metadata = write_metadata(tmp_path / "data", rows, fmt)
    monkeypatch.setattr(Image, "open", lambda *args, **kwargs: pytest.fail("an image was decoded"))
    message = refusal(tmp_path / "data", tmp_path)
    where = {"jsonl": "line 3", "csv": "line 4", "parquet": "row 2"}[fmt]  # the third row
    assert message.startswith(f"{metadata} {where} (file_name {rows[2].get('file_name')!r}): ")
    assert problem.format(data=tmp_path / "data") in message
    assert message.endswith(". Every row needs a caption and its image: fix or remove it.")
    assert not (tmp_path / "cache").exists()  # refused before datasets prepares anything


ROWS = [{"file_name": "0.png", "text": "a red circle"}, {"file_name": "1.png", "text": "a blue square"}]
REFUSED = {  # the folder's images, its other files (metadata rows, or bytes), and the distinctive words of the refusal
    "missing": ([], {}, "--train_data_dir {data} is not a folder"),
    "no-metadata": (["cats/1.png", "dogs/3.png"], {"metadata.json": b"{}"},
                    "(metadata.json is not one datasets reads), so its images have no captions: add a metadata.jsonl"),
    "split-folders": (["train/0.png", "test/1.png"], {"test/metadata.jsonl": ROWS[1:]}, "split into folders, and its "
                      "training split has no metadata file (e.g. {data}/test/metadata.jsonl is another split's): put"),
    "two-formats": (["0.png"], {"metadata.jsonl": ROWS[:1], "sub/metadata.csv": ROWS[1:]}, "files mix formats"),
    "no-rows": (["0.png"], {"metadata.jsonl": b"\n"}, "{data}/metadata.jsonl has no rows"),
    "numbers": (["0.png"], {"metadata.csv": [{"file_name": "0.png", "text": 1}]}, "not text: name the caption column"),
    "empty-image": (["0.png", "1.png"], {"metadata.jsonl": ROWS, "1.png": b""}, "its image {data}/1.png cannot"),
    "garbage-image": (["0.png"], {"metadata.jsonl": ROWS[:1], "0.png": b"garbage"}, "its image {data}/0.png cannot"),
    # Captions that mix strings and lists, in one file or across files, which datasets would fail on deep in Arrow
    "mixed": (["0.png", "1.png"], {"metadata.jsonl": [ROWS[0], {**ROWS[1], "text": ["a blue square"]}]},
              "metadata.jsonl line 2 (file_name '1.png'): its caption is a list of captions, where {data}/"
              "metadata.jsonl line 1's is a string: write every caption as a list or every one as a string"),
    "mixed-files": (["0.png", "sub/1.png"], {"metadata.jsonl": [{**ROWS[0], "text": ["a red circle"]}],
                    "sub/metadata.jsonl": ROWS[1:]}, "its caption is a string, where "),
    **{f"caption-column-{fmt}": (["0.png"], {f"metadata.{fmt}": [{"file_name": "0.png", "caption": "a red circle"}]},
       f"{{data}}/metadata.{fmt} has no such field; its rows have 'caption': pass --caption_column caption")
       for fmt in FORMATS},
}  # fmt: skip


@pytest.mark.parametrize("images, files, message", REFUSED.values(), ids=REFUSED)
def test_a_folder_that_cannot_train_is_refused_with_the_fix(tmp_path, images, files, message):
    write_images(tmp_path / "data", images)
    for name, content in files.items():
        if isinstance(content, bytes):
            (tmp_path / "data" / name).write_bytes(content)
        else:
            write_metadata((tmp_path / "data" / name).parent, content, name.rsplit(".", 1)[1])
    assert message.replace("{data}", str(tmp_path / "data")) in refusal(tmp_path / "data", tmp_path)


def test_a_coco_folder_is_read_as_one_row_per_image_with_all_its_captions_unless_another_layout_is_asked(tmp_path):
    coco = write_coco2014(tmp_path / "coco2014", num_train=8, num_val=2, seed=1)
    annotations = json.loads((coco / "annotations" / "captions_train2014.json").read_text())
    dataset = load(coco, tmp_path, data_layout="auto")
    assert dataset.column_names == ["image", "text", "image_id"]  # the captions, not the folder names as labels
    assert dataset["image_id"] == sorted(image["id"] for image in annotations["images"])
    for row, image in zip(dataset, sorted(annotations["images"], key=lambda image: image["id"])):
        assert row["text"] == [a["caption"] for a in annotations["annotations"] if a["image_id"] == row["image_id"]]
        assert row["image"].size == (image["width"], image["height"])
    assert {len(captions) for captions in dataset["text"]} > {5}  # some images have 6 or 7, as in COCO
    assert len(load(coco, tmp_path, data_layout="coco2014")) == 8 and len(load_coco2014(coco, "val2014")) == 2
    assert f"{coco} has no metadata file" in refusal(coco, tmp_path, data_layout="imagefolder")  # as asked
    assert "unknown data layout 'coco'; choose one of" in refusal(coco, tmp_path, data_layout="coco")
    (missing := coco / "annotations" / "captions_train2014.json").unlink()  # partly unpacked: still COCO
    assert f"{coco} is not a COCO-2014 folder: {missing} is missing" in refusal(coco, tmp_path)


def test_a_saved_dataset_with_a_missing_caption_deep_inside_is_refused_at_start_up(tmp_path):
    rows = {"image": [Image.new("RGB", (8, 8), (i, 0, 0)) for i in range(96)], "text": [f"c {i}" for i in range(96)]}
    rows["text"][77] = None
    datasets.Dataset.from_dict(rows).cast_column("image", datasets.Image()).save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(ValueError, match=r"^row 77 of the training data: a caption must be .* got None; fix"):
        load(None, tmp_path, dataset_name=str(tmp_path / "saved"))


@pytest.mark.parametrize(
    "kind, field", [("images", "file_name"), ("images", "id"), ("annotations", "caption"), ("", 3)]
)
def test_a_coco_entry_without_a_field_or_its_image_is_refused_naming_it(tmp_path, kind, field):
    coco = write_coco2014(tmp_path / "coco2014", num_train=4, num_val=1)
    annotations = coco / "annotations" / "captions_train2014.json"
    content = json.loads(annotations.read_text())
    if kind:
        del content[kind][1][field]
        message = rf"_train2014\.json: {kind}\[1\] is .*: each entry needs .*'{field}'"
    else:  # a listed image that the folder lacks
        (victim := sorted((coco / "train2014").iterdir())[field]).unlink()
        message = re.escape(f"lists 1 image(s) that {victim.parent} lacks, e.g. {victim}")
    annotations.write_text(json.dumps(content))
    with pytest.raises(ValueError, match=message):
        load(coco, tmp_path)
