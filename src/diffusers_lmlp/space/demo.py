"""The demo Space's request checks, model panel and frozen serving, which its `app.py` builds its UI on (`push-space`
vendors the package beside it). Every input is checked on the server, since API calls skip the sliders."""

import copy
import math
import os
import time
from typing import NamedTuple

import gradio as gr
from huggingface_hub import ModelCard
from huggingface_hub.errors import EntryNotFoundError, HFValidationError

from ..models import family_of
from ..pipelines.pipeline_lmlp import LMLPPipeline
from ..sampling import GUIDANCE_SCALE
from ..worlds import WORLDS


MAX_SEED = 2**31 - 1  # np.iinfo(np.int32).max, the Space convention
MAX_PROMPT_CHARS, MAX_STEPS, MAX_IMAGES, MAX_GUIDANCE = 400, 100, 4, 10
MAX_UNKNOWN_SHARE = 0.5  # a prompt with more of its words outside a closed vocabulary is refused; fewer, flagged


def shipped_pipelines() -> dict[str, str]:
    """The models that ship with the package (emoji first), where their files came with it: a vendored copy has none."""
    paths = {name: WORLDS[name].pipeline_path for name in ("emoji", "shapes")}
    return {name: str(path) for name, path in paths.items() if path.is_dir()}


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


def describe_model(pipe: LMLPPipeline, source: str) -> str:
    """The model panel (Markdown): backbone, size, resolution, text length, vocabulary and training data."""
    try:
        card = ModelCard.load(os.path.join(source, "README.md") if os.path.isdir(source) else source)
    except (OSError, EntryNotFoundError, HFValidationError):  # no card, no Hub, or not a repo id
        card = None
    lines = card.text.splitlines() if card else []
    folder_name = os.path.basename(os.path.normpath(source))
    title = next((line[2:].strip() for line in lines if line.startswith("# ")), folder_name)
    trained = [line.removeprefix("- Training:").strip() for line in lines if line.startswith("- Training:")]
    data = ", ".join(f"`{name}`" for name in card.data.datasets) if card and card.data.datasets else None
    data = data or (
        trained[0] if trained else "not recorded" + (" in the model card" if card else " (no model card found)")
    )
    backbone, config = pipe.transformer, pipe.transformer.config
    label, details = family_of(backbone).label, family_of(backbone).details
    shipped = [n for n, p in shipped_pipelines().items() if os.path.isdir(source) and os.path.samefile(source, p)]
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


def serve_frozen(pipe: LMLPPipeline) -> str:
    """Compile the transformer now with its weights frozen in (`enable_inductor_freezing`), through a request's
    pipeline, for batches of 1 and 2; sample eagerly where inductor cannot. Returns the log line."""
    started = time.perf_counter()
    pipe.enable_inductor_freezing()
    warm_up = request_pipeline(pipe)
    try:
        for guidance_scale in (1.0, GUIDANCE_SCALE):  # batches of 1, then of 2: (uncond | cond)
            warm_up("", num_inference_steps=1, guidance_scale=guidance_scale, output_type="latent")
    except Exception as error:  # whatever stops inductor, the eager transformer samples the same images
        pipe.disable_inductor_freezing()
        while (inner := getattr(error, "inner_exception", None) or error.__cause__) is not None:  # dynamo wraps it
            error = inner
        cause = ": ".join([type(error).__name__, *str(error).strip().splitlines()[:1]])
        return f"Sampling eagerly: inductor could not freeze the transformer here ({cause})."
    seconds = time.perf_counter() - started
    return f"Sampling with the transformer frozen by inductor, compiled in {seconds:.1f} s."


def request_pipeline(pipe: LMLPPipeline) -> LMLPPipeline:
    """`pipe`'s modules and frozen graph with its own scheduler and tokenizer: a fast tokenizer sets its padding on
    every call, so one shared between requests can pad one batch by another's settings."""
    own = dict(scheduler=copy.deepcopy(pipe.scheduler), tokenizer=copy.deepcopy(pipe.tokenizer))
    call_pipe = type(pipe).from_pipe(pipe, transformer=pipe.transformer, dtype=pipe.dtype, **own)
    call_pipe.set_progress_bar_config(disable=True)
    return call_pipe
