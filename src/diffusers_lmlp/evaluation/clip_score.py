"""CLIP score as text-to-image papers report it: `100 · max(cos(E_image, E_caption), 0)` per pair, averaged, by
default with OpenAI's ViT-L/14. torchmetrics' `CLIPScore` clamps the mean, not each pair, and slices overlong token
ids, dropping the end-of-text token CLIP pools from; here the tokenizer truncates and keeps it (as OpenAI's
`clip.tokenize(..., truncate=True)`). Both agree on captions that fit and non-negative cosines."""

import os
from typing import TYPE_CHECKING

import huggingface_hub
import torch
from PIL import Image

from ..folders import PICKLE_SUFFIXES


if TYPE_CHECKING:
    from transformers import CLIPModel, CLIPProcessor


DEFAULT_CLIP = "openai/clip-vit-large-patch14"
SAFETENSORS_FILES = ("model.safetensors", "model.safetensors.index.json")


def _projected(features) -> torch.Tensor:
    """The projected embedding: transformers 5 returns it in `.pooler_output`, older versions as the tensor."""
    return features if isinstance(features, torch.Tensor) else features.pooler_output


class CLIPScorer:
    """Scores image-caption pairs with a CLIP `model` (put into eval mode) and its `processor`; `name` (in reports)
    defaults to `model.name_or_path`."""

    def __init__(self, model: "CLIPModel", processor: "CLIPProcessor", name: str | None = None):
        self.model = model.eval()
        self.processor = processor
        self.name = name or model.name_or_path
        # Token positions of the text tower (77 for OpenAI's CLIP), bos and eos included.
        self.max_length = min(model.config.text_config.max_position_embeddings, processor.tokenizer.model_max_length)

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str | os.PathLike = DEFAULT_CLIP,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> "CLIPScorer":
        """Load a CLIP model and processor (a Hub id or a folder) on `device` (CUDA when available) in `dtype`
        (float32); safetensors weights only: pickled ones raise `OSError` unread."""
        name = os.fspath(name_or_path)
        if os.path.isdir(name) and not any(file in os.listdir(name) for file in SAFETENSORS_FILES):
            pickled = ", ".join(sorted(file for file in os.listdir(name) if file.endswith(PICKLE_SUFFIXES)))
            raise OSError(f"The CLIP folder {name!r} has no safetensors weights (`model.safetensors`), "
                          f"{f'pickled weights only ({pickled}), which ' if pickled else 'and pickled weights '}"
                          "CLIPScorer never loads: `save_pretrained` trusted weights with transformers.")  # fmt: skip
        try:
            from transformers import CLIPModel, CLIPProcessor

            model = CLIPModel.from_pretrained(name, use_safetensors=True, dtype=dtype or torch.float32)
            processor = CLIPProcessor.from_pretrained(name)
        except OSError as error:
            if os.path.isdir(name):
                raise OSError(
                    f"Could not load the CLIP model and processor from the folder {name!r}: {error}"
                ) from error
            cache = huggingface_hub.constants.HF_HUB_CACHE
            if not huggingface_hub.constants.HF_HUB_OFFLINE:
                why = f"Could not load the CLIP model {name!r} with safetensors weights ({error})."
            elif isinstance(huggingface_hub.try_to_load_from_cache(name, "config.json"), str):
                why = f"The CLIP model {name!r} is in the Hugging Face cache ({cache}) without `model.safetensors`."
            else:
                why = f"The CLIP model {name!r} is not in the Hugging Face cache ({cache}), and HF_HUB_OFFLINE is set."
            raise OSError(f'{why} Run `hf download {name} --include "*.json" --include "*.txt" --include '
                          '"model.safetensors*"` where the Hub is reachable, or pass a local folder.'
                          ) from error  # fmt: skip
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        return cls(model.to(device), processor, name=name)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @torch.no_grad()
    def embed(self, images: list[Image.Image], captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """The (B, D) projected, unnormalised image and caption embeddings (captions truncated to `max_length`
        tokens), on the model's device."""
        pixel_values = self.processor.image_processor(images=images, return_tensors="pt")["pixel_values"]
        text = self.processor.tokenizer(
            captions, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
        )  # input_ids, attention_mask: (B, L), L <= max_length
        pixel_values = pixel_values.to(self.device, self.model.dtype)  # (B, 3, S, S)
        image_embeds = _projected(self.model.get_image_features(pixel_values=pixel_values))  # (B, D)
        input_ids, attention_mask = text["input_ids"].to(self.device), text["attention_mask"].to(self.device)
        text_embeds = _projected(self.model.get_text_features(input_ids=input_ids, attention_mask=attention_mask))
        return image_embeds, text_embeds

    def score(
        self, images: list[Image.Image] | torch.Tensor, captions: list[str], batch_size: int = 64, clamp: bool = True
    ) -> torch.Tensor:
        """The (N,) float64 CPU CLIP scores of N images with their N non-empty captions (their mean is the CLIP score
        papers report), `batch_size` pairs per pass; `clamp=False` gives the raw `100 · cos`. `images`: PIL images
        of any size, or a (N, 3, H, W) float tensor in [0, 1] (rounded to 8 bits first, as a saved image is)."""
        if isinstance(images, torch.Tensor):
            if images.ndim != 4 or images.shape[1] != 3 or not images.is_floating_point():
                raise ValueError(
                    f"An image tensor must be (N, 3, H, W) float; got {tuple(images.shape)} {images.dtype}."
                )
            if images.numel() and (images.min() < 0 or images.max() > 1):
                raise ValueError("An image tensor must be in [0, 1] (map [-1, 1] with `(x + 1) / 2`).")
            pixels = (images.detach().float().cpu() * 255).round().to(torch.uint8)  # (N, 3, H, W)
            images = [Image.fromarray(array) for array in pixels.permute(0, 2, 3, 1).numpy()]  # N × (H, W, 3)
        images, captions = list(images), list(captions)
        if (wrong := next((i for i, im in enumerate(images) if not isinstance(im, Image.Image)), None)) is not None:
            raise ValueError(f"Image {wrong} is a {type(images[wrong]).__name__}; pass PIL images or one tensor.")
        if not images or len(images) != len(captions):
            raise ValueError(f"Got {len(images)} images and {len(captions)} captions: pass at least one image, and one "
                             "caption per image.")  # fmt: skip
        for i, caption in enumerate(captions):
            if not isinstance(caption, str) or not caption.strip():
                raise ValueError(f"Caption {i} is {caption!r}; every caption must be a non-empty string.")
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1; got {batch_size}.")
        scores = []
        for start in range(0, len(images), batch_size):
            stop = start + batch_size
            image_embeds, text_embeds = self.embed(images[start:stop], captions[start:stop])  # (B, D) each
            cosine = torch.nn.functional.cosine_similarity(
                image_embeds.double().cpu(), text_embeds.double().cpu(), eps=0
            )
            scores.append(100 * cosine)  # (B,)
        scores = torch.cat(scores)  # (N,)
        return scores.clamp(min=0) if clamp else scores

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, device={self.device}, dtype={self.model.dtype})"
