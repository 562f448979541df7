"""The Space under load over loopback: concurrent requests, a full queue, uploads refused, eager without inductor."""

import threading
import time
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
import torch
from gradio_client import Client
from gradio_client.utils import QueueError, Status
from PIL import Image
from space_server import image_std, load_app, one_cpu_thread, serve, shapes_pipeline


PROMPT = "a large red circle at the center"
NUM_REQUESTS = 8
TIMEOUT_S = 120  # for any one request or wait


def request_args(seed: int) -> tuple:
    return (PROMPT, "", seed, False, 3, 2.0, 1)  # (prompt, negative, seed, randomize, steps, guidance, images)


@pytest.mark.slow
@pytest.mark.parametrize("frozen", [False, True], ids=["eager", "frozen"])
def test_concurrent_requests_all_complete_with_their_own_images(request, frozen):
    # Frozen, as the app serves on a CPU: requests run side by side in the one frozen graph they share.
    app, pipe = load_app(), request.getfixturevalue("frozen_app").pipe if frozen else shapes_pipeline()
    generate = app.make_generate_fn(pipe)  # what each seed must give, one at a time in-process
    expected = {seed: np.asarray(generate(*request_args(seed))[0][0]) for seed in range(NUM_REQUESTS)}
    with serve(app.build_demo(pipe, queue_size=32, concurrency=4)) as url:
        client = Client(url, verbose=False)
        jobs = {seed: client.submit(*request_args(seed), api_name="/generate") for seed in range(NUM_REQUESTS)}
        results = {seed: job.result(timeout=TIMEOUT_S) for seed, job in jobs.items()}
    for seed, (gallery, used_seed) in results.items():
        image = Image.open(gallery[0]["image"])
        assert used_seed == seed and len(gallery) == 1 and image.size == (32, 32) and image_std(image) > 8
        # Requests run side by side on one model; each still gets exactly the image of its own seed.
        assert np.array_equal(np.asarray(image.convert("RGB")), expected[seed]), f"seed {seed} came back wrong"


def test_every_request_samples_with_its_own_tokenizer(shapes_pipe, monkeypatch):
    # A fast tokenizer sets its padding state on every call: one shared between threads mixes concurrent settings.
    app, seen = load_app(), []

    def record(self, *args, **kwargs):
        seen.append(self.tokenizer)
        return SimpleNamespace(images=[Image.new("RGB", (32, 32))])

    monkeypatch.setattr(type(shapes_pipe), "__call__", record)
    for seed in range(2):
        app.make_generate_fn(shapes_pipe)(*request_args(seed))
    assert len(seen) == 2 and all(t is not shapes_pipe.tokenizer for t in seen) and seen[0] is not seen[1]
    assert seen[0](PROMPT).input_ids == shapes_pipe.tokenizer(PROMPT).input_ids  # a copy: the same tokens


@pytest.mark.slow
def test_full_queue_refuses_the_extra_request_then_serves_again_but_no_upload(shapes_pipe):
    demo = load_app().build_demo(shapes_pipe, queue_size=2, concurrency=1)
    # Test-only slow-down: the first request holds the one worker inside the model until the gate opens.
    started, gate = threading.Event(), threading.Event()

    def hold(module, args):
        started.set()
        gate.wait(TIMEOUT_S)

    hook = shapes_pipe.transformer.register_forward_pre_hook(hold)
    try:
        with serve(demo) as url:
            client = Client(url, verbose=False)
            running = client.submit(*request_args(1), api_name="/generate")
            assert started.wait(TIMEOUT_S), "the first request never started"
            waiting = [client.submit(*request_args(seed), api_name="/generate") for seed in (2, 3)]
            deadline = time.monotonic() + TIMEOUT_S
            while not all(job.status().code == Status.IN_QUEUE for job in waiting):
                assert time.monotonic() < deadline, "the queue never filled"
                time.sleep(0.05)
            with pytest.raises(QueueError, match="Queue is full"):
                client.submit(*request_args(4), api_name="/generate").result(timeout=TIMEOUT_S)
            # What the server itself answers: HTTP 503 with the queue's size.
            fn_index = next(index for index, fn in demo.fns.items() if fn.api_name == "generate")
            join = {"data": list(request_args(5)), "fn_index": fn_index, "session_hash": "load-test"}
            refused = httpx.post(f"{url}gradio_api/queue/join", json=join, timeout=TIMEOUT_S)
            assert refused.status_code == 503, refused.text
            assert refused.json()["detail"] == "Queue is full. Max size is 2 and size is 2."
            gate.set()
            for seed, job in zip((1, 2, 3), [running, *waiting]):
                gallery, used_seed = job.result(timeout=TIMEOUT_S)
                assert used_seed == seed and Image.open(gallery[0]["image"]).size == (32, 32)
            hook.remove()
            # The app takes no files, so anyone's upload to the server's disk is refused: HTTP 413 for 100 kB.
            upload = httpx.post(f"{url}gradio_api/upload", files={"files": ("x.bin", b"x" * 10**5)}, timeout=TIMEOUT_S)
            assert (upload.status_code, upload.text) == (413, "File size exceeded maximum allowed size of 1024 bytes.")
            gallery, used_seed = client.predict(*request_args(6), api_name="/generate")
            assert used_seed == 6 and image_std(Image.open(gallery[0]["image"])) > 8
    finally:
        gate.set()
        hook.remove()


# Last: a new freeze resets dynamo, and the frozen graph the tests above share would compile again.
@pytest.mark.slow
def test_the_app_samples_eagerly_where_inductor_cannot_compile(monkeypatch):
    pipe = shapes_pipeline()

    def no_compiler(graph, example_inputs):  # what freezing compiles with
        raise RuntimeError("Failed to find a working C++ compiler.")

    monkeypatch.setattr("torch._inductor.compile_fx.compile_fx", no_compiler)
    try:
        line = load_app().serve_frozen(pipe)
    finally:
        torch._dynamo.reset()
    assert line == (
        "Sampling eagerly: inductor could not freeze the transformer here (RuntimeError: Failed to find a working "
        "C++ compiler.)."
    )
    assert not pipe.inductor_freezing_enabled
    with one_cpu_thread():
        assert image_std(load_app().make_generate_fn(pipe)(*request_args(0))[0][0]) > 8
