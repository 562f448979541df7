"""`LMLPPipeline`: text-to-image sampling with an L-MLP or MoE-MLP backbone, the SD VAE, CLIP and DPM-Solver++.

The sampling setup is the papers' (the U-ViT MS-COCO recipe that both L-MLP and MoE-MLP use, baofff/U-ViT's
`configs/mscoco_uvit_small.py` and `sample_t2i_discrete.py`):

| reference                                       | here                                                          |
|-------------------------------------------------|---------------------------------------------------------------|
| SD betas, √-linear 0.00085 → 0.012, 1000 steps  | `default_scheduler()`: `beta_schedule="scaled_linear"`        |
| DPM-Solver with `predict_x0=True`, 50 steps     | `algorithm_type="dpmsolver++"`, `num_inference_steps=50`      |
| network timestep n ∈ 1..1000                    | the backbone embeds the scheduler's t (0..999) as t + 1       |
| ε = ε_c + s·(ε_c − ε_u), null context CLIP("")  | `guidance_scale` g = s + 1; `negative_prompt` defaults to ""  |
| CLIP ViT-L/14 last hidden state, 77 tokens      | `text_encoder(input_ids)[0]`, tokenised to `text_seq_len`     |
| latents × 0.23010 (COCO)                        | `vae.config.scaling_factor` (and `shift_factor`)              |

Its checks live in `checks.py` (components, `__call__`'s arguments), `schedulers.py` (which schedulers can sample
it) and `loading.py` (`from_pretrained`); how it reads a folder pushed with `--with-code` in `model_index.py`.
"""

import inspect
import os
from collections.abc import Callable
from typing import Any, Self

import torch
from diffusers import (
    AutoencoderKL,
    DiffusionPipeline,
    ImagePipelineOutput,
    ModelMixin,
    SchedulerMixin,
)
from diffusers.callbacks import MultiPipelineCallbacks, PipelineCallback
from diffusers.image_processor import VaeImageProcessor
from diffusers.utils import logging, replace_example_docstring
from diffusers.utils.torch_utils import is_compiled_module, randn_tensor
from transformers import CLIPTextModel, CLIPTokenizer

from ..exports import public
from ..models.casting import no_empty_fp32_warning
from ..models.quantized import check_float32_beside_quantized_layers
from ..models.saving import check_storable, local_paths_left_out
from ..sampling import GUIDANCE_SCALE, NUM_INFERENCE_STEPS
from .checks import (
    _check_components,
    _check_guidance,
    _check_images,
    _check_prompts,
    _check_steps,
    _check_text_states,
    _raise_if_not_finite,
    _set_schedule,
)
from .freezing import FrozenTransformer, check_freezable
from .loading import (
    _folder_view,
    _hub_snapshot,
    _refuse_pickled_weights,
    _refuse_strict,
    _refuse_unpickling,
    _require_component_folders,
)
from .lora import LMLPLoraLoaderMixin
from .model_index import package_model_index
from .schedulers import check_scheduler, default_scheduler  # noqa: F401 (default_scheduler: its former home)
from .vocabulary import describe_vocabulary, prompt_words, unknown_words


logger = logging.get_logger(__name__)

OUTPUT_TYPES = ("pil", "np", "pt", "latent")

EXAMPLE_DOC_STRING = """
    Examples:
        ```py
        >>> import torch
        >>> from diffusers_lmlp import LMLPPipeline

        >>> pipe = LMLPPipeline.from_pretrained("<user>/<lmlp-repo>")  # a Hub repo id or a local folder
        >>> generator = torch.Generator().manual_seed(0)
        >>> image = pipe("a red circle on a blue square", guidance_scale=2.0, generator=generator).images[0]
        >>> image.save("red_circle.png")
        ```
"""


@public
class LMLPPipeline(DiffusionPipeline, LMLPLoraLoaderMixin):
    """Text-to-image generation with an attention-free MLP backbone, [L-MLP](https://arxiv.org/abs/2405.16098)
    or MoE-MLP, in the latent space of the Stable Diffusion VAE, conditioned on CLIP text states.

    The backbone mixes a fixed number of tokens L = 1 + text_seq_len + (sample_size / patch_size)², so a pipeline
    generates at one size only: `transformer.config.sample_size * vae_scale_factor` (256×256 for the papers' F2).

    Guidance: `guidance_scale` g follows diffusers, ε = ε_u + g·(ε_c − ε_u). The papers (and the U-ViT code) write
    ε = ε_c + s·(ε_c − ε_u), so g = s + 1: the reference COCO setting s = 1 is `guidance_scale=2.0`, the default.

    Parameters:
        vae ([`AutoencoderKL`]): Encodes images to latents and decodes them back. Its `config.scaling_factor` (and
            `shift_factor`, when set) must be the one the backbone was trained with: the papers' COCO models use
            0.23010, not Stable Diffusion's 0.18215.
        text_encoder ([`~transformers.CLIPTextModel`]): Frozen CLIP text encoder (`openai/clip-vit-large-patch14`
            in the papers); its last hidden state conditions the backbone.
        tokenizer ([`~transformers.CLIPTokenizer`]): CLIP tokenizer whose `model_max_length` is the backbone's
            `text_seq_len`.
        transformer ([`UShapedMixerModel`]): The ε-prediction backbone, a model of any registered block family
            (`LMLPTransformer2DModel`, `MoEMLPModel`, `UViTTransformer2DModel`, ...; see `diffusers_lmlp.FAMILIES`).
        scheduler ([`~schedulers.SchedulerMixin`]): A DDPM-family diffusers scheduler on the training schedule,
            reading ε and not clipping the latents (`check_scheduler` refuses others when the pipeline is called);
            `default_scheduler()` is the papers' DPM-Solver++ setup.
    """

    model_cpu_offload_seq = "text_encoder->transformer->vae"
    _callback_tensor_inputs = ["latents", "prompt_embeds", "negative_prompt_embeds"]

    def __init__(
        self,
        vae: AutoencoderKL,
        text_encoder: CLIPTextModel,
        tokenizer: CLIPTokenizer,
        # Typed as its diffusers base: a pipeline pushed with --with-code ships its backbone in another file than
        # this one, and diffusers checks the component against this annotation.
        transformer: ModelMixin,
        scheduler: SchedulerMixin,
    ):
        super().__init__()
        self.register_modules(
            vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer, scheduler=scheduler
        )
        _check_components(
            getattr(self, "transformer", None),
            getattr(self, "text_encoder", None),
            getattr(self, "tokenizer", None),
            getattr(self, "vae", None),
        )
        self.vae_scale_factor = 2 ** (len(self.vae.config.block_out_channels) - 1) if getattr(self, "vae", None) else 8
        self.image_processor = VaeImageProcessor(vae_scale_factor=self.vae_scale_factor)
        self._inductor_freezing: FrozenTransformer | None = None

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, **kwargs) -> Self:
        """Load a saved pipeline from a local directory or a Hub repo id, like `DiffusionPipeline.from_pretrained`.

        Weights are read from safetensors files only; nothing is ever unpickled. A Hub repo id is first fetched with
        `huggingface_hub.snapshot_download` (configs, tokenizer files and `*.safetensors` only), honouring
        `cache_dir`, `revision`, `token`, `force_download`, `local_files_only` and `HF_HUB_OFFLINE`, and then the
        local snapshot is loaded.

        Why: for a repo id, diffusers 0.42's `DiffusionPipeline.download` refuses any component whose library in
        `model_index.json` is not diffusers, transformers or a `<component>/<library>.py` file in the repo, which
        rules out `["diffusers_lmlp", "LMLPTransformer2DModel"]`. Local folders skip that check, and the classes
        resolve because this module has imported `diffusers_lmlp`.

        The backbone refuses a checkpoint that does not fill every one of its weights (a missing tensor, a folder
        of another family's class): see `UShapedMixerModel.from_pretrained`, whose `strict=False` loads it anyway.
        diffusers passes no `strict` to a component, so load such a transformer on its own and pass it
        (`transformer=...`).

        A folder or repo pushed with `--with-code` (`diffusers_lmlp.hub.remote_code`) loads with this package's
        classes, and none of the code files it ships runs: its `model_index.json` names them (`"_class_name":
        ["pipeline_lmlp", "LMLPPipeline"]`), and each such entry of a class this package exports is read as this
        package's.

        Args:
            pretrained_model_name_or_path (`str` or `os.PathLike`): A local directory written by `save_pretrained`, or
                a Hub repo id such as `"user/repo"`.
            **kwargs: Everything `DiffusionPipeline.from_pretrained` accepts, such as `dtype` (or the deprecated
                `torch_dtype`), `variant`, `device_map` or a component to use instead of the saved one
                (`transformer=...`). `use_safetensors` may only be `True`.

        Returns:
            `LMLPPipeline`: The loaded pipeline.

        Raises:
            `FileNotFoundError`: `pretrained_model_name_or_path` is neither a folder nor a Hub repo id (a path that
                does not exist), or names a repo the Hub does not have (`NotADirectoryError`: it is a file).
            `huggingface_hub.errors.LocalEntryNotFoundError`: A repo id that is not in the huggingface_hub cache
                while the Hub cannot be reached (`HF_HUB_OFFLINE`, `local_files_only=True`, no network).
            `ValueError`: Pickled weights only, `use_safetensors=False`, `strict`, a component folder that is missing
                or a backbone checkpoint that does not match its class.
        """
        _refuse_unpickling(kwargs)
        path = os.fspath(pretrained_model_name_or_path)
        folder = path if os.path.isdir(path) else _hub_snapshot(pretrained_model_name_or_path, kwargs)
        saved_index = cls.load_config(folder)

        # With-code entries: [file stem, class] where this package exports the class. diffusers would run the file
        # (with trust_remote_code=True); they become [package, class] instead, in a view of the folder that links
        # every file but model_index.json.
        model_index = package_model_index(saved_index)
        with_code = model_index != saved_index
        _refuse_strict(kwargs, model_index, path)
        _require_component_folders(folder, model_index, passed=set(kwargs))
        if folder == path:
            _refuse_pickled_weights(folder, model_index)
        if not with_code:
            pipeline = super().from_pretrained(folder, **kwargs)
        else:
            with _folder_view(folder, model_index) as view:
                pipeline = super().from_pretrained(view, **kwargs)
        if folder != path or with_code:
            pipeline.register_to_config(_name_or_path=path)
        return pipeline

    @classmethod
    def from_pipe(cls, pipeline: DiffusionPipeline, **kwargs) -> DiffusionPipeline:
        """A new pipeline of this class that shares `pipeline`'s components, as diffusers' `from_pipe` makes it, with
        the components passed in `kwargs` in their place.

        Three things differ from diffusers 0.42's own:

        - **The transformer is shared**, whatever its family. diffusers switches a model over only when its class is
          the exact class that `__init__` annotates, and the backbone is annotated as `ModelMixin` (any family, and
          the classes a `--with-code` repo ships); diffusers would leave it out, then refuse the missing component.
        - **The dtype stays `pipeline`'s** unless `dtype` (or `torch_dtype`) is given. diffusers 0.42 casts the new
          pipeline, and so the components it shares with `pipeline`, to float32 by default, a regression
          (huggingface/diffusers#12754).
        - **The frozen graph is shared.** When `pipeline` samples with the transformer frozen
          (`enable_inductor_freezing`), the new pipeline samples with the same graph, compiled once, where freezing
          afresh would compile again. Both check the weights before every call, so a change made through either
          (a LoRA loaded, `load_state_dict`) freezes the shared graph again.

        Args:
            pipeline (`DiffusionPipeline`): The pipeline whose components the new one shares.
            **kwargs: What diffusers' `from_pipe` takes: components to use instead of `pipeline`'s (a scheduler of
                its own, say), config values, `dtype`.

        Returns:
            `LMLPPipeline`: The new pipeline.
        """
        transformer = getattr(pipeline, "transformer", None)
        if isinstance(transformer, ModelMixin):
            kwargs.setdefault("transformer", transformer)
        if kwargs.get("dtype") is None and kwargs.get("torch_dtype") is None:
            kwargs["dtype"] = pipeline.dtype
        with no_empty_fp32_warning():  # `from_pipe` casts every model it shares, to the dtype it already has
            new = super().from_pipe(pipeline, **kwargs)
        freezing = getattr(pipeline, "_inductor_freezing", None)
        if freezing is not None and getattr(new, "transformer", None) is pipeline.transformer:
            new._inductor_freezing = freezing
        return new

    def to(self, *args, **kwargs) -> Self:
        """`DiffusionPipeline.to` (a device, a dtype or both), without diffusers 0.42's warning, once per model, that
        the model has modules to keep in float32 when it names none (`models/casting.py`).

        Args:
            *args, **kwargs: What `DiffusionPipeline.to` takes.
        """
        with no_empty_fp32_warning():
            return super().to(*args, **kwargs)

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs) -> None:
        """Save the pipeline to a folder (and push it with `push_to_hub=True`), as `DiffusionPipeline.save_pretrained`
        does, but without the local folders its components were loaded from: diffusers writes each one's absolute
        path, the username in it, into its config (`_name_or_path`). A Hub repo id stays (`models/saving.py`).

        A `Path` may be given with `push_to_hub=True` too: diffusers 0.42 splits `save_directory` as a string for the
        default `repo_id`, even when `repo_id` is given.

        Args:
            save_directory (`str` or `os.PathLike`): The folder; made if missing.
            **kwargs: What `DiffusionPipeline.save_pretrained` takes (`safe_serialization`, `variant`,
                `max_shard_size`, `push_to_hub`, `repo_id`, ...).

        Raises:
            `ValueError`: Before anything is written, when a component holds what safetensors cannot store (torch's
                quantized layers: `check_storable`).
        """
        for component in self.components.values():
            if isinstance(component, torch.nn.Module):
                check_storable(getattr(component, "_orig_mod", component))
        with local_paths_left_out(self, *self.components.values()):
            super().save_pretrained(os.fspath(save_directory), **kwargs)

    @property
    def guidance_scale(self) -> float:
        return self._guidance_scale

    @property
    def do_classifier_free_guidance(self) -> bool:
        return self._guidance_scale > 1

    @property
    def num_timesteps(self) -> int:
        return self._num_timesteps

    @property
    def interrupt(self) -> bool:
        return self._interrupt

    @property
    def native_size(self) -> int:
        """Side in pixels of the only image size the backbone supports: `sample_size * vae_scale_factor`."""
        return self.transformer.config.sample_size * self.vae_scale_factor

    def enable_inductor_freezing(self) -> None:
        """Sample with the transformer compiled by inductor with freezing: its weights become constants of the graph,
        so each Linear's weight is pre-packed and its bias and GELU are fused into the GEMM. The fastest way to sample
        on a CPU (F2-deep's forward ran 1.28× as fast as under `torch.compile` in bf16, 2.07× in float32, on an
        `avx512_bf16` EPYC); the first call compiles (16–32 s for the papers' models on 2 cores), and the frozen graph
        holds its own packed copy of the weights. One graph serves every batch size, and every pipeline made from this
        one with `from_pipe`.

        Before every call the pipeline checks the transformer's weights, and freezes them again, compiling anew, if
        anything changed them (a LoRA loaded, fused or rescaled, `load_state_dict`, `.to(...)`): a frozen graph never
        samples with stale weights. `pipe.transformer` itself is left as it is, uncompiled, so hooks, adapters and
        `save_pretrained` work on it as before. Not for a transformer compiled already (`torch.compile`), offloaded
        with `enable_model_cpu_offload` (its weights move on every call, so it would compile on every call), or
        quantized with torch's `quantize_dynamic` (its int8 layers break the graph: it samples faster eagerly).
        """
        transformer = getattr(self, "transformer", None)
        if transformer is None:
            raise ValueError("enable_inductor_freezing() needs a transformer; this pipeline has none.")
        if is_compiled_module(transformer):
            raise ValueError(
                "enable_inductor_freezing() compiles the transformer itself, and this one is compiled already "
                "(torch.compile). Pass the uncompiled module (`pipe.transformer = pipe.transformer._orig_mod`) first."
            )
        if hasattr(transformer, "_hf_hook"):
            raise ValueError(
                "enable_inductor_freezing() does not work with model offloading (enable_model_cpu_offload or a "
                "device_map): the offload hooks move the weights on every call, which would recompile on every call. "
                "Remove the offloading (`pipe.remove_all_hooks()`) or sample without freezing."
            )
        check_freezable(transformer)
        self._inductor_freezing = FrozenTransformer()

    def disable_inductor_freezing(self) -> None:
        """Sample with `pipe.transformer` itself again, as it is."""
        self._inductor_freezing = None

    @property
    def inductor_freezing_enabled(self) -> bool:
        """Whether calls sample with the transformer frozen by inductor (`enable_inductor_freezing`)."""
        return self._inductor_freezing is not None

    def enable_vae_slicing(self) -> None:
        """Decode the batch one image at a time (less memory for large batches)."""
        self.vae.enable_slicing()

    def disable_vae_slicing(self) -> None:
        """Decode the whole batch at once again."""
        self.vae.disable_slicing()

    def enable_vae_tiling(self) -> None:
        """Decode in overlapping tiles (less memory for large images)."""
        self.vae.enable_tiling()

    def disable_vae_tiling(self) -> None:
        """Decode in one piece again."""
        self.vae.disable_tiling()

    # The vocabulary of the tokenizer, as methods: a pipeline loaded from a repo's remote code (`push --with-code`)
    # carries them without diffusers-lmlp installed (the Space's app uses them). See `pipelines/vocabulary.py`.
    def describe_vocabulary(self) -> str | None:
        """The words of the tokenizer's closed vocabulary as one line of text, or None for an open one (CLIP's)."""
        return describe_vocabulary(self.tokenizer)

    def prompt_words(self, prompt: str) -> list[str]:
        """The words of `prompt` as the tokenizer sees them (normalised, punctuation left out), repeats included.

        Args:
            prompt (`str`): The text.
        """
        return prompt_words(self.tokenizer, prompt)

    def unknown_words(self, prompt: str) -> list[str]:
        """The words of `prompt` outside the tokenizer's closed vocabulary, each once; none for an open vocabulary.

        Args:
            prompt (`str`): The text.
        """
        return unknown_words(self.tokenizer, prompt)

    def _warn_unknown_words(self, texts: list[str], name: str) -> None:
        """Log a warning for each distinct text with words outside a closed vocabulary (see `known_words`)."""
        for text in dict.fromkeys(texts):
            unknown = unknown_words(self.tokenizer, text)
            if unknown:
                logger.warning(
                    f"The {name} {text!r} has words outside the tokenizer's vocabulary: "
                    f"{', '.join(map(repr, unknown))}. This tokenizer has whole-word tokens for a closed list of "
                    "words only and spells any other word byte by byte, into tokens the model was not trained on, "
                    "so these words do not steer the image. Use only the known words: "
                    "`diffusers_lmlp.known_words(pipe.tokenizer)` lists them."
                )

    def _encode_text(self, texts: list[str], device: torch.device, name: str = "prompt") -> torch.Tensor:
        """CLIP's last hidden state of each text, tokenised to `model_max_length` with padding and truncation.

        Warns (once per distinct text) about words outside a closed vocabulary and about truncated texts.

        Args:
            texts (`list[str]`): The texts.
            device (`torch.device`): Device of the returned states.
            name (`str`, *optional*, defaults to `"prompt"`): What the texts are, for the warnings.

        Returns:
            `torch.Tensor`: (len(texts), model_max_length, hidden_size) text states.
        """
        self._warn_unknown_words(texts, name)
        max_length = self.tokenizer.model_max_length
        for text, ids in zip(texts, self.tokenizer(texts, verbose=False).input_ids):
            if len(ids) > max_length:
                dropped = self.tokenizer.decode(ids[max_length - 1 : -1])  # the truncated ids keep bos ... eos
                logger.warning(
                    f"The {name} {text!r} is longer than the {max_length} tokens the text encoder takes and was "
                    f"truncated; this part was dropped: {dropped!r}"
                )
        input_ids = self.tokenizer(
            texts, padding="max_length", max_length=max_length, truncation=True, return_tensors="pt"
        ).input_ids  # (B, T)
        return self.text_encoder(input_ids.to(device))[0]  # (B, T, hidden_size)

    def encode_prompt(
        self,
        prompt: str | list[str] | None,
        device: torch.device,
        num_images_per_prompt: int = 1,
        do_classifier_free_guidance: bool = True,
        negative_prompt: str | list[str] | None = None,
        prompt_embeds: torch.Tensor | None = None,
        negative_prompt_embeds: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Encode the prompts (and, for guidance, the unconditional context) into CLIP text states.

        Args:
            prompt (`str` or `list[str]`, *optional*): The prompts; ignored when `prompt_embeds` is given.
            device (`torch.device`): Device of the returned states.
            num_images_per_prompt (`int`, *optional*, defaults to 1): Repeats of each prompt's states.
            do_classifier_free_guidance (`bool`, *optional*, defaults to `True`): Also return the unconditional states.
            negative_prompt (`str` or `list[str]`, *optional*): The unconditional prompts; `""` (the reference's null
                context) when not given.
            prompt_embeds (`torch.Tensor`, *optional*): (B, T, D) precomputed text states.
            negative_prompt_embeds (`torch.Tensor`, *optional*): (B, T, D) precomputed unconditional states.

        Returns:
            `tuple`: `prompt_embeds` (B·num_images_per_prompt, T, D) and `negative_prompt_embeds` of the same shape,
            or `None` without guidance.
        """
        if prompt_embeds is None:
            prompt_embeds = self._encode_text([prompt] if isinstance(prompt, str) else prompt, device)  # (B, T, D)
        batch_size = prompt_embeds.shape[0]
        if do_classifier_free_guidance and negative_prompt_embeds is None:
            negative_prompt = "" if negative_prompt is None else negative_prompt
            negatives = [negative_prompt] * batch_size if isinstance(negative_prompt, str) else negative_prompt
            negative_prompt_embeds = self._encode_text(negatives, device, name="negative prompt")  # (B, T, D)

        prompt_embeds = prompt_embeds.to(device).repeat_interleave(num_images_per_prompt, dim=0)  # (B·n, T, D)
        if negative_prompt_embeds is not None:
            negative_prompt_embeds = negative_prompt_embeds.to(device).repeat_interleave(num_images_per_prompt, dim=0)
        return prompt_embeds, negative_prompt_embeds

    def check_inputs(
        self,
        prompt: str | list[str] | None,
        height: int,
        width: int,
        num_inference_steps: int,
        timesteps: list[int] | None,
        sigmas: list[float] | None,
        guidance_scale: float,
        negative_prompt: str | list[str] | None,
        num_images_per_prompt: int,
        generator: torch.Generator | list[torch.Generator] | None,
        latents: torch.Tensor | None,
        prompt_embeds: torch.Tensor | None,
        negative_prompt_embeds: torch.Tensor | None,
        output_type: str,
        callback_on_step_end_tensor_inputs: list[str],
    ) -> int:
        """Validate every argument of `__call__` before any compute.

        Returns:
            `int`: The number of prompts B.
        """
        can_encode = self.tokenizer is not None and self.text_encoder is not None
        batch_size = _check_prompts(prompt, prompt_embeds, can_encode)
        config = self.transformer.config
        expected_embeds = (config.text_seq_len, config.text_embed_dim)
        _check_text_states(batch_size, expected_embeds, prompt_embeds, negative_prompt, negative_prompt_embeds)
        _check_guidance(guidance_scale, negative_prompt_embeds, self.text_encoder is not None)
        if height != self.native_size or width != self.native_size:
            raise ValueError(
                f"This pipeline generates {self.native_size}×{self.native_size} images only (sample_size="
                f"{config.sample_size} latents × VAE factor {self.vae_scale_factor}), got height={height}, "
                f"width={width}. The backbone mixes a fixed number of tokens (L = {self.transformer.seq_len}), so "
                "leave height and width unset, or resize the result."
            )
        check_scheduler(self.scheduler)
        check_float32_beside_quantized_layers(self.transformer)
        _check_steps(self.scheduler, num_inference_steps, timesteps, sigmas)
        _check_images(batch_size, num_images_per_prompt, generator, latents, self._latents_shape)
        if output_type not in OUTPUT_TYPES:
            raise ValueError(f"`output_type` must be one of {OUTPUT_TYPES}, got {output_type!r}.")
        unknown = set(callback_on_step_end_tensor_inputs) - set(self._callback_tensor_inputs)
        if unknown:
            raise ValueError(
                f"`callback_on_step_end_tensor_inputs` may only name {self._callback_tensor_inputs}, got "
                f"{sorted(unknown)}."
            )
        return batch_size

    def _latents_shape(self, num_images: int) -> tuple[int, int, int, int]:
        config = self.transformer.config
        return (num_images, config.in_channels, config.sample_size, config.sample_size)

    def prepare_latents(
        self,
        num_images: int,
        dtype: torch.dtype,
        device: torch.device,
        generator: torch.Generator | list[torch.Generator] | None,
        latents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Draw the initial noise (or take the given `latents`) and scale it by the scheduler's initial sigma.

        Returns:
            `torch.Tensor`: (num_images, in_channels, sample_size, sample_size) initial latents.
        """
        if latents is None:
            latents = randn_tensor(self._latents_shape(num_images), generator=generator, device=device, dtype=dtype)
        latents = latents.to(device=device, dtype=dtype)
        return latents * self.scheduler.init_noise_sigma

    @torch.no_grad()
    @replace_example_docstring(EXAMPLE_DOC_STRING)
    def __call__(
        self,
        prompt: str | list[str] | None = None,
        negative_prompt: str | list[str] | None = None,
        height: int | None = None,
        width: int | None = None,
        num_inference_steps: int = NUM_INFERENCE_STEPS,
        timesteps: list[int] | None = None,
        sigmas: list[float] | None = None,
        guidance_scale: float = GUIDANCE_SCALE,
        num_images_per_prompt: int = 1,
        generator: torch.Generator | list[torch.Generator] | None = None,
        latents: torch.Tensor | None = None,
        prompt_embeds: torch.Tensor | None = None,
        negative_prompt_embeds: torch.Tensor | None = None,
        output_type: str = "pil",
        return_dict: bool = True,
        callback_on_step_end: Callable[["LMLPPipeline", int, int, dict[str, Any]], dict[str, Any]]
        | PipelineCallback
        | MultiPipelineCallbacks
        | None = None,
        callback_on_step_end_tensor_inputs: list[str] = ["latents"],
    ) -> ImagePipelineOutput | tuple:
        """Generate images from text.

        Args:
            prompt (`str` or `list[str]`, *optional*): The prompt(s); or pass `prompt_embeds`. A warning names the
                words of a prompt outside a closed vocabulary, such as the shapes world's (`known_words`).
            negative_prompt (`str` or `list[str]`, *optional*): What to guide away from; defaults to `""`, the
                reference's unconditional context. Ignored when `guidance_scale <= 1`.
            height (`int`, *optional*): Image height; defaults to, and must equal, `native_size`.
            width (`int`, *optional*): Image width; defaults to, and must equal, `native_size`.
            num_inference_steps (`int`, *optional*, defaults to 50): Denoising steps (50 in both papers), from 1 to
                the scheduler's `num_train_timesteps - 1` (999).
            timesteps (`list[int]`, *optional*): Custom timesteps, for schedulers whose `set_timesteps` accepts them;
                overrides `num_inference_steps`. Non-empty, strictly decreasing integers in
                [0, `num_train_timesteps`).
            sigmas (`list[float]`, *optional*): Custom sigmas, for schedulers whose `set_timesteps` accepts them;
                overrides `num_inference_steps`. Non-empty, strictly decreasing, finite and >= 0.
            guidance_scale (`float`, *optional*, defaults to 2.0): Classifier-free guidance in diffusers' convention,
                ε = ε_u + g·(ε_c − ε_u). The papers' scale s is g − 1 (their COCO setting s = 1 is g = 2). Must be
                finite. Any `guidance_scale <= 1` means no guidance, as in every diffusers pipeline: the
                unconditional pass is skipped entirely and ε = ε_c, exactly as with g = 1 (so 0.5 does not weaken
                the prompt, and 0 does not sample unconditionally).
            num_images_per_prompt (`int`, *optional*, defaults to 1): Images per prompt.
            generator (`torch.Generator` or `list[torch.Generator]`, *optional*): Seeds the initial noise; a list
                needs one generator per image.
            latents (`torch.Tensor`, *optional*): (B·num_images_per_prompt, C, sample_size, sample_size) initial
                noise, e.g. to reuse one noise for several prompts.
            prompt_embeds (`torch.Tensor`, *optional*): (B, text_seq_len, text_embed_dim) precomputed text states.
            negative_prompt_embeds (`torch.Tensor`, *optional*): (B, text_seq_len, text_embed_dim) precomputed
                unconditional states.
            output_type (`str`, *optional*, defaults to `"pil"`): `"pil"` (list of `PIL.Image`), `"np"` (B, H, W, 3)
                array in [0, 1], `"pt"` (B, 3, H, W) tensor in [0, 1], or `"latent"` (the undecoded, scaled
                latents).
            return_dict (`bool`, *optional*, defaults to `True`): Return an `ImagePipelineOutput` rather than a
                tuple.
            callback_on_step_end (`Callable`, `PipelineCallback` or `MultiPipelineCallbacks`, *optional*): Called
                after every step as `callback_on_step_end(pipe, step, timestep, callback_kwargs)`; the tensors it
                returns in a dict replace the pipeline's.
            callback_on_step_end_tensor_inputs (`list[str]`, *optional*, defaults to `["latents"]`): Which of
                `latents`, `prompt_embeds` and `negative_prompt_embeds` go into `callback_kwargs`.

        Examples:

        Returns:
            [`~pipelines.ImagePipelineOutput`] or `tuple`: The images, as `ImagePipelineOutput(images=...)` or
            `(images,)`.

        Raises:
            `ValueError`: An argument is invalid; raised by `check_inputs` before any model runs.
            `FloatingPointError`: The sampled latents or the decoded images hold NaN or inf (for example a float16
                overflow); a NaN image is never returned.
        """
        if isinstance(callback_on_step_end, PipelineCallback | MultiPipelineCallbacks):
            callback_on_step_end_tensor_inputs = callback_on_step_end.tensor_inputs
        height = height or self.native_size
        width = width or self.native_size
        batch_size = self.check_inputs(
            prompt,
            height,
            width,
            num_inference_steps,
            timesteps,
            sigmas,
            guidance_scale,
            negative_prompt,
            num_images_per_prompt,
            generator,
            latents,
            prompt_embeds,
            negative_prompt_embeds,
            output_type,
            callback_on_step_end_tensor_inputs,
        )
        self._guidance_scale = guidance_scale
        self._interrupt = False
        device = self._execution_device
        dtype = self.transformer.dtype
        num_inference_steps = _set_schedule(self.scheduler, num_inference_steps, timesteps, sigmas, device)
        timesteps = self.scheduler.timesteps
        self._num_timesteps = len(timesteps)

        prompt_embeds, negative_prompt_embeds = self.encode_prompt(
            prompt,
            device,
            num_images_per_prompt,
            self.do_classifier_free_guidance,
            negative_prompt,
            prompt_embeds,
            negative_prompt_embeds,
        )  # (B·n, T, D) each
        prompt_embeds = prompt_embeds.to(dtype)
        if negative_prompt_embeds is not None:
            negative_prompt_embeds = negative_prompt_embeds.to(dtype)

        latents = self.prepare_latents(batch_size * num_images_per_prompt, dtype, device, generator, latents)
        # Stochastic schedulers (SDE-DPM-Solver++, ancestral samplers) draw their noise from the generator too.
        step_kwargs = (
            {"generator": generator} if "generator" in inspect.signature(self.scheduler.step).parameters else {}
        )

        num_warmup_steps = len(timesteps) - num_inference_steps * self.scheduler.order
        freezing = self._inductor_freezing
        denoise = self.transformer if freezing is None else freezing.for_sampling(self.transformer)
        # The backbone checks the timesteps' range where it gets them: on a CPU copy, no step waits for the GPU.
        model_timesteps = timesteps.cpu()  # (S,)
        with self.progress_bar(total=num_inference_steps) as progress_bar:
            for i, t in enumerate(timesteps):
                if self.interrupt:
                    continue
                if self.do_classifier_free_guidance:
                    # One forward over [unconditional | conditional]; uncond first, as in diffusers.
                    model_input = torch.cat([latents, latents])  # (2·B·n, C, h, w)
                    text_states = torch.cat([negative_prompt_embeds, prompt_embeds])  # (2·B·n, T, D)
                else:
                    model_input, text_states = latents, prompt_embeds
                model_input = self.scheduler.scale_model_input(model_input, t)
                noise_pred = denoise(
                    model_input, text_states, model_timesteps[i].expand(model_input.shape[0]), return_dict=False
                )[0]  # (2·B·n or B·n, C, h, w)
                if self.do_classifier_free_guidance:
                    noise_uncond, noise_cond = noise_pred.chunk(2)  # (B·n, C, h, w) each
                    noise_pred = noise_uncond + self.guidance_scale * (noise_cond - noise_uncond)
                latents = self.scheduler.step(noise_pred, t, latents, **step_kwargs, return_dict=False)[0]

                if callback_on_step_end is not None:
                    callback_kwargs = {}
                    for name in callback_on_step_end_tensor_inputs:
                        callback_kwargs[name] = locals()[name]
                    callback_outputs = callback_on_step_end(self, i, t, callback_kwargs)
                    latents = callback_outputs.pop("latents", latents)
                    prompt_embeds = callback_outputs.pop("prompt_embeds", prompt_embeds)
                    negative_prompt_embeds = callback_outputs.pop("negative_prompt_embeds", negative_prompt_embeds)

                if i == len(timesteps) - 1 or ((i + 1) > num_warmup_steps and (i + 1) % self.scheduler.order == 0):
                    progress_bar.update()

        _raise_if_not_finite(
            latents,
            "Sampling produced non-finite latents (NaN or inf) in images {bad} of {total}. The transformer (or a "
            "`callback_on_step_end`) returned NaN or inf: in float16 its activations can overflow, so run it in "
            "bfloat16 or float32; otherwise check its weights, e.g. for a NaN from training.",
        )
        if output_type == "latent":
            image = latents
        else:
            latents = latents.to(self.vae.dtype) / self.vae.config.scaling_factor
            if self.vae.config.shift_factor is not None:
                latents = latents + self.vae.config.shift_factor
            image = self.vae.decode(latents, return_dict=False)[0]  # (B·n, 3, H, W) in [-1, 1]
            _raise_if_not_finite(
                image,
                "The VAE decoded non-finite images (NaN or inf): images {bad} of {total}, from finite latents. The "
                "Stable Diffusion VAE overflows in float16; run it in float32 or bfloat16 "
                "(`pipe.vae.to(torch.float32)`).",
            )
            image = self.image_processor.postprocess(image, output_type=output_type)

        self.maybe_free_model_hooks()
        if not return_dict:
            return (image,)
        return ImagePipelineOutput(images=image)
