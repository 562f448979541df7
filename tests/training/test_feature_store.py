"""The on-disk feature store (`diffusers_lmlp.training.features`) and the training script's data-loading workers."""

import errno
import hashlib
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
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
from test_train_text_to_image import ENV, assert_same_weights, train_here, weights

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
from diffusers_lmlp.training.features import FORMAT, ShardWriter, checksums_path, shard_name, write_manifest


def write_store(
    folder: Path, moments: torch.Tensor, text_states: torch.Tensor, counts: list[int], shard_size: int = 1024
) -> FeatureStore:
    """A store of moments (N, 2C, h, w) and float32 text states (M, T, D), `counts[i]` captions of image i."""
    folder.mkdir(parents=True, exist_ok=True)
    offsets = torch.tensor([0, *counts]).cumsum(0)  # (N + 1,)
    for shard, start in enumerate(range(0, len(counts), shard_size)):
        stop = min(start + shard_size, len(counts))
        rows = slice(int(offsets[start]), int(offsets[stop]))
        writer = ShardWriter(
            folder / shard_name(shard),
            {
                "moments": (torch.float32, (stop - start, *moments.shape[1:])),
                "caption_offsets": (torch.int64, (stop - start + 1,)),
                "text_states": (torch.float32, (rows.stop - rows.start, *text_states.shape[1:])),
            },
        )
        writer.write("moments", 0, moments[start:stop])
        writer.write("caption_offsets", 0, offsets[start : stop + 1] - offsets[start])
        writer.write("text_states", 0, text_states[rows])
        writer.commit()
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


def checksums_name(shard: str) -> str:
    return checksums_path(Path(shard)).name


def counting_vae_calls(pipe, monkeypatch) -> list[int]:
    """The batch size of each later call of `pipe`'s VAE encoder."""
    calls, encode = [], pipe.vae.encode
    monkeypatch.setattr(pipe.vae, "encode", lambda pixels: calls.append(len(pixels)) or encode(pixels))
    return calls


def without_checksums(manifest: dict) -> dict:
    return {**manifest, "shards": [{k: v for k, v in shard.items() if k != "sha256"} for shard in manifest["shards"]]}


def file_parts(file: Path) -> dict[str, bytes]:
    """A safetensors file cut by its header into its parts: the header (with its length), then each tensor's."""
    raw = file.read_bytes()
    start = 8 + int.from_bytes(raw[:8], "little")
    parts = {"header": raw[:start]}
    for name, entry in sorted(json.loads(raw[8:start]).items(), key=lambda item: item[1]["data_offsets"][0]):
        parts[name] = raw[start + entry["data_offsets"][0] : start + entry["data_offsets"][1]]
    return parts


@pytest.fixture(scope="module")
def straight(tmp_path_factory, dataset, pipe) -> Path:
    """A store extracted in one go by one process: the reference of the others."""
    path = tmp_path_factory.mktemp("straight") / "store"
    extract(path, dataset, pipe)
    return path


def test_shards_are_safetensors_files_of_each_images_moments_and_caption_states(straight, dataset, pipe):
    shards = [shard_name(s) for s in range(3)]
    assert sorted(store_files(straight)) == sorted(["manifest.json", *shards, *map(checksums_name, shards)])
    counts = [len(captions) for captions in dataset["text"]]
    pixels = torch.stack([preprocess_image(image, 16, False) for image in dataset["image"]])  # (10, 3, 16, 16)
    with torch.no_grad():
        moments = pipe.vae.encode(pixels).latent_dist.parameters  # (10, 8, 8, 8)
    states = encode_text(pipe.tokenizer, pipe.text_encoder, sum(dataset["text"], []))  # (19, 16, 32)
    manifest = json.loads((straight / "manifest.json").read_text())
    assert (manifest["num_images"], manifest["num_captions"], manifest["text_dtype"]) == (10, 19, "float32")
    for shard, record, start in zip(shards, manifest["shards"], range(0, 10, 4)):
        tensors = load_file(straight / shard)  # the safetensors library reads what was written in place
        n, first = min(4, 10 - start), sum(counts[:start])
        offsets = torch.tensor([0, *counts[start : start + n]]).cumsum(0)
        assert tensors["caption_offsets"].tolist() == offsets.tolist()
        torch.testing.assert_close(tensors["moments"], moments[start : start + n], rtol=0, atol=1e-5)
        torch.testing.assert_close(tensors["text_states"], states[first : first + int(offsets[-1])], rtol=0, atol=1e-5)
        parts = file_parts(straight / shard)  # the size and each part's SHA-256, next to the shard and in the manifest
        assert b"".join(parts.values()) == (straight / shard).read_bytes()
        expected = {"bytes": len(b"".join(parts.values())),
                    "sha256": {name: hashlib.sha256(part).hexdigest() for name, part in parts.items()}}  # fmt: skip
        assert json.loads((straight / checksums_name(shard)).read_text()) == expected
        assert record == {"file": shard, "num_images": n, "num_captions": int(offsets[-1]), **expected}
    got_moments, got_states = FeatureStore(straight).read([9, 4, 5], torch.tensor([0.99, 0.0, 0.5]))
    torch.testing.assert_close(got_moments, moments[[9, 4, 5]], rtol=0, atol=1e-5)
    # image 9: last of its 1 caption; image 4: first of 2; image 5: caption ⌊0.5 · 3⌋ = 1 of 3
    rows = [sum(counts[:9]), sum(counts[:4]), sum(counts[:5]) + 1]
    torch.testing.assert_close(got_states, states[rows], rtol=0, atol=1e-5)


def test_a_batch_reads_only_its_own_rows(straight, monkeypatch):
    store = FeatureStore(straight)
    read = []
    preadv = os.preadv

    def counting_preadv(fd, buffers, offset):
        read.append(sum(memoryview(b).nbytes for b in buffers))
        return preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", counting_preadv)
    picks = torch.tensor([0.2, 0.7, 0.9])
    moments, states = store.read([1, 8, 6], picks)  # shards 0, 2 and 1 of 4, 2 and 4 images
    image = [moments[0].numel() * 4, states[0].numel() * 4]  # its moments, then one text state
    # Each shard's caption offsets are read once while it is open.
    assert read == [(4 + 1) * 8, *image, (2 + 1) * 8, *image, (4 + 1) * 8, *image]
    read.clear()
    again, _ = store.read([6, 1, 8], picks)  # the same shards: their images' rows only
    assert read == 3 * image
    torch.testing.assert_close(again, moments[[2, 0, 1]], rtol=0, atol=0)


@pytest.mark.slow
def test_a_killed_extraction_resumes_at_its_first_incomplete_shard(tmp_path, straight, dataset, pipe, monkeypatch):
    dataset.save_to_disk(tmp_path / "data")
    pipe.save_pretrained(tmp_path / "pipe")
    path = tmp_path / "store"
    # SIGKILL in the 4th VAE call: shard 0 (calls 1, 2) is complete, shard 1 (calls 3, 4) is half written.
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_EXTRACTION, str(tmp_path), "4"], env=ENV, capture_output=True, text=True
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert sorted(p.name for p in path.iterdir()) == [
        shard_name(0), checksums_name(shard_name(0)), shard_name(1) + ".tmp"
    ]  # fmt: skip

    calls = counting_vae_calls(pipe, monkeypatch)
    extract(path, dataset, pipe)
    assert calls == [2, 2, 2]  # shard 1 (images 4-7) and shard 2 (images 8, 9): shard 0 is not extracted again
    assert sorted(store_files(path)) == sorted(store_files(straight))
    # The same manifest but for shard 0's checksums: its bytes may differ by rounding (the killed process's threads).
    manifests = [without_checksums(json.loads((p / "manifest.json").read_text())) for p in (path, straight)]
    assert manifests[0] == manifests[1]
    FeatureStore(path)
    for shard in range(3):
        got, expected = load_file(path / shard_name(shard)), load_file(straight / shard_name(shard))
        assert got.keys() == expected.keys()
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-6, msg=name)


# Extract the store of tmp/data with tmp/pipe's components into tmp/store, SIGKILLed in VAE call number argv[2].
KILLED_EXTRACTION = """
import os, signal, sys
from pathlib import Path
import datasets
from diffusers_lmlp import LMLPPipeline
from diffusers_lmlp.training import extract_features

tmp, kill_at = Path(sys.argv[1]), int(sys.argv[2])
pipe = LMLPPipeline.from_pretrained(tmp / "pipe")
encode, calls = pipe.vae.encode, []
die = lambda: os.kill(os.getpid(), signal.SIGKILL)
pipe.vae.encode = lambda pixels: calls.append(1) or (len(calls) == kill_at and die()) or encode(pixels)
extract_features(
    tmp / "store", datasets.load_from_disk(tmp / "data"), image_column="image", caption_column="text",
    resolution=16, tokenizer=pipe.tokenizer, text_encoder=pipe.text_encoder, vae=pipe.vae, shard_size=4, batch_size=2,
)
"""


def test_each_process_writes_its_own_shards_and_the_main_process_the_manifest(tmp_path, straight, dataset, pipe):
    path, barriers = tmp_path / "store", []
    extract(path, dataset, pipe, process_index=1, num_processes=2, wait_for_everyone=lambda: barriers.append(1))
    assert sorted(p.name for p in path.iterdir()) == [shard_name(1), checksums_name(shard_name(1))]  # no manifest
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


def test_a_store_without_its_manifest_or_a_shards_checksums_is_refused_with_the_fix(tmp_path, straight):
    store = copy_store(straight, tmp_path)
    (store / "manifest.json").unlink()
    with pytest.raises(FileNotFoundError, match="manifest.json is missing.*a file system that every process sees"):
        FeatureStore(store)
    sidecar = store / checksums_name(shard_name(2))  # a checksums file that checks nothing
    sidecar.write_text(json.dumps({**json.loads(sidecar.read_text()), "sha256": {}}))
    with pytest.raises(
        ValueError, match=re.escape(f"{sidecar} is not a shard's checksums file (its 'sha256' is {{}}")
    ):
        write_manifest(store, num_images=10, shard_size=4, text_dtype="float32")
    (store / shard_name(1)).unlink()
    with pytest.raises(FileNotFoundError, match=f"{shard_name(1)} is missing after the extraction.*--cache_dir"):
        write_manifest(store, num_images=10, shard_size=4, text_dtype="float32")
    assert not (store / "manifest.json").exists()


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


def copy_store(straight: Path, tmp_path: Path) -> Path:
    shutil.copytree(straight, tmp_path / "store")
    return tmp_path / "store"


def overwrite(file: Path, part: str, at: int, data: bytes) -> None:
    """Overwrite bytes of a part of a shard in place, `at` bytes into it."""
    parts = file_parts(file)
    start = sum(len(content) for content in list(parts.values())[: list(parts).index(part)])
    size = file.stat().st_size
    with open(file, "r+b") as f:
        f.seek(start + at)
        f.write(data)
    assert file.stat().st_size == size


def flip(file: Path, part: str, at: int) -> None:
    overwrite(file, part, at, bytes([file_parts(file)[part][at] ^ 0x10]))


@pytest.mark.parametrize(
    "shard, damage, problem",
    [  # zeroed caption offsets used to train with exit code 0, every image paired with one caption
        (1, lambda f: overwrite(f, "caption_offsets", 0, bytes(8 * 5)),
         " has caption offsets [0, 0, 0, 0, 0], which do not rise"),
        # shard 0's offsets 0 1 3 6 7 as 0 2 3 6 7: well-formed, and wrong
        (0, lambda f: overwrite(f, "caption_offsets", 8, (2).to_bytes(8, "little")),
         ": the SHA-256 of its 'caption_offsets' bytes"),
        (2, lambda f: flip(f, "text_states", 1000),
         ": the SHA-256 of its 'text_states' bytes is not the one its extraction recorded in"),
        (1, lambda f: overwrite(f, "moments", 4, b"\x00\x00\x80\x7f"), ": the SHA-256 of its 'moments' bytes"),  # inf
        (1, lambda f: os.truncate(f, f.stat().st_size - 100),
         " is {cut} bytes where its extraction wrote {size}: it was cut short or changed"),
    ],
    ids=["zeroed-offsets", "moved-offsets", "flipped-byte", "inf", "truncated"],
)  # fmt: skip
def test_a_damaged_shard_is_refused_and_the_advice_re_extracts_only_it(
    tmp_path, straight, dataset, pipe, monkeypatch, shard, damage, problem
):
    store = copy_store(straight, tmp_path)
    size = (store / shard_name(shard)).stat().st_size
    damage(store / shard_name(shard))
    with pytest.raises(ValueError) as error:
        FeatureStore(store)
    assert str(error.value).startswith(
        f"{store / shard_name(shard)}{problem.format(cut=f'{size - 100:,}', size=f'{size:,}')}"
    )
    [(file, manifest)] = re.findall(
        r"Delete (\S+) and (\S+): the next run extracts that shard again", str(error.value)
    )
    assert (file, manifest) == (str(store / shard_name(shard)), str(store / "manifest.json"))
    Path(file).unlink()
    Path(manifest).unlink()
    calls = counting_vae_calls(pipe, monkeypatch)
    repaired = open_feature_store(store, dataset, **arguments(pipe))
    assert calls == [2] * (2 if shard < 2 else 1)  # that shard's images alone
    assert store_files(store) == store_files(straight)
    picks = torch.rand(10, generator=torch.Generator().manual_seed(0))
    for got, expected in zip(
        repaired.read(list(range(10)), picks), FeatureStore(straight).read(list(range(10)), picks)
    ):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def edit_shard_1(manifest: dict, **fields) -> dict:
    manifest["shards"][1].update(fields)
    return manifest


@pytest.mark.parametrize(
    "edit, problem",
    [
        (lambda m: edit_shard_1(m, sha256={}), "shard 1: its 'sha256' is {}, not the checksums of the parts"),
        (lambda m: edit_shard_1(m, sha256={k: v for k, v in m["shards"][1]["sha256"].items() if k != "moments"}),
         "shard 1: its 'sha256' is {'header'"),
        (lambda m: edit_shard_1(m, sha256=None), "shard 1: its 'sha256' is None, not"),
        (lambda m: edit_shard_1(m, sha256=dict.fromkeys(m["shards"][1]["sha256"], "0")), "not a SHA-256 hex digest"),
        (lambda m: {**m, "text_dtype": "int8"}, "'text_dtype' missing or of the wrong type"),
        (lambda m: {**m, "num_images": "10"}, "'num_images' missing or of the wrong type"),
    ],
    ids=["empty", "no-moments", "null", "not-hex", "int8", "string-count"],
)  # fmt: skip
def test_a_manifest_whose_checksums_or_fields_are_wrong_is_refused_with_a_flipped_byte_or_not(
    tmp_path, straight, edit, problem
):
    store = copy_store(straight, tmp_path)
    flip(store / shard_name(1), "moments", 100)
    manifest = store / "manifest.json"
    manifest.write_text(json.dumps(edit(json.loads(manifest.read_text()))))
    with pytest.raises(ValueError) as error:
        FeatureStore(store)
    assert str(error.value).startswith(f"{manifest} is not a valid '{FORMAT}' manifest (")
    assert problem in str(error.value)


def test_a_store_of_the_previous_format_is_not_read_and_its_size_is_reported(
    tmp_path, straight, dataset, pipe, caplog
):
    old = copy_store(straight, tmp_path / "features")  # as a v1 store: the same shards, a manifest without checksums
    manifest = without_checksums(json.loads((old / "manifest.json").read_text()))
    (old / "manifest.json").write_text(json.dumps({**manifest, "format": "diffusers-lmlp feature store v1"}))
    with pytest.raises(ValueError, match=f"is not a '{FORMAT}' manifest: delete {re.escape(str(old))} to extract"):
        FeatureStore(old)
    size = sum(file.stat().st_size for file in old.iterdir())
    with caplog.at_level("WARNING"):  # a new store is made next to it
        open_feature_store(tmp_path / "features" / "new", dataset.select(range(2)), **arguments(pipe))
    assert [r.message for r in caplog.records if r.levelname == "WARNING"] == [
        f"{old} is a feature store of another format ('diffusers-lmlp feature store v1', not '{FORMAT}'), which this "
        f"version does not read: delete it to free {size / 1e9:.2f} GB"
    ]


def test_checksums_are_checked_once_per_run_shared_among_its_processes(tmp_path, straight, dataset, pipe, monkeypatch):
    store_path, events = copy_store(straight, tmp_path), []
    digests = features.shard_digests

    def counting_digests(path):
        events.append(path.name)
        return digests(path)

    monkeypatch.setattr(features, "shard_digests", counting_digests)
    stores = [
        open_feature_store(store_path, dataset, process_index=rank, num_processes=2,
                           wait_for_everyone=lambda: events.append("wait"), **arguments(pipe))
        for rank in (0, 1)
    ]  # fmt: skip
    # Rank 0 hashes shards 0 and 2, rank 1 shard 1, each before the barrier that precedes any read.
    assert events[:5] == ["wait", "wait", shard_name(0), shard_name(2), "wait"] or events[:5] == [
        "wait", "wait", shard_name(2), shard_name(0), "wait"
    ]  # fmt: skip
    assert events[5:] == ["wait", "wait", shard_name(1), "wait"]
    del events[:]
    for store in [*stores, *(pickle.loads(pickle.dumps(store)) for store in stores)]:  # as DataLoader workers get it
        store.read(list(range(10)), torch.rand(10))
    assert events == []  # reading never hashes again


@pytest.fixture
def image_files(tmp_path, dataset) -> datasets.Dataset:
    """The `dataset` fixture with its images read from PNG files."""
    paths = []
    for i, image in enumerate(dataset["image"]):
        paths.append(str(tmp_path / f"{i}.png"))
        image.save(paths[-1])
    return datasets.Dataset.from_dict({"image": paths, "text": dataset["text"]}).cast_column("image", datasets.Image())


def test_a_nan_moment_is_refused_at_extraction_naming_the_image_file(tmp_path, image_files, pipe, monkeypatch):
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
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == [shard_name(0), checksums_name(shard_name(0))]


def test_a_shard_is_written_in_row_order_and_whole_or_not_at_all(tmp_path):
    writer = ShardWriter(
        tmp_path / shard_name(0), {"moments": (torch.float32, (4, 2)), "caption_offsets": (torch.int64, (5,))}
    )
    writer.write("moments", 0, torch.ones(2, 2))
    with pytest.raises(ValueError, match="moments: rows are written in order, from 0: row 2 is next, not 3"):
        writer.write("moments", 3, torch.ones(1, 2))
    writer.write("moments", 2, torch.ones(2, 2))
    with pytest.raises(ValueError, match="caption_offsets has 0 of its 5 rows written"):
        writer.commit()  # unwritten rows would read as zeros
    assert sorted(p.name for p in tmp_path.iterdir()) == [shard_name(0) + ".tmp"]


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
    def nothing():
        yield from ()

    empty = datasets.IterableDataset.from_generator(
        nothing, features=datasets.Features({"text": datasets.Value("string")})
    )
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
    assert str(stopped.value.code).startswith(f"error: {shard} has caption offsets [0, 0, 0, 0, …, 0, 0], which")
    assert not (tmp_path / "second" / "checkpoint-1").exists()
