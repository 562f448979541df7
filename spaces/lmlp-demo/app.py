"""Gradio Space: text-to-image with an L-MLP or MoE-MLP pipeline (diffusers-lmlp).

This folder (`spaces/lmlp-demo/` in the diffusers-lmlp repository: app.py, README.md, requirements.txt) is the
Space: `python -m diffusers_lmlp.hub push-space` uploads it as it is, and a Space repo holds no copy of the package.
The wheel ships the same folder as package data (`diffusers_lmlp/space/lmlp_demo/`), so that `push-space` works from
a pip install too. The app runs two ways:

- **With diffusers-lmlp installed** (a local run: `python app.py` in this folder), it serves the pipelines named
  by `LMLP_MODEL` (Hub repo ids or local folders written by `save_pretrained`, separated by commas) with
  `LMLPPipeline.from_pretrained`, which runs no code from the repos; without `LMLP_MODEL`, the two 32×32 models that
  ship in the package, offline: the emoji world's, which it opens on, and the shapes world's beside it.
- **Without it** (the Space: diffusers-lmlp is not on PyPI), `LMLP_MODEL` must name pipelines pushed with their code
  (`python -m diffusers_lmlp.hub push FOLDER REPO --with-code`), which it loads with
  `DiffusionPipeline.from_pretrained(model, trust_remote_code=True)`: the repos' `pipeline_lmlp.py` and
  `transformer/*.py` run here. The opt-in is given for those models only, the ones the Space's own variable names
  (only the Space's owner sets it), and never when the package is installed. A repo without the code is refused
  before anything of it runs, with the command that adds it.

With several models, a choice above the prompt switches the model panel, the examples and the model that samples;
the API endpoint `/generate` takes the model's name as its last input (the first model when left out).

What else the app needs from the package it takes from what it loaded, whose classes carry it in either case: the
words of a closed vocabulary from the pipeline's methods (`unknown_words`, `prompt_words`, `describe_vocabulary`),
and the backbone's family from the registry or the copy of its entry in the backbone's code (`backbone_family`).

Environment variables:

| variable | default | meaning |
|---|---|---|
| `LMLP_MODEL` | the shipped emoji and shapes models (package installed only) | pipelines to serve, comma-separated: Hub repo ids or local folders; the first opens |
| `LMLP_QUEUE_SIZE` | 32 | requests that may wait in the queue; more are refused ("Queue is full") |
| `LMLP_CONCURRENCY` | 1 | requests that run at the same time |
| `LMLP_NUM_THREADS` | `OMP_NUM_THREADS` if set, else the cores ÷ `LMLP_CONCURRENCY` | CPU threads of torch (on the CPU) |
| `LMLP_FREEZE` | 1 | on the CPU, 1 samples with the transformer frozen by inductor (`serve_frozen`), 0 eagerly |

Each must be a whole number of at least 1 (`LMLP_FREEZE`: 0 or 1); the app stops at start-up with a message naming a
bad one. Requests that run side by side share the cores (`choose_cpu_threads`): more threads than cores slow every
one of them down.

The UI and the named API endpoint `/generate` run the same function. Every input is checked on the server by
`validate_inputs` (API calls do not pass through the browser's sliders), and a bad value raises `gr.Error` with a
message that names the input and its allowed range. A model whose tokenizer has a closed vocabulary (as the shapes
model's: a few dozen words) lists its words in the model panel; a prompt that is mostly other words is refused, and one
with a few gets a warning that names them. The app takes no files, so the server refuses any upload over
`MAX_FILE_SIZE` (gradio answers HTTP 413): anonymous visitors cannot fill the Space's disk through
`/gradio_api/upload`.
"""

# ZeroGPU wants `spaces` imported before torch initialises CUDA. Off ZeroGPU its decorator returns the function
# unchanged; without `spaces` installed we use the identity (then, run from the root of the diffusers-lmlp
# repository, `spaces` is the repository's `spaces/` folder, which has no `GPU`).
try:
    from spaces import GPU as gpu
except ImportError:

    def gpu(fn):
        return fn


import copy
import math
import os
import random
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import gradio as gr
import torch
from diffusers import DiffusionPipeline
from huggingface_hub import ModelCard
from huggingface_hub.errors import EntryNotFoundError, HFValidationError
from PIL import Image


PACKAGE = "diffusers_lmlp"
try:
    from diffusers_lmlp import LMLPPipeline
    from diffusers_lmlp.models import family_of
    from diffusers_lmlp.worlds import WORLDS

    # The pipelines that ship in the package, the one the app opens on first.
    SHIPPED = {name: str(WORLDS[name].pipeline_path) for name in ("emoji", "shapes")}
except ModuleNotFoundError as missing:
    if missing.name != PACKAGE:  # installed but broken: say so, do not fall back to the repo's code
        raise
    # The Space: the served model repos bring their own code (`load_pipeline`).
    LMLPPipeline = family_of = None
    SHIPPED = {}

THREADS_VARIABLE = "LMLP_NUM_THREADS"
# 1: sample on the CPU with the transformer frozen by inductor (`serve_frozen`); 0: eagerly.
FREEZE_VARIABLE = "LMLP_FREEZE"
UPDATE_CODE = "push the model with its code again, `python -m diffusers_lmlp.hub push FOLDER REPO --with-code`"

MAX_SEED = 2**31 - 1  # np.iinfo(np.int32).max, the Space convention
MAX_PROMPT_CHARS = 400
MAX_STEPS = 100
MAX_IMAGES = 4
MAX_GUIDANCE = 10.0
# A prompt with more than this share of its words outside a closed vocabulary is refused; with fewer, flagged.
MAX_UNKNOWN_SHARE = 0.5
DEFAULT_STEPS = 50  # both papers sample with 50 DPM-Solver++ steps
DEFAULT_GUIDANCE = 2.0  # diffusers' g = s + 1 for the papers' s = 1
DEFAULT_QUEUE_SIZE = 32
DEFAULT_CONCURRENCY = 1
# Uploads above this are refused; the app takes no files at all (gradio's default is no limit).
MAX_FILE_SIZE = "1kb"

SHAPES_EXAMPLES = [
    "a large red circle at the center",
    "a small blue square at the top left",
    "a large green triangle at the bottom right",
    "a large yellow square at the top",
    "a small magenta circle at the right",
    "a large cyan triangle at the left",
]
EMOJI_EXAMPLES = [
    "red apple",
    "grinning face",
    "rocket",
    "a sunflower emoji",
    "surfer: dark skin tone",
    "thumbs up sign: medium skin tone",
]
GENERIC_EXAMPLES = [
    "a red circle on a blue square",
    "a photograph of an astronaut riding a horse",
    "a bowl of fruit on a wooden table",
    "a lighthouse on a cliff at sunset",
]

# The model makes small images (32×32 px for the shapes model): the gallery shows the native pixels, scaled up by
# the browser without smoothing.
CSS = """
#gallery img { image-rendering: pixelated; }
"""


@dataclass(frozen=True)
class GenerationRequest:
    """The inputs of one generation, validated and normalised by `validate_inputs`."""

    prompt: str
    negative_prompt: str
    seed: int
    randomize_seed: bool
    num_inference_steps: int
    guidance_scale: float
    num_images: int
    # Messages to show the user: the prompts' words outside the model's closed vocabulary.
    warnings: tuple[str, ...] = ()


def invalid_input(message: str) -> gr.Error:
    """The error for a bad input: shown to the user (and the API caller) as the message alone, and not logged with
    a traceback, since the request, not the server, is at fault."""
    return gr.Error(message, title="Invalid input", print_exception=False)


def _check_text(name: str, value, pipe, required: bool) -> tuple[str, str | None]:
    """`value` stripped, if it is a string within the character and token limits and not mostly unknown words
    (`_check_words`), and the warning for the unknown words it has; else raise `gr.Error`."""
    if value is None and not required:
        return "", None
    if not isinstance(value, str):
        raise invalid_input(f"The {name} must be text, got {type(value).__name__}.")
    text = value.strip()
    if required and not text:
        raise invalid_input(f"The {name} is empty: describe the image you want (1 to {MAX_PROMPT_CHARS} characters).")
    if len(text) > MAX_PROMPT_CHARS:
        raise invalid_input(f"The {name} has {len(text)} characters; at most {MAX_PROMPT_CHARS} are allowed.")
    if pipe is None:
        return text, None
    # Words first: a closed vocabulary spells an unknown word byte by byte, which is also what makes a text too long.
    warning = _check_words(name, text, pipe)
    if text:
        tokenizer = pipe.tokenizer
        num_tokens = len(tokenizer(text, verbose=False).input_ids)  # with the start and end tokens
        if num_tokens > tokenizer.model_max_length:
            raise invalid_input(
                f"The {name} is {num_tokens} tokens long (with the start and end tokens), but this model reads at "
                f"most {tokenizer.model_max_length}; shorten it so that nothing is cut off."
                + (f" {warning}" if warning else "")
            )
    return text, warning


def _check_words(name: str, text: str, pipe) -> str | None:
    """Raise `gr.Error` if most words of `text` are outside the pipeline tokenizer's closed vocabulary.

    The pipeline's own methods (`unknown_words`, `prompt_words`, `describe_vocabulary`) read the vocabulary, with
    the package installed or from the model repo's code alike.

    Returns:
        `str` or `None`: A warning naming the unknown words when there are some, but at most `MAX_UNKNOWN_SHARE` of
        the words; None when every word is known, or the vocabulary is open.
    """
    unknown = pipe.unknown_words(text)
    if not unknown:
        return None
    words = pipe.prompt_words(text)
    num_unknown = sum(word in unknown for word in words)
    named = ", ".join(map(repr, unknown))
    if num_unknown > MAX_UNKNOWN_SHARE * len(words):
        raise invalid_input(
            f"The {name} is mostly words this model does not know ({num_unknown} of its {len(words)} words: "
            f"{named}), so it would generate noise. This model knows only {pipe.describe_vocabulary()}."
        )
    return (
        f"The {name} has words this model does not know: {named}. They do not steer the images; the model panel "
        "lists the words it knows."
    )


def _check_int(name: str, value, low: int, high: int) -> int:
    """`value` as an int if it is a whole number in [low, high]; else raise `gr.Error`."""
    whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not whole or not low <= value <= high:
        raise invalid_input(f"The {name} must be a whole number from {low} to {high}, got {value!r}.")
    return int(value)


def validate_inputs(
    prompt,
    negative_prompt,
    seed,
    randomize_seed,
    num_inference_steps,
    guidance_scale,
    num_images,
    pipe=None,
) -> GenerationRequest:
    """Check and bound every input of a generation; raise `gr.Error` naming the first bad one and its range.

    The values arrive as sent (API calls do not pass through the browser's sliders), so anything may come in.

    Args:
        prompt: Text of 1 to `MAX_PROMPT_CHARS` characters (stripped), and at most the tokenizer's
            `model_max_length` tokens with the start and end tokens.
        negative_prompt: Text of at most `MAX_PROMPT_CHARS` characters and `model_max_length` tokens; `None` or
            `""` for the reference's unconditional context.
        seed: Whole number from 0 to `MAX_SEED`.
        randomize_seed (`bool`): Draw a new seed instead of using `seed`.
        num_inference_steps: Whole number from 1 to `MAX_STEPS`.
        guidance_scale: Finite number from 0 to `MAX_GUIDANCE` (diffusers' convention; ≤ 1 means no guidance).
        num_images: Whole number from 1 to `MAX_IMAGES`.
        pipe (`LMLPPipeline`, *optional*): The served pipeline: its tokenizer counts the prompts' tokens and, for a
            closed vocabulary, its vocabulary methods refuse prompts that are mostly unknown words (more than
            `MAX_UNKNOWN_SHARE`) and flag those with some. Without it, only the characters are checked.

    Returns:
        `GenerationRequest`: The inputs with whole numbers as `int`, the guidance as `float` and stripped texts, and
        the warnings to show.
    """
    prompt, prompt_warning = _check_text("prompt", prompt, pipe, required=True)
    negative_prompt, negative_warning = _check_text("negative prompt", negative_prompt, pipe, required=False)
    warnings = tuple(message for message in (prompt_warning, negative_warning) if message)
    seed = _check_int("seed", seed, 0, MAX_SEED)
    if not isinstance(randomize_seed, bool):
        raise invalid_input(f"'Randomize seed' must be true or false, got {randomize_seed!r}.")
    num_inference_steps = _check_int("number of steps", num_inference_steps, 1, MAX_STEPS)
    number = isinstance(guidance_scale, int | float) and not isinstance(guidance_scale, bool)
    if not number or not math.isfinite(guidance_scale) or not 0 <= guidance_scale <= MAX_GUIDANCE:
        raise invalid_input(f"The guidance scale must be a number from 0 to {MAX_GUIDANCE:g}, got {guidance_scale!r}.")
    num_images = _check_int("number of images", num_images, 1, MAX_IMAGES)
    return GenerationRequest(
        prompt, negative_prompt, seed, randomize_seed, num_inference_steps, float(guidance_scale), num_images, warnings
    )


def time_matmul(dtype: torch.dtype, size: int = 256, repeats: int = 5) -> float:
    """Best time in seconds of a (size, size) @ (size, size) matmul on the CPU in `dtype`, after one warm-up."""
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    torch.mm(a, b)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return best


def cpu_prefers_bf16(timer: Callable[[torch.dtype], float] = time_matmul, margin: float = 0.8) -> bool:
    """Whether bf16 runs faster than fp32 on this CPU, by a short timed matmul (a few milliseconds).

    CPUs with native bf16 (`avx512_bf16`, AMX) run bf16 GEMMs faster than fp32; without it (AVX2 only) bf16 is
    emulated and 10 to several hundred times slower.

    Args:
        timer (`Callable`, *optional*): Seconds for a fixed matmul in the given dtype; `time_matmul` by default.
        margin (`float`, *optional*, defaults to 0.8): bf16 is chosen only if it takes less than `margin` times the
            fp32 time, so that timing noise does not pick it.

    Returns:
        `bool`: True to run in bf16.
    """
    return timer(torch.bfloat16) < margin * timer(torch.float32)


def pick_device_and_dtype() -> tuple[str, torch.dtype]:
    """The device and precision to serve with: bf16 only where it is faster than fp32.

    On CUDA, bf16 where the GPU has bf16 tensor cores (compute capability 8.0 and up), else fp32. On the CPU, bf16
    if `cpu_prefers_bf16()` measures it faster, else fp32.

    Returns:
        `tuple`: (`"cuda"` or `"cpu"`, `torch.bfloat16` or `torch.float32`).
    """
    if torch.cuda.is_available():
        return "cuda", torch.bfloat16 if torch.cuda.get_device_capability()[0] >= 8 else torch.float32
    return "cpu", torch.bfloat16 if cpu_prefers_bf16() else torch.float32


def load_model_card(source: str) -> ModelCard | None:
    """The model card (`README.md`) of a local pipeline folder or Hub repo, or None if there is none to be had.

    Args:
        source (`str`): The local folder or Hub repo id the pipeline was loaded from.
    """
    if os.path.isdir(source):
        readme = os.path.join(source, "README.md")
        return ModelCard.load(readme) if os.path.isfile(readme) else None
    try:
        return ModelCard.load(source)
    except (OSError, EntryNotFoundError, HFValidationError):  # no card, the Hub cannot be reached, or not a repo id
        return None


def training_data(card: ModelCard | None) -> str:
    """What the model was trained on, from its card: the `datasets` metadata, else the "- Training:" line.

    Args:
        card (`ModelCard`, *optional*): The model card (`write_model_card` writes the "- Training:" line).

    Returns:
        `str`: Markdown text, or a note that the card does not say.
    """
    if card is None:
        return "not recorded (no model card found)"
    if card.data.datasets:
        return ", ".join(f"`{name}`" for name in card.data.datasets)
    for line in card.text.splitlines():
        if line.startswith("- Training:"):
            return line.removeprefix("- Training:").strip()
    return "not recorded in the model card"


def backbone_family(backbone) -> tuple[str, Callable[[Mapping], str]]:
    """The backbone's family as the block-family registry (`diffusers_lmlp.FAMILIES`) describes it.

    With the package installed, from the registry itself; without it, from the copy of the backbone's registry entry
    that `push --with-code` writes into the backbone's code (the class attributes `family_label` and
    `family_details`; see `diffusers_lmlp.hub.remote_code`).

    Args:
        backbone (`ModelMixin`): The pipeline's transformer.

    Returns:
        `tuple`: (the family's label, such as "UL-MLP"; its function from a config to the family-specific part of it
        in words, such as ", 2 experts × 2 heads").
    """
    if family_of is not None:
        family = family_of(backbone)
        return family.label, family.details
    return type(backbone).family_label, type(backbone).family_details


def describe_model(pipe: DiffusionPipeline, source: str) -> str:
    """The model panel: backbone kind, parameter count, native resolution, text length, vocabulary and training data.

    Args:
        pipe (`LMLPPipeline`): The served pipeline.
        source (`str`): The local folder or Hub repo id it was loaded from.

    Returns:
        `str`: Markdown.
    """
    card = load_model_card(source)
    headings = [line[2:].strip() for line in card.text.splitlines() if line.startswith("# ")] if card else []
    name = headings[0] if headings else os.path.basename(os.path.normpath(source))
    backbone = pipe.transformer
    config = backbone.config
    label, details = backbone_family(backbone)
    num_params = sum(p.numel() for p in backbone.parameters())
    layout = f"hidden size {config.hidden_size}, {config.num_layers} + 1 blocks, patch {config.patch_size}"
    layout += details(config)
    latent = config.sample_size
    shipped = [name for name, path in SHIPPED.items() if os.path.isdir(source) and os.path.samefile(source, path)]
    origin = f"ships with diffusers-lmlp: `pretrained_{shipped[0]}_pipeline()`" if shipped else f"`{source}`"
    vocabulary = pipe.describe_vocabulary()
    if vocabulary is None:
        vocabulary = "open: the tokenizer spells any word in subword pieces the text encoder knows"
    else:
        vocabulary = f"closed: use only its {vocabulary}"
    return "\n".join(
        [
            f"### Model: {name}",
            origin,
            "",
            f"- **Backbone:** {label} (`{type(backbone).__name__}`), {num_params:,} parameters; {layout}",
            f"- **Native resolution:** {pipe.native_size}×{pipe.native_size} px ({latent}×{latent} latents × VAE "
            f"factor {pipe.vae_scale_factor}); images are shown unresampled",
            f"- **Text:** up to {pipe.tokenizer.model_max_length} tokens, start and end tokens included",
            f"- **Vocabulary:** {vocabulary}",
            f"- **Training data:** {training_data(card)}",
            f"- **Running on:** {pipe.device.type}, {str(backbone.dtype).removeprefix('torch.')}",
        ]
    )


def freeze_setting(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether to sample on the CPU with the transformer frozen by inductor (`serve_frozen`), from `LMLP_FREEZE`: 1 (the
    default) or 0; raise `ValueError` naming the variable and its values otherwise.

    Args:
        environ (`Mapping[str, str]`, *optional*): The environment; `os.environ` by default.
    """
    value = environ.get(FREEZE_VARIABLE, "1")
    if value.strip() not in ("0", "1"):
        raise ValueError(f"{FREEZE_VARIABLE} must be 1 (freeze the transformer) or 0 (sample eagerly), got {value!r}.")
    return value.strip() == "1"


def serve_frozen(pipe: DiffusionPipeline) -> str:
    """Sample with the transformer compiled by inductor with its weights frozen into the graph
    (`pipe.enable_inductor_freezing()`), compiled now, before the first request; or eagerly where inductor cannot
    compile (no C++ compiler, say).

    The served weights never change, so the graphs compiled here serve every request: one for a batch of one image
    without guidance (dynamo specialises a batch of 1), and one for every larger batch (the batch is dynamic). Each
    request's pipeline shares them (`request_pipeline`), and they are compiled through one such pipeline, so the app
    never says it samples frozen when the model's code does not pass the graph on.

    Args:
        pipe (`LMLPPipeline`): The served pipeline, on the CPU.

    Returns:
        `str`: The start-up log's line saying how the app samples.
    """
    started = time.perf_counter()
    if not hasattr(pipe, "enable_inductor_freezing"):
        return f"Sampling eagerly: this pipeline's code cannot freeze the transformer ({UPDATE_CODE})."
    pipe.enable_inductor_freezing()
    warm_up = request_pipeline(pipe)
    if not getattr(warm_up, "inductor_freezing_enabled", False):
        pipe.disable_inductor_freezing()
        return f"Sampling eagerly: this pipeline's code does not share its frozen graph with requests ({UPDATE_CODE})."
    try:
        for guidance_scale in (1.0, DEFAULT_GUIDANCE):  # batches of 1, then of 2: (uncond | cond)
            warm_up("", num_inference_steps=1, guidance_scale=guidance_scale, output_type="latent")
    except Exception as error:  # whatever stops inductor here, the eager transformer samples the same images
        pipe.disable_inductor_freezing()
        # What the compiler raised, which dynamo wraps (`BackendCompilerFailed.inner_exception`).
        while (inner := getattr(error, "inner_exception", None) or error.__cause__) is not None:
            error = inner
        lines = str(error).strip().splitlines()
        cause = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
        return f"Sampling eagerly: inductor could not freeze the transformer here ({cause})."
    return (
        f"Sampling with the transformer frozen by inductor, compiled in {time.perf_counter() - started:.1f} s "
        f"({FREEZE_VARIABLE}=0 samples eagerly)."
    )


def request_pipeline(pipe: DiffusionPipeline) -> DiffusionPipeline:
    """The pipeline one request samples with: `pipe`'s modules in its dtype, and its frozen graph (`serve_frozen`),
    with a scheduler and a tokenizer of its own, its progress bar off.

    A fast tokenizer keeps its padding and truncation settings in its Rust object and sets them on every call: shared
    between threads, one request's unpadded call can land between another's settings and its encoding (seen as 9 and
    10 text tokens in one batch). So each request gets its own copy, as its own scheduler. The transformer and the
    dtype are passed, as diffusers' own `from_pipe` needs them for the code of a model pushed before the package's.

    Args:
        pipe (`LMLPPipeline`): The served pipeline.
    """
    call_pipe = type(pipe).from_pipe(
        pipe,
        transformer=pipe.transformer,
        scheduler=copy.deepcopy(pipe.scheduler),
        tokenizer=copy.deepcopy(pipe.tokenizer),
        dtype=pipe.dtype,
    )
    call_pipe.set_progress_bar_config(disable=True)
    return call_pipe


def make_generate_fn(pipe: DiffusionPipeline) -> Callable:
    """The UI's and the API's generate function for `pipe`.

    It validates the inputs first, so that a bad request never waits for a GPU; only the sampling is wrapped with
    `@spaces.GPU`. Each call samples with its own `LMLPPipeline` (`request_pipeline`: the same modules and frozen
    graph, a fresh scheduler and its own tokenizer; the scheduler's step state and the guidance scale live on the
    pipeline), so concurrent requests do not step on each other.

    Args:
        pipe (`LMLPPipeline`): The served pipeline, already on its device and in its dtype.

    Returns:
        `Callable`: `generate(prompt, negative_prompt, seed, randomize_seed, num_inference_steps, guidance_scale,
        num_images, progress)` -> (list of PIL images at the native size, the seed used).
    """

    @gpu
    def sample(request: GenerationRequest, seed: int, progress: gr.Progress) -> list[Image.Image]:
        call_pipe = request_pipeline(pipe)

        def report_step(_pipe, step: int, _timestep, callback_kwargs: dict) -> dict:
            progress((step + 1, request.num_inference_steps), desc="Denoising", unit="steps")
            return callback_kwargs

        progress((0, request.num_inference_steps), desc="Denoising", unit="steps")
        return call_pipe(
            request.prompt,
            negative_prompt=request.negative_prompt,
            num_inference_steps=request.num_inference_steps,
            guidance_scale=request.guidance_scale,
            num_images_per_prompt=request.num_images,
            # A CPU generator gives the same noise for a seed on every device.
            generator=torch.Generator("cpu").manual_seed(seed),
            callback_on_step_end=report_step,
        ).images

    def generate(
        prompt: str,
        negative_prompt: str,
        seed: int,
        randomize_seed: bool,
        num_inference_steps: int,
        guidance_scale: float,
        num_images: int,
        progress: gr.Progress = gr.Progress(),
    ) -> tuple[list[Image.Image], int]:
        request = validate_inputs(
            prompt,
            negative_prompt,
            seed,
            randomize_seed,
            num_inference_steps,
            guidance_scale,
            num_images,
            pipe=pipe,
        )
        for message in request.warnings:
            gr.Warning(message, title="Unknown words")
        seed = random.randint(0, MAX_SEED) if request.randomize_seed else request.seed
        return sample(request, seed, progress), seed

    return generate


def examples_for(info: str) -> list[str]:
    """The prompt examples for a model, by the world its panel says it was trained on."""
    if "emoji world" in info:
        return EMOJI_EXAMPLES
    return SHAPES_EXAMPLES if "shapes world" in info else GENERIC_EXAMPLES


def build_demo(pipes, source: str | None = None, queue_size: int | None = None, concurrency: int = 1):
    """The Space's `gr.Blocks`, queued; serve it with `launch(demo)`.

    Args:
        pipes (`LMLPPipeline` or `Mapping[str, LMLPPipeline]`): The pipeline to serve, or several by the name the
            model choice shows (each loaded from the folder or Hub id of that name, for its panel), the first opening;
            each already on its device and in its dtype.
        source (`str`, *optional*): Where a single pipeline was loaded from (for the model panel);
            `pipe.name_or_path` by default.
        queue_size (`int`, *optional*): Requests that may wait; more are refused with "Queue is full". Unbounded
            when None.
        concurrency (`int`, *optional*, defaults to 1): Requests that run at the same time.

    Returns:
        `gr.Blocks`: The app, with the API endpoint `/generate` returning (gallery images, seed used).
    """
    if not isinstance(pipes, Mapping):
        pipes = {source or pipes.name_or_path: pipes}
    names = list(pipes)
    infos = {name: describe_model(pipe, SHIPPED.get(name, name)) for name, pipe in pipes.items()}
    generators = {name: make_generate_fn(pipe) for name, pipe in pipes.items()}
    examples = {name: examples_for(info) for name, info in infos.items()}

    def generate(
        prompt, negative_prompt, seed, randomize_seed, num_inference_steps, guidance_scale, num_images,
        model=names[0], progress: gr.Progress = gr.Progress(),
    ):  # fmt: skip
        if model not in generators:
            raise invalid_input(f"The model must be one of {', '.join(map(repr, names))}, got {model!r}.")
        request = (prompt, negative_prompt, seed, randomize_seed, num_inference_steps, guidance_scale, num_images)
        return generators[model](*request, progress=progress)

    def choose(model: str):
        return (
            infos[model],
            gr.Dataset(samples=[[e] for e in examples[model]]),
            gr.Textbox(placeholder=examples[model][0]),
        )

    with gr.Blocks(title="diffusers-lmlp") as demo:
        gr.Markdown(
            "# diffusers-lmlp: attention-free MLP text-to-image\n"
            "A latent diffusion model whose backbone is a U-shaped lateralization MLP (L-MLP) or a MoE-MLP: no "
            "attention anywhere. Images come at the model's native size only."
        )
        model = gr.Radio(names, value=names[0], label="Model", visible=len(names) > 1, elem_id="model")
        with gr.Row():
            prompt = gr.Textbox(
                label="Prompt",
                placeholder=examples[names[0]][0],
                max_lines=2,
                max_length=MAX_PROMPT_CHARS,
                scale=4,
                elem_id="prompt",
            )
            run = gr.Button("Generate", variant="primary", scale=1, elem_id="generate")
        with gr.Row():
            with gr.Column(scale=3):
                gallery = gr.Gallery(
                    label="Images",
                    columns=2,
                    height=720,
                    object_fit="contain",
                    format="png",  # lossless: the pixels the model made
                    elem_id="gallery",
                )
            with gr.Column(scale=2):
                info = gr.Markdown(infos[names[0]], elem_id="model-info")
                with gr.Accordion("Advanced settings", open=False):
                    negative_prompt = gr.Textbox("", label="Negative prompt", max_lines=2, max_length=MAX_PROMPT_CHARS)
                    with gr.Row():
                        seed = gr.Slider(0, MAX_SEED, value=0, step=1, label="Seed")
                        randomize_seed = gr.Checkbox(value=True, label="Randomize seed")
                    num_inference_steps = gr.Slider(1, MAX_STEPS, value=DEFAULT_STEPS, step=1, label="Steps")
                    guidance_scale = gr.Slider(
                        0.0,
                        MAX_GUIDANCE,
                        value=DEFAULT_GUIDANCE,
                        step=0.1,
                        label="Guidance scale",
                        info="diffusers' g; the papers' s is g − 1 (≤ 1: no guidance)",
                    )
                    num_images = gr.Slider(1, MAX_IMAGES, value=MAX_IMAGES, step=1, label="Number of images")
        shown = gr.Examples(examples=[[example] for example in examples[names[0]]], inputs=[prompt])
        model.change(choose, inputs=[model], outputs=[info, shown.dataset, prompt], api_name=False)
        gr.on(
            triggers=[run.click, prompt.submit],
            fn=generate,
            inputs=[
                prompt,
                negative_prompt,
                seed,
                randomize_seed,
                num_inference_steps,
                guidance_scale,
                num_images,
                model,
            ],
            outputs=[gallery, seed],
            api_name="generate",
            # The inputs reach `validate_inputs` as sent: the sliders' own bounds checks would answer first, with
            # messages that do not name the input.
            preprocess=False,
        )
    demo.queue(max_size=queue_size, default_concurrency_limit=concurrency)
    return demo


def whole_number_setting(environ: Mapping[str, str], name: str, default: int | None) -> int | None:
    """The value of the setting `name` (an environment variable), a whole number of at least 1, or `default` when it
    is unset; raise `ValueError` naming the variable and its range otherwise."""
    value = environ.get(name)
    if value is None:
        return default
    if not value.strip().isdigit() or int(value) < 1:
        raise ValueError(f"{name} must be a whole number of at least 1, got {value!r}.")
    return int(value)


def queue_settings(environ: Mapping[str, str] = os.environ) -> tuple[int, int]:
    """The queue's size and concurrency from `LMLP_QUEUE_SIZE` and `LMLP_CONCURRENCY`.

    Args:
        environ (`Mapping[str, str]`, *optional*): The environment; `os.environ` by default.

    Returns:
        `tuple`: (requests that may wait, requests that run at once), each a whole number of at least 1.
    """
    queue_size = whole_number_setting(environ, "LMLP_QUEUE_SIZE", DEFAULT_QUEUE_SIZE)
    return queue_size, whole_number_setting(environ, "LMLP_CONCURRENCY", DEFAULT_CONCURRENCY)


def choose_cpu_threads(concurrency: int) -> tuple[int, str]:
    """How many CPU threads torch serves with, and why: `LMLP_NUM_THREADS`, else the `OMP_NUM_THREADS` you set, else
    the cores this process may run on, split between the `concurrency` requests that run at once (at least 1 each).

    Raises:
        `ValueError`: For an `LMLP_NUM_THREADS` that is not a whole number of at least 1.
    """
    given = whole_number_setting(os.environ, THREADS_VARIABLE, None)
    if given is not None:
        return given, THREADS_VARIABLE
    user = os.environ.get("OMP_NUM_THREADS", "").strip()
    if user.isdigit() and int(user) >= 1:
        return int(user), "OMP_NUM_THREADS"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    count = max(1, cores // concurrency)
    return count, "every core" if count == cores else f"{count} of {cores} cores"


def launch(demo: gr.Blocks, **server_options):
    """Serve the demo with the Space's settings: its CSS and the upload limit `MAX_FILE_SIZE`.

    Args:
        demo (`gr.Blocks`): The app from `build_demo`.
        **server_options: More `gr.Blocks.launch` arguments (`server_name`, `server_port`, `prevent_thread_lock`).

    Returns:
        `tuple`: What `gr.Blocks.launch` returns: (the FastAPI app, the local URL, the share URL).
    """
    return demo.launch(css=CSS, max_file_size=MAX_FILE_SIZE, **server_options)


class CannotServe(Exception):
    """The app cannot serve the model it is set up with; the message says what to change."""


def require_code(model: str) -> None:
    """Raise `CannotServe` unless the pipeline `model` ships the code that loads it without diffusers-lmlp.

    Only its `model_index.json` is read (from the Hub, or the folder): nothing of the repo runs. A repo pushed with
    `--with-code` names code files in it (`"_class_name": ["pipeline_lmlp", "LMLPPipeline"]`); one pushed without
    names the package (`"LMLPPipeline"`, `["diffusers_lmlp", "LMLPTransformer2DModel"]`), which is not installed.

    Args:
        model (`str`): A Hub repo id or a local pipeline folder.
    """
    model_index = DiffusionPipeline.load_config(model)
    class_name = model_index.get("_class_name")
    named = sorted(key for key, entry in model_index.items() if isinstance(entry, list) and entry[:1] == [PACKAGE])
    if not isinstance(class_name, list):
        named.insert(0, "_class_name")
    if not named:
        return
    repo = "REPO" if os.path.isdir(model) else model
    raise CannotServe(
        f"{model} has no code to load it without diffusers-lmlp, which is not installed here (its model_index.json "
        f"names the package: {', '.join(named)}). Push the model with its code: "
        f"`python -m diffusers_lmlp.hub push FOLDER {repo} --with-code`, FOLDER being the saved pipeline."
    )


def load_pipeline(model: str, dtype: torch.dtype) -> DiffusionPipeline:
    """A pipeline to serve, in `dtype`, on the CPU.

    With diffusers-lmlp installed, `LMLPPipeline.from_pretrained(model)` (which runs no code of the repo); the names
    of the shipped models (`SHIPPED`: emoji, shapes) load those. Without it, the model's own code: `require_code`
    checks that the repo has it, then `DiffusionPipeline.from_pretrained(model, trust_remote_code=True)` runs it.
    `model` is one of the Space's own `LMLP_MODEL`, which only the Space's owner sets: those are the repos whose code
    the app agrees to run.

    Args:
        model (`str`): A Hub repo id or a local pipeline folder (or, with the package, "emoji" or "shapes").
        dtype (`torch.dtype`): The weights' dtype.

    Returns:
        `DiffusionPipeline`: An `LMLPPipeline`, the package's or the repo's.
    """
    if LMLPPipeline is not None:
        return LMLPPipeline.from_pretrained(SHIPPED.get(model, model), dtype=dtype)
    require_code(model)
    return DiffusionPipeline.from_pretrained(model, dtype=dtype, use_safetensors=True, trust_remote_code=True)


def served_models(environ: Mapping[str, str] = os.environ) -> list[str]:
    """The models `LMLP_MODEL` names (comma-separated), else the shipped ones; raise `CannotServe` without either."""
    models = [model.strip() for model in environ.get("LMLP_MODEL", "").split(",") if model.strip()]
    if models or SHIPPED:
        return models or list(SHIPPED)
    raise CannotServe(
        "LMLP_MODEL is not set. Without diffusers-lmlp installed, the app serves model repos pushed with their code "
        "(`python -m diffusers_lmlp.hub push FOLDER REPO --with-code`): set LMLP_MODEL to those REPOs, comma-separated "
        "(on a Space, `python -m diffusers_lmlp.hub push-space` sets it). The shipped models need the package."
    )


def main() -> None:
    """Load the pipelines named by `LMLP_MODEL` (or the shipped emoji and shapes models) and serve them; exit with
    the reason when a setting is bad or a model cannot be served."""
    try:
        queue_size, concurrency = queue_settings()
        num_threads, reason = choose_cpu_threads(concurrency)
        freeze = freeze_setting()
    except ValueError as error:
        sys.exit(f"error: {error}")
    device, dtype = pick_device_and_dtype()
    if device == "cpu":
        torch.set_num_threads(num_threads)
        print(
            f"Serving on the CPU with {num_threads} thread(s) ({reason}; set {THREADS_VARIABLE} to change).",
            flush=True,
        )
    try:
        pipes = {model: load_pipeline(model, dtype).to(device) for model in served_models()}
    except CannotServe as error:
        sys.exit(f"error: {error}")
    for model, pipe in pipes.items():
        if device == "cpu":
            print(f"Serving {model}.", flush=True)
            print(serve_frozen(pipe) if freeze else f"Sampling eagerly ({FREEZE_VARIABLE}=0).", flush=True)
    launch(build_demo(pipes, queue_size=queue_size, concurrency=concurrency))


if __name__ == "__main__":
    main()
