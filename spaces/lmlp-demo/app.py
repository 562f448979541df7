"""Gradio Space: text-to-image with an L-MLP or MoE-MLP pipeline (diffusers-lmlp).

Serves the model repos `LMLP_MODEL` names (default: the shipped emoji and shapes models) with `LMLPPipeline`, from
the package installed or vendored beside this file (`push-space`), so no repo code runs. Every input is checked on
the server, since API calls skip the sliders. The settings are in the README.
"""

try:  # ZeroGPU wants `spaces` imported before torch initialises CUDA; elsewhere its decorator is the identity
    from spaces import GPU as gpu
except ImportError:
    gpu = lambda fn: fn  # noqa: E731

import os
import random
import sys
from collections.abc import Mapping

import gradio as gr
import torch

from diffusers_lmlp import LMLPPipeline
from diffusers_lmlp.cpu import this_cpu
from diffusers_lmlp.sampling import GUIDANCE_SCALE, NUM_INFERENCE_STEPS
from diffusers_lmlp.space.demo import (
    MAX_GUIDANCE,
    MAX_IMAGES,
    MAX_PROMPT_CHARS,
    MAX_SEED,
    MAX_STEPS,
    GenerationRequest,
    describe_model,
    invalid_input,
    request_pipeline,
    serve_frozen,
    shipped_pipelines,
    validate_inputs,
)  # fmt: skip


SHIPPED = shipped_pipelines()  # the first opens

THREADS_VARIABLE = "LMLP_NUM_THREADS"
FREEZE_VARIABLE = "LMLP_FREEZE"
DEFAULT_QUEUE_SIZE = 32
DEFAULT_CONCURRENCY = 1
MAX_FILE_SIZE = "1kb"  # the app takes no files: gradio's upload route must not fill the disk
EXAMPLES = {
    "emoji world": ["red apple", "grinning face", "rocket", "surfer: dark skin tone", "thumbs up sign: medium skin tone"],
    "shapes world": ["a large red circle at the center", "a small blue square at the top left",
                     "a large green triangle at the bottom right", "a small magenta circle at the right"],
    "": ["a red circle on a blue square", "a photograph of an astronaut riding a horse"],
}  # fmt: skip
CSS = "#gallery img { image-rendering: pixelated; }"  # small images, scaled up by the browser without smoothing


def pick_device_and_dtype() -> tuple[str, torch.dtype]:
    """bf16 where it is native (a GPU of compute capability 8.0+, a CPU with `avx512_bf16` or AMX), else fp32."""
    if torch.cuda.is_available():
        return "cuda", torch.bfloat16 if torch.cuda.get_device_capability()[0] >= 8 else torch.float32
    return "cpu", torch.bfloat16 if this_cpu().native_bf16 else torch.float32


def make_generate_fn(pipe: LMLPPipeline):
    """The generate function: inputs are checked before a GPU is asked for (`@spaces.GPU` wraps only the sampling)."""

    @gpu
    def sample(request: GenerationRequest, seed: int, progress: gr.Progress):
        def report_step(_pipe, step: int, _timestep, callback_kwargs: dict) -> dict:
            progress((step + 1, request.num_inference_steps), desc="Denoising", unit="steps")
            return callback_kwargs

        progress((0, request.num_inference_steps), desc="Denoising", unit="steps")
        return request_pipeline(pipe)(
            request.prompt, negative_prompt=request.negative_prompt, num_inference_steps=request.num_inference_steps,
            guidance_scale=request.guidance_scale, num_images_per_prompt=request.num_images,
            generator=torch.Generator("cpu").manual_seed(seed),  # the same noise for a seed on every device
            callback_on_step_end=report_step,
        ).images  # fmt: skip

    def generate(prompt, negative_prompt, seed, randomize_seed, num_inference_steps, guidance_scale, num_images,
                 progress: gr.Progress = gr.Progress()):  # fmt: skip
        request = validate_inputs(prompt, negative_prompt, seed, randomize_seed, num_inference_steps, guidance_scale,
                                  num_images, pipe=pipe)  # fmt: skip
        for message in request.warnings:
            gr.Warning(message, title="Unknown words")
        seed = random.randint(0, MAX_SEED) if request.randomize_seed else request.seed
        return sample(request, seed, progress), seed

    return generate


def examples_for(info: str) -> list[str]:
    """The prompt examples for a model, by the world its panel says it was trained on."""
    return next(examples for world, examples in EXAMPLES.items() if world in info)


def build_demo(pipes, source: str | None = None, queue_size: int | None = None, concurrency: int = 1) -> gr.Blocks:
    """The queued app for one pipeline or several by name (the first opens); its API endpoint `/generate` takes
    the model's name last and returns (images, seed used)."""
    pipes = pipes if isinstance(pipes, Mapping) else {source or pipes.name_or_path: pipes}
    names = list(pipes)
    infos = {name: describe_model(pipe, SHIPPED.get(name, name)) for name, pipe in pipes.items()}
    generators = {name: make_generate_fn(pipe) for name, pipe in pipes.items()}
    examples = {name: examples_for(info) for name, info in infos.items()}

    def generate(prompt, negative_prompt, seed, randomize_seed, num_inference_steps, guidance_scale, num_images,
                 model=names[0], progress: gr.Progress = gr.Progress()):  # fmt: skip
        if model not in generators:
            raise invalid_input(f"The model must be one of {', '.join(map(repr, names))}, got {model!r}.")
        request = (prompt, negative_prompt, seed, randomize_seed, num_inference_steps, guidance_scale, num_images)
        return generators[model](*request, progress=progress)

    def choose(model: str):
        rows = gr.Dataset(samples=[[e] for e in examples[model]])
        return infos[model], rows, gr.Textbox(placeholder=examples[model][0])

    with gr.Blocks(title="diffusers-lmlp") as demo:
        gr.Markdown(
            "# diffusers-lmlp: attention-free MLP text-to-image\nA latent diffusion model whose backbone is a U-shaped "
            "lateralization MLP (L-MLP) or a MoE-MLP: no attention anywhere. Images come at the model's native size."
        )
        model = gr.Radio(names, value=names[0], label="Model", visible=len(names) > 1, elem_id="model")
        with gr.Row():
            prompt = gr.Textbox(label="Prompt", placeholder=examples[names[0]][0], max_lines=2,
                                max_length=MAX_PROMPT_CHARS, scale=4, elem_id="prompt")  # fmt: skip
            run = gr.Button("Generate", variant="primary", scale=1, elem_id="generate")
        with gr.Row():
            with gr.Column(scale=3):  # png: lossless, the pixels the model made
                gallery = gr.Gallery(label="Images", columns=2, height=720, object_fit="contain", format="png",
                                     elem_id="gallery")  # fmt: skip
            with gr.Column(scale=2):
                info = gr.Markdown(infos[names[0]], elem_id="model-info")
                with gr.Accordion("Advanced settings", open=False):
                    negative = gr.Textbox("", label="Negative prompt", max_lines=2, max_length=MAX_PROMPT_CHARS)
                    with gr.Row():
                        seed = gr.Slider(0, MAX_SEED, value=0, step=1, label="Seed")
                        randomize = gr.Checkbox(value=True, label="Randomize seed")
                    steps = gr.Slider(1, MAX_STEPS, value=NUM_INFERENCE_STEPS, step=1, label="Steps")
                    guidance = gr.Slider(0.0, MAX_GUIDANCE, value=GUIDANCE_SCALE, step=0.1, label="Guidance scale",
                                         info="diffusers' g; the papers' s is g − 1 (≤ 1: no guidance)")  # fmt: skip
                    num_images = gr.Slider(1, MAX_IMAGES, value=MAX_IMAGES, step=1, label="Number of images")
        shown = gr.Examples(examples=[[example] for example in examples[names[0]]], inputs=[prompt])
        model.change(choose, inputs=[model], outputs=[info, shown.dataset, prompt], api_name=False)
        inputs = [prompt, negative, seed, randomize, steps, guidance, num_images, model]
        # preprocess=False: the inputs reach `validate_inputs` as sent, not the sliders' checks, which name no input
        gr.on([run.click, prompt.submit], generate, inputs=inputs, outputs=[gallery, seed], api_name="generate",
              preprocess=False)  # fmt: skip
    return demo.queue(max_size=queue_size, default_concurrency_limit=concurrency)


def read_settings(environ: Mapping[str, str] = os.environ) -> tuple[int, int, int, str, bool]:
    """(queue size, concurrency, CPU threads and why, freeze) from the environment; a bad value raises ValueError.
    Threads: `LMLP_NUM_THREADS`, else `OMP_NUM_THREADS`, else the cores split among the requests that run at once."""

    def whole(name: str, default: int | None) -> int | None:
        if (value := environ.get(name)) is not None and (not value.strip().isdigit() or int(value) < 1):
            raise ValueError(f"{name} must be a whole number of at least 1, got {value!r}.")
        return default if value is None else int(value)

    queue_size, concurrency = (
        whole("LMLP_QUEUE_SIZE", DEFAULT_QUEUE_SIZE),
        whole("LMLP_CONCURRENCY", DEFAULT_CONCURRENCY),
    )
    threads, reason = whole(THREADS_VARIABLE, None), THREADS_VARIABLE
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if threads is None and (user := environ.get("OMP_NUM_THREADS", "").strip()).isdigit() and int(user) >= 1:
        threads, reason = int(user), "OMP_NUM_THREADS"
    elif threads is None:
        threads = max(1, cores // concurrency)
        reason = "every core" if threads == cores else f"{threads} of {cores} cores"
    if (freeze := environ.get(FREEZE_VARIABLE, "1").strip()) not in ("0", "1"):
        raise ValueError(
            f"{FREEZE_VARIABLE} must be 1 (freeze the transformer) or 0 (sample eagerly), got {freeze!r}."
        )
    return queue_size, concurrency, threads, reason, freeze == "1"


def launch(demo: gr.Blocks, **server_options):
    return demo.launch(css=CSS, max_file_size=MAX_FILE_SIZE, **server_options)


class CannotServe(Exception):
    """The app cannot serve the model it is set up with; the message says what to change."""


def load_pipeline(model: str, dtype: torch.dtype) -> LMLPPipeline:
    """`LMLPPipeline.from_pretrained`: the package's code, never the repo's (one pushed `--with-code` loads too)."""
    return LMLPPipeline.from_pretrained(SHIPPED.get(model, model), dtype=dtype)


def served_models(environ: Mapping[str, str] = os.environ) -> list[str]:
    """The models `LMLP_MODEL` names, else the shipped ones."""
    if models := [m.strip() for m in environ.get("LMLP_MODEL", "").split(",") if m.strip()] or list(SHIPPED):
        return models
    raise CannotServe(
        "LMLP_MODEL is not set: set it to the model repos to serve, comma-separated (`python -m diffusers_lmlp.hub "
        "push-space` sets it on a Space). The shipped models are not in this copy of diffusers-lmlp."
    )


def main() -> None:
    try:
        queue_size, concurrency, num_threads, reason, freeze = read_settings()
        device, dtype = pick_device_and_dtype()
        if device == "cpu":
            torch.set_num_threads(num_threads)
            print(
                f"Serving on the CPU with {num_threads} thread(s) ({reason}; set {THREADS_VARIABLE} to change).",
                flush=True,
            )
        pipes = {model: load_pipeline(model, dtype).to(device) for model in served_models()}
    except (ValueError, CannotServe) as error:
        sys.exit(f"error: {error}")
    for model, pipe in pipes.items():
        if device == "cpu":
            print(f"Serving {model}.", flush=True)
            print(serve_frozen(pipe) if freeze else f"Sampling eagerly ({FREEZE_VARIABLE}=0).", flush=True)
    launch(build_demo(pipes, queue_size=queue_size, concurrency=concurrency))


if __name__ == "__main__":
    main()
