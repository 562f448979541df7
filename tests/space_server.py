"""Helpers for the Space tests: import the demo's `app.py` (`spaces/lmlp-demo/`) and serve it on 127.0.0.1."""

import importlib.util
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from functools import cache, partial
from pathlib import Path

import httpx
import numpy as np
import torch
from PIL import Image

from diffusers_lmlp.emoji import pretrained_emoji_pipeline
from diffusers_lmlp.hub.space import DEFAULT_SPACE_DIR
from diffusers_lmlp.shapes import pretrained_shapes_pipeline


os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # read by gradio at import: no analytics, no network
APP_PATH = DEFAULT_SPACE_DIR / "app.py"


@cache
def load_app():
    """The demo's `app.py` as a module, imported once per session as the Space runs it (a script, not a module)."""
    spec = importlib.util.spec_from_file_location("lmlp_space_app", APP_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def one_cpu_thread() -> Iterator[None]:
    """Run torch on one CPU thread (restored after): tiny models gain nothing from more, and lose on a busy machine."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(num_threads)


def shapes_pipeline(load=pretrained_shapes_pipeline):
    """A fresh copy of the shapes (or `load`'s) pipeline that ships in the package (32×32 images), progress bar off."""
    pipe = load()
    pipe.set_progress_bar_config(disable=True)
    return pipe


emoji_pipeline = partial(shapes_pipeline, pretrained_emoji_pipeline)  # the emoji one


def shapes_lora(folder: Path, std: float = 0.02) -> Path:
    """Write a LoRA of the shipped shapes model to `folder` as the trainer does (random B of `std`: it has effect)."""
    from diffusers_lmlp.training.components import add_lora, lora_config, save_adapter

    model = shapes_pipeline().transformer
    add_lora(model, lora_config(model, rank=4, alpha=None, dropout=0.0, target_modules=None))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=std, generator=torch.Generator().manual_seed(0))
    save_adapter(model, folder)
    return folder


def image_std(image: Image.Image) -> float:
    """Standard deviation of an image's RGB values (0..255): near 0 for a blank image, ~20 for a shapes sample."""
    return float(np.asarray(image.convert("RGB"), dtype=np.float64).std())


@contextmanager
def serve(demo) -> Iterator[str]:
    """Serve a queued gradio app on 127.0.0.1 in a thread as the Space does (`app.launch`); yield its URL; stop it."""
    _, url, _ = load_app().launch(
        demo, server_name="127.0.0.1", server_port=free_port(), prevent_thread_lock=True, quiet=True
    )
    try:
        yield url
    finally:
        demo.close()


@contextmanager
def app_process(folder: Path, env: dict[str, str], log: Path, timeout: float = 240) -> Iterator[str]:
    """Run `python app.py` in `folder` as a Space does, on a free port, logging to `log`; yield its URL once up."""
    port = free_port()
    env = {**env, "GRADIO_SERVER_NAME": "127.0.0.1", "GRADIO_SERVER_PORT": str(port)}
    with open(log, "w") as output:
        server = subprocess.Popen([sys.executable, "app.py"], cwd=folder, env=env, stdout=output, stderr=output)
    url, deadline = f"http://127.0.0.1:{port}/", time.monotonic() + timeout
    try:
        while True:
            assert server.poll() is None, f"the app exited with {server.returncode}:\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"the app did not start in {timeout} s:\n{log.read_text()[-4000:]}"
            with suppress(httpx.TransportError):  # not listening yet
                if httpx.get(url, timeout=5).status_code == 200:
                    break
            time.sleep(0.5)
        yield url
    finally:
        server.terminate()
        with suppress(subprocess.TimeoutExpired):
            server.wait(timeout=30)
        server.kill()  # if it is still running
        server.wait()


def model_panel(url: str) -> str:
    """The text of the app's model panel, as the server sends it to the browser."""
    config = httpx.get(f"{url}config", timeout=30).json()
    (panel,) = [c["props"]["value"] for c in config["components"] if c["props"].get("elem_id") == "model-info"]
    return panel
