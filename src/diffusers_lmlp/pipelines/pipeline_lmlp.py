"""`LMLPPipeline`: text-to-image sampling with an MLP backbone, the SD VAE, CLIP text states and DPM-Solver++, as
the papers' U-ViT MS-COCO recipe (their guidance s is `guidance_scale` g = s + 1, with "" as the null context)."""

import contextlib
import inspect
import os
from collections.abc import Callable
from typing import Any, Self

import torch
from diffusers import AutoencoderKL, DiffusionPipeline, ImagePipelineOutput, ModelMixin, SchedulerMixin
from diffusers.callbacks import MultiPipelineCallbacks, PipelineCallback
from diffusers.image_processor import VaeImageProcessor
from diffusers.utils import logging, replace_example_docstring
from diffusers.utils.torch_utils import is_compiled_module, randn_tensor
from transformers import CLIPTextModel, CLIPTokenizer

from ..exports import public
from ..models.loading import (
    check_float32_beside_quantized_layers,
    check_storable,
    local_paths_left_out,
    no_empty_fp32_warning,
)
from ..sampling import GUIDANCE_SCALE, NUM_INFERENCE_STEPS
from .checks import _check_call, _check_components, _raise_if_not_finite, _set_schedule
from .freezing import FrozenTransformer, check_freezable
from .loading import _check_folder, _folder_view, _hub_snapshot, _refuse_unpickling
from .lora import LMLPLoraLoaderMixin
from .model_index import package_model_index
from .schedulers import check_scheduler, default_scheduler  # noqa: F401 (default_scheduler: its former home)
from .vocabulary import describe_vocabulary, prompt_words, unknown_words


logger = logging.get_logger(__name__)

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
    """Text-to-image generation with an attention-free MLP backbone ([L-MLP](https://arxiv.org/abs/2405.16098) or
    MoE-MLP) in the SD VAE's latent space, at one size only (`native_size`: the backbone mixes a fixed number of
    tokens). Guidance follows diffusers, ε = ε_u + g·(ε_c − ε_u).

    Args:
        vae ([`AutoencoderKL`]): The VAE, with the backbone's training `scaling_factor`.
        text_encoder ([`~transformers.CLIPTextModel`]): Frozen CLIP text encoder (its last hidden state).
        tokenizer ([`~transformers.CLIPTokenizer`]): CLIP tokenizer; `model_max_length` must be `text_seq_len`.
        transformer ([`ModelMixin`]): The ε-prediction backbone, of any registered family (`diffusers_lmlp.FAMILIES`).
        scheduler ([`~schedulers.SchedulerMixin`]): A DDPM-family ε scheduler on the training schedule.
    """

    model_cpu_offload_seq = "text_encoder->transformer->vae"
    _callback_tensor_inputs = ["latents", "prompt_embeds", "negative_prompt_embeds"]

    def __init__(
        self,
        vae: AutoencoderKL,
        text_encoder: CLIPTextModel,
        tokenizer: CLIPTokenizer,
        transformer: ModelMixin,  # the base class: diffusers checks components against it, --with-code ships others
        scheduler: SchedulerMixin,
    ):
        super().__init__()
        self.register_modules(
            vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer, scheduler=scheduler
        )
        _check_components(*(getattr(self, name, None) for name in ("transformer", "text_encoder", "tokenizer", "vae")))
        self.vae_scale_factor = 2 ** (len(self.vae.config.block_out_channels) - 1) if getattr(self, "vae", None) else 8
        self.image_processor = VaeImageProcessor(vae_scale_factor=self.vae_scale_factor)
        self._inductor_freezing: FrozenTransformer | None = None

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, **kwargs) -> Self:
        """`DiffusionPipeline.from_pretrained` of a folder or Hub repo id, safetensors only; a repo is fetched with
        `snapshot_download` (diffusers' download refuses other libraries' components), a `--with-code` folder loads
        with this package's classes. `kwargs` are diffusers'; `use_safetensors` may only be True, `strict` is refused."""
        _refuse_unpickling(kwargs)
        path = os.fspath(pretrained_model_name_or_path)
        folder = path if os.path.isdir(path) else _hub_snapshot(pretrained_model_name_or_path, kwargs)
        saved_index = cls.load_config(folder)
        # With-code entries become [package, class], read through a view of the folder: diffusers runs no shipped file.
        model_index = package_model_index(saved_index)
        with_code = model_index != saved_index
        _check_folder(folder, model_index, path, kwargs)
        with _folder_view(folder, model_index) if with_code else contextlib.nullcontext(folder) as view:
            pipeline = super().from_pretrained(view, **kwargs)
        if folder != path or with_code:
            pipeline.register_to_config(_name_or_path=path)
        return pipeline

    @classmethod
    def from_pipe(cls, pipeline: DiffusionPipeline, **kwargs) -> DiffusionPipeline:
        """diffusers' `from_pipe`, but the transformer is shared whatever its class, the dtype stays `pipeline`'s
        unless given (diffusers casts to float32, huggingface/diffusers#12754), and a frozen graph is shared."""
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
        """`DiffusionPipeline.to` without diffusers' warning about float32 modules a model does not name."""
        with no_empty_fp32_warning():
            return super().to(*args, **kwargs)

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs) -> None:
        """`DiffusionPipeline.save_pretrained`, refusing components safetensors cannot store before writing, and
        leaving out the local folders diffusers would write into `_name_or_path`."""
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
        """Sample with the transformer compiled by inductor with freezing (weights as graph constants), the fastest
        way on a CPU. Changed weights freeze again; `pipe.transformer` stays uncompiled. Not for a compiled,
        offloaded or `quantize_dynamic` transformer."""
        if is_compiled_module(self.transformer):
            raise ValueError(
                "The transformer is compiled already (torch.compile): `pipe.transformer = pipe.transformer._orig_mod`."
            )
        if hasattr(self.transformer, "_hf_hook"):
            raise ValueError("Freezing cannot follow model offloading: `pipe.remove_all_hooks()` first.")
        check_freezable(self.transformer)
        self._inductor_freezing = FrozenTransformer()

    def disable_inductor_freezing(self) -> None:
        """Sample with `pipe.transformer` itself again."""
        self._inductor_freezing = None

    @property
    def inductor_freezing_enabled(self) -> bool:
        """Whether calls sample with the frozen transformer (`enable_inductor_freezing`)."""
        return self._inductor_freezing is not None

    def enable_vae_slicing(self) -> None:
        """Decode the batch one image at a time."""
        self.vae.enable_slicing()

    def disable_vae_slicing(self) -> None:
        self.vae.disable_slicing()

    def enable_vae_tiling(self) -> None:
        """Decode in overlapping tiles."""
        self.vae.enable_tiling()

    def disable_vae_tiling(self) -> None:
        self.vae.disable_tiling()

    # Methods, so that a pipeline loaded from remote code (`push --with-code`) has them without the package.
    def describe_vocabulary(self) -> str | None:
        """The tokenizer's closed vocabulary as one line of text, or None for an open one (CLIP's)."""
        return describe_vocabulary(self.tokenizer)

    def prompt_words(self, prompt: str) -> list[str]:
        """The words of `prompt` as the tokenizer sees them (normalised, punctuation left out)."""
        return prompt_words(self.tokenizer, prompt)

    def unknown_words(self, prompt: str) -> list[str]:
        """The words of `prompt` outside the tokenizer's closed vocabulary, each once."""
        return unknown_words(self.tokenizer, prompt)

    def _encode_text(self, texts: list[str], device: torch.device, name: str = "prompt") -> torch.Tensor:
        """CLIP's last hidden states (B, T, D) of `texts`; warns once per text of unknown words and truncation."""
        max_length = self.tokenizer.model_max_length
        for text, ids in dict(zip(texts, self.tokenizer(texts, verbose=False).input_ids)).items():
            if unknown := unknown_words(self.tokenizer, text):
                logger.warning(
                    f"The {name} {text!r} has words outside the tokenizer's vocabulary: {', '.join(map(repr, unknown))}"
                    ". They do not steer the image; `diffusers_lmlp.known_words(pipe.tokenizer)` lists the known ones."
                )
            if len(ids) > max_length:  # the truncated ids keep bos ... eos
                dropped = self.tokenizer.decode(ids[max_length - 1 : -1])
                logger.warning(
                    f"The {name} {text!r} is longer than {max_length} tokens; this part was dropped: {dropped!r}"
                )
        input_ids = self.tokenizer(
            texts, padding="max_length", max_length=max_length, truncation=True, return_tensors="pt"
        ).input_ids  # (B, T)
        return self.text_encoder(input_ids.to(device))[0]  # (B, T, D)

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
        """The prompts' CLIP text states and, with guidance, the unconditional ones (of `negative_prompt`, "" by
        default), each (B·num_images_per_prompt, T, D); given states are used as they are."""
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

    def check_inputs(self, height: int, width: int, **arguments: Any) -> int:
        """Validate `__call__`'s arguments before any compute; return the number of prompts."""
        if height != self.native_size or width != self.native_size:
            raise ValueError(
                f"This pipeline generates {self.native_size}×{self.native_size} images only (its backbone mixes a "
                f"fixed number of tokens), got height={height}, width={width}: leave them unset, or resize the result."
            )
        check_scheduler(self.scheduler)
        check_float32_beside_quantized_layers(self.transformer)
        return _check_call(self, **arguments)

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
        """The initial noise (drawn, or `latents`), (num_images, C, h, w), scaled by the scheduler's initial sigma."""
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
            prompt (`str` or `list[str]`, *optional*): The prompt(s), or pass `prompt_embeds`.
            negative_prompt (`str` or `list[str]`, *optional*): What to guide away from; defaults to `""`.
            height, width (`int`, *optional*): Default to, and must equal, `native_size`.
            num_inference_steps (`int`, *optional*, defaults to `sampling.NUM_INFERENCE_STEPS`): Denoising steps.
            timesteps, sigmas (`list`, *optional*): Custom decreasing timesteps or sigmas, for schedulers taking them.
            guidance_scale (`float`, *optional*, defaults to `sampling.GUIDANCE_SCALE`): g in
                ε = ε_u + g·(ε_c − ε_u), the papers' s + 1; g <= 1 means no guidance.
            num_images_per_prompt (`int`, *optional*, defaults to 1): Images per prompt.
            generator (`torch.Generator` or `list[torch.Generator]`, *optional*): Seeds the noise; a list, per image.
            latents (`torch.Tensor`, *optional*): Initial noise (B·num_images_per_prompt, C, h, w).
            prompt_embeds (`torch.Tensor`, *optional*): (B, text_seq_len, text_embed_dim) precomputed text states.
            negative_prompt_embeds (`torch.Tensor`, *optional*): Precomputed unconditional states, the same shape.
            output_type (`str`, *optional*, defaults to `"pil"`): `"pil"`, `"np"`, `"pt"` or `"latent"`.
            return_dict (`bool`, *optional*, defaults to `True`): Return an `ImagePipelineOutput`, not a tuple.
            callback_on_step_end (`Callable`, `PipelineCallback` or `MultiPipelineCallbacks`, *optional*): Called
                after each step as `(pipe, step, timestep, callback_kwargs)`; the tensors it returns replace ours.
            callback_on_step_end_tensor_inputs (`list[str]`, *optional*, defaults to `["latents"]`): What it gets.

        Examples:

        Returns:
            [`~pipelines.ImagePipelineOutput`] or `tuple`: The images. Raises `ValueError` for an invalid argument,
            before any model runs, and `FloatingPointError` for NaN or inf in the latents or images.
        """
        if isinstance(callback_on_step_end, PipelineCallback | MultiPipelineCallbacks):
            callback_on_step_end_tensor_inputs = callback_on_step_end.tensor_inputs
        height = self.native_size if height is None else height
        width = self.native_size if width is None else width
        batch_size = self.check_inputs(
            height, width, prompt=prompt, negative_prompt=negative_prompt, num_inference_steps=num_inference_steps,
            timesteps=timesteps, sigmas=sigmas, guidance_scale=guidance_scale,
            num_images_per_prompt=num_images_per_prompt, generator=generator, latents=latents,
            prompt_embeds=prompt_embeds, negative_prompt_embeds=negative_prompt_embeds, output_type=output_type,
            callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs,
        )  # fmt: skip
        self._guidance_scale = guidance_scale
        self._interrupt = False
        device = self._execution_device
        dtype = self.transformer.dtype
        num_inference_steps = _set_schedule(self.scheduler, num_inference_steps, timesteps, sigmas, device)
        timesteps = self.scheduler.timesteps
        self._num_timesteps = len(timesteps)

        prompt_embeds, negative_prompt_embeds = self.encode_prompt(
            prompt, device, num_images_per_prompt, self.do_classifier_free_guidance, negative_prompt, prompt_embeds,
            negative_prompt_embeds,
        )  # fmt: skip
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
        model_timesteps = timesteps.cpu()  # (S,): the backbone checks their range, and no step waits for the GPU
        with self.progress_bar(total=num_inference_steps) as progress_bar:
            for i, t in enumerate(timesteps):
                if self.interrupt:
                    continue
                if self.do_classifier_free_guidance:  # one forward over [unconditional | conditional]
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
                    step_locals = locals()
                    callback_kwargs = {name: step_locals[name] for name in callback_on_step_end_tensor_inputs}
                    callback_outputs = callback_on_step_end(self, i, t, callback_kwargs)
                    latents = callback_outputs.pop("latents", latents)
                    prompt_embeds = callback_outputs.pop("prompt_embeds", prompt_embeds)
                    negative_prompt_embeds = callback_outputs.pop("negative_prompt_embeds", negative_prompt_embeds)

                if i == len(timesteps) - 1 or ((i + 1) > num_warmup_steps and (i + 1) % self.scheduler.order == 0):
                    progress_bar.update()

        _raise_if_not_finite(
            latents,
            "Sampling produced non-finite latents (NaN or inf) in images {bad} of {total}: in float16 the transformer "
            "can overflow (use bfloat16 or float32); otherwise check its weights or the `callback_on_step_end`.",
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
                "SD VAE overflows in float16: run it in float32 or bfloat16 (`pipe.vae.to(torch.float32)`).",
            )
            image = self.image_processor.postprocess(image, output_type=output_type)

        self.maybe_free_model_hooks()
        if not return_dict:
            return (image,)
        return ImagePipelineOutput(images=image)
