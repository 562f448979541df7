"""Gradio Space: text-to-image with an L-MLP or MoE-MLP pipeline (diffusers-lmlp).

With diffusers-lmlp installed it serves `LMLP_MODEL` (default: the shipped emoji and shapes models) through
`LMLPPipeline`, running no repo code; without it, repos pushed `--with-code`, with `trust_remote_code=True`.
Every input is checked on the server, since API calls skip the sliders. The settings are in the README.
"""

try:  # ZeroGPU wants `spaces` imported before torch initialises CUDA; elsewhere its decorator is the identity
    from spaces import GPU as gpu
except ImportError:
    gpu = lambda fn: fn  # noqa: E731

import copy
import math
import os
import random
import sys
import time
from collections.abc import Mapping
from typing import NamedTuple

import gradio as gr
import torch
from diffusers import DiffusionPipeline
from huggingface_hub import ModelCard
from huggingface_hub.errors import EntryNotFoundError, HFValidationError


PACKAGE = "diffusers_lmlp"
try:
    from diffusers_lmlp import LMLPPipeline
    from diffusers_lmlp.models import family_of
    from diffusers_lmlp.worlds import WORLDS

    SHIPPED = {name: str(WORLDS[name].pipeline_path) for name in ("emoji", "shapes")}  # the first opens
except ModuleNotFoundError as missing:
    if missing.name != PACKAGE:  # installed but broken: say so
        raise
    LMLPPipeline = family_of = None
    SHIPPED = {}

THREADS_VARIABLE = "LMLP_NUM_THREADS"
FREEZE_VARIABLE = "LMLP_FREEZE"
DEFAULT_QUEUE_SIZE = 32
DEFAULT_CONCURRENCY = 1
WITH_CODE = "`python -m diffusers_lmlp.hub push FOLDER REPO --with-code`"
UPDATE_CODE = f"push the model with its code again, {WITH_CODE}"
MAX_SEED = 2**31 - 1  # np.iinfo(np.int32).max, the Space convention
MAX_PROMPT_CHARS, MAX_STEPS, MAX_IMAGES, MAX_GUIDANCE = 400, 100, 4, 10
MAX_UNKNOWN_SHARE = 0.5  # a prompt with more of its words outside a closed vocabulary is refused; fewer, flagged
DEFAULT_STEPS, DEFAULT_GUIDANCE = 50, 2.0  # both papers: 50 DPM-Solver++ steps, s = 1 (diffusers' g = s + 1)
MAX_FILE_SIZE = "1kb"  # the app takes no files: gradio's upload route must not fill the disk
EXAMPLES = {
    "emoji world": ["red apple", "grinning face", "rocket", "surfer: dark skin tone", "thumbs up sign: medium skin tone"],
    "shapes world": ["a large red circle at the center", "a small blue square at the top left",
                     "a large green triangle at the bottom right", "a small magenta circle at the right"],
    "": ["a red circle on a blue square", "a photograph of an astronaut riding a horse"],
}  # fmt: skip
CSS = "#gallery img { image-rendering: pixelated; }"  # small images, scaled up by the browser without smoothing


class GenerationRequest(NamedTuple):
    prompt: str
    negative_prompt: str
    seed: int
    randomize_seed: bool
    num_inference_steps: int
    guidance_scale: float
    num_images: int
    warnings: tuple[str, ...] = ()


def invalid_input(message: str) -> gr.Error:
    """The request is at fault, not the server: show the message, log no traceback."""
    return gr.Error(message, title="Invalid input", print_exception=False)


def check_text(name: str, value, pipe, required: bool) -> tuple[str, str | None]:
    """`value` stripped and within the character and token limits, not mostly unknown words; a warning for some."""
    if value is None and not required:
        return "", None
    if not isinstance(value, str):
        raise invalid_input(f"The {name} must be text, got {type(value).__name__}.")
    text, warning = value.strip(), ""
    if required and not text:
        raise invalid_input(f"The {name} is empty: describe the image you want (1 to {MAX_PROMPT_CHARS} characters).")
    if len(text) > MAX_PROMPT_CHARS:
        raise invalid_input(f"The {name} has {len(text)} characters; at most {MAX_PROMPT_CHARS} are allowed.")
    if pipe is None or not text:
        return text, None
    if unknown := pipe.unknown_words(text):  # first: a closed vocabulary spells unknown words byte by byte
        words, named = pipe.prompt_words(text), ", ".join(map(repr, unknown))
        if (count := sum(word in unknown for word in words)) > MAX_UNKNOWN_SHARE * len(words):
            raise invalid_input(
                f"The {name} is mostly words this model does not know ({count} of its {len(words)} words: {named}), "
                f"so it would generate noise. This model knows only {pipe.describe_vocabulary()}."
            )
        warning = f"The {name} has words this model does not know: {named}. They do not steer the images; the model "
        warning += "panel lists the words it knows."
    if (num_tokens := len(pipe.tokenizer(text, verbose=False).input_ids)) > (limit := pipe.tokenizer.model_max_length):
        raise invalid_input(
            f"The {name} is {num_tokens} tokens long (with the start and end tokens), but this model reads at most "
            f"{limit}; shorten it so that nothing is cut off. {warning}".strip()
        )
    return text, warning or None


def check_number(name: str, value, low: int, high: int, whole: bool = True) -> int | float:
    real = isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))
    if isinstance(value, bool) or not real or (whole and value != int(value)) or not low <= value <= high:
        raise invalid_input(
            f"The {name} must be {'a whole' if whole else 'a'} number from {low} to {high}, got {value!r}."
        )
    return int(value) if whole else float(value)


def validate_inputs(prompt, negative_prompt, seed, randomize_seed, num_inference_steps, guidance_scale, num_images,
                    pipe=None) -> GenerationRequest:  # fmt: skip
    """Every input as sent, checked and bounded; `gr.Error` names the first bad one. Without `pipe` only the texts'
    characters are checked, not their tokens and words."""
    prompt, prompt_warning = check_text("prompt", prompt, pipe, required=True)
    negative_prompt, negative_warning = check_text("negative prompt", negative_prompt, pipe, required=False)
    if not isinstance(randomize_seed, bool):
        raise invalid_input(f"'Randomize seed' must be true or false, got {randomize_seed!r}.")
    return GenerationRequest(
        prompt, negative_prompt, check_number("seed", seed, 0, MAX_SEED), randomize_seed,
        check_number("number of steps", num_inference_steps, 1, MAX_STEPS),
        check_number("guidance scale", guidance_scale, 0, MAX_GUIDANCE, whole=False),
        check_number("number of images", num_images, 1, MAX_IMAGES),
        tuple(message for message in (prompt_warning, negative_warning) if message),
    )  # fmt: skip


def pick_device_and_dtype() -> tuple[str, torch.dtype]:
    """bf16 where it is native (a GPU of compute capability 8.0+, a CPU with `avx512_bf16` or AMX), else fp32."""
    if torch.cuda.is_available():
        return "cuda", torch.bfloat16 if torch.cuda.get_device_capability()[0] >= 8 else torch.float32
    try:
        flags = next(line for line in open("/proc/cpuinfo", encoding="utf-8") if line.startswith("flags")).split()
    except (OSError, StopIteration):  # only Linux lists the CPU's flags
        flags = []
    return "cpu", torch.bfloat16 if {"avx512_bf16", "amx_bf16"} & set(flags) else torch.float32


def backbone_family(backbone):
    """(label, details) from the registry, else from the copy of its entry that `push --with-code` writes."""
    family = type(backbone) if family_of is None else family_of(backbone)
    return (family.family_label, family.family_details) if family_of is None else (family.label, family.details)


def describe_model(pipe: DiffusionPipeline, source: str) -> str:
    """The model panel (Markdown): backbone, size, resolution, text length, vocabulary and training data."""
    try:
        card = ModelCard.load(os.path.join(source, "README.md") if os.path.isdir(source) else source)
    except (OSError, EntryNotFoundError, HFValidationError):  # no card, no Hub, or not a repo id
        card = None
    lines = card.text.splitlines() if card else []
    title = next(
        (line[2:].strip() for line in lines if line.startswith("# ")), os.path.basename(os.path.normpath(source))
    )
    trained = [line.removeprefix("- Training:").strip() for line in lines if line.startswith("- Training:")]
    data = ", ".join(f"`{name}`" for name in card.data.datasets) if card and card.data.datasets else None
    data = data or (
        trained[0] if trained else "not recorded" + (" in the model card" if card else " (no model card found)")
    )
    backbone, config = pipe.transformer, pipe.transformer.config
    label, details = backbone_family(backbone)
    shipped = [n for n, path in SHIPPED.items() if os.path.isdir(source) and os.path.samefile(source, path)]
    vocabulary = pipe.describe_vocabulary()
    return "\n".join([
        f"### Model: {title}",
        f"ships with diffusers-lmlp: `pretrained_{shipped[0]}_pipeline()`" if shipped else f"`{source}`", "",
        f"- **Backbone:** {label} (`{type(backbone).__name__}`), {sum(p.numel() for p in backbone.parameters()):,} "
        f"parameters; hidden size {config.hidden_size}, {config.num_layers} + 1 blocks, patch {config.patch_size}"
        f"{details(config)}",
        f"- **Native resolution:** {pipe.native_size}×{pipe.native_size} px ({config.sample_size}×{config.sample_size}"
        f" latents × VAE factor {pipe.vae_scale_factor}); images are shown unresampled",
        f"- **Text:** up to {pipe.tokenizer.model_max_length} tokens, start and end tokens included",
        "- **Vocabulary:** " + (f"closed: use only its {vocabulary}" if vocabulary else "open: any word, in subword pieces"),
        f"- **Training data:** {data}",
        f"- **Running on:** {pipe.device.type}, {str(backbone.dtype).removeprefix('torch.')}",
    ])  # fmt: skip


def serve_frozen(pipe: DiffusionPipeline) -> str:
    """Compile the transformer now with its weights frozen in (`enable_inductor_freezing`), through a request's
    pipeline, for batches of 1 and 2; sample eagerly where inductor cannot. Returns the log line."""
    started, eagerly = time.perf_counter(), "Sampling eagerly: "
    if not hasattr(pipe, "enable_inductor_freezing"):
        return f"{eagerly}this pipeline's code cannot freeze the transformer ({UPDATE_CODE})."
    pipe.enable_inductor_freezing()
    if not getattr(warm_up := request_pipeline(pipe), "inductor_freezing_enabled", False):
        pipe.disable_inductor_freezing()
        return f"{eagerly}this pipeline's code does not share its frozen graph with requests ({UPDATE_CODE})."
    try:
        for guidance_scale in (1.0, DEFAULT_GUIDANCE):  # batches of 1, then of 2: (uncond | cond)
            warm_up("", num_inference_steps=1, guidance_scale=guidance_scale, output_type="latent")
    except Exception as error:  # whatever stops inductor, the eager transformer samples the same images
        pipe.disable_inductor_freezing()
        while (inner := getattr(error, "inner_exception", None) or error.__cause__) is not None:  # dynamo wraps it
            error = inner
        lines = str(error).strip().splitlines()
        return f"{eagerly}inductor could not freeze the transformer here ({type(error).__name__}{': ' + lines[0] if lines else ''})."
    seconds = time.perf_counter() - started
    return f"Sampling with the transformer frozen by inductor, compiled in {seconds:.1f} s ({FREEZE_VARIABLE}=0 samples eagerly)."


def request_pipeline(pipe: DiffusionPipeline) -> DiffusionPipeline:
    """`pipe`'s modules and frozen graph with its own scheduler and tokenizer: a fast tokenizer sets its padding on
    every call, so one shared between requests can pad one batch by another's settings."""
    own = dict(scheduler=copy.deepcopy(pipe.scheduler), tokenizer=copy.deepcopy(pipe.tokenizer))
    call_pipe = type(pipe).from_pipe(pipe, transformer=pipe.transformer, dtype=pipe.dtype, **own)
    call_pipe.set_progress_bar_config(disable=True)
    return call_pipe


def make_generate_fn(pipe: DiffusionPipeline):
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
                    steps = gr.Slider(1, MAX_STEPS, value=DEFAULT_STEPS, step=1, label="Steps")
                    guidance = gr.Slider(0.0, MAX_GUIDANCE, value=DEFAULT_GUIDANCE, step=0.1, label="Guidance scale",
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


def load_pipeline(model: str, dtype: torch.dtype) -> DiffusionPipeline:
    """With the package, `LMLPPipeline.from_pretrained` (no repo code runs). Without it, the repo's own code, once
    its `model_index.json` shows it has some."""
    if LMLPPipeline is not None:
        return LMLPPipeline.from_pretrained(SHIPPED.get(model, model), dtype=dtype)
    index = DiffusionPipeline.load_config(model)
    named = sorted(key for key, entry in index.items() if isinstance(entry, list) and entry[:1] == [PACKAGE])
    if named := (named if isinstance(index.get("_class_name"), list) else ["_class_name", *named]):
        raise CannotServe(
            f"{model} has no code to load it without diffusers-lmlp, which is not installed here (its model_index.json "
            f"names the package: {', '.join(named)}). Push the model with its code: "
            f"{WITH_CODE.replace('REPO', 'REPO' if os.path.isdir(model) else model)}, FOLDER being the saved pipeline."
        )
    return DiffusionPipeline.from_pretrained(model, dtype=dtype, use_safetensors=True, trust_remote_code=True)


def served_models(environ: Mapping[str, str] = os.environ) -> list[str]:
    """The models `LMLP_MODEL` names, else the shipped ones."""
    if models := [m.strip() for m in environ.get("LMLP_MODEL", "").split(",") if m.strip()] or list(SHIPPED):
        return models
    raise CannotServe(
        f"LMLP_MODEL is not set. Without diffusers-lmlp installed, the app serves model repos pushed with their code "
        f"({WITH_CODE}): set LMLP_MODEL to those REPOs, comma-separated (on a Space, `python -m diffusers_lmlp.hub "
        "push-space` sets it). The shipped models need the package."
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
