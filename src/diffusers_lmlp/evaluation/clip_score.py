"""CLIP score as text-to-image papers report it: `100 · max(cos(E_image, E_caption), 0)` per pair, averaged, by
default with OpenAI's ViT-L/14; torchmetrics' `CLIPScore` (Hessel et al.'s CLIP-S with weight 100).

Two differences from torchmetrics: it clamps the mean rather than each pair (`score(..., clamp=False)` gives the raw
scores its number follows from), and it slices overlong token ids, dropping the end-of-text token CLIP pools from,
where here the tokenizer truncates and keeps it (as OpenAI's `clip.tokenize(..., truncate=True)`). Both agree on
captions that fit and non-negative cosines.
"""

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


def _projected(features: torch.Tensor | object) -> torch.Tensor:
    """The projected embedding from `get_image_features` / `get_text_features`: transformers 5 returns a
    `BaseModelOutputWithPooling` with it in `.pooler_output`, older versions the tensor itself."""
    return features if isinstance(features, torch.Tensor) else features.pooler_output


def _load_error(name: str, error: Exception) -> OSError:
    """An `OSError` that says why the CLIP model `name` did not load and how to get it."""
    how = (
        f'On a machine with internet access run `hf download {name} --include "*.json" --include "*.txt" '
        '--include "model.safetensors*"` (configs, tokenizer, image processor and safetensors weights; plain '
        f"`hf download {name}` also fetches the repo's other weight formats) and copy the Hugging Face cache here "
        "(or point `HF_HUB_CACHE` at it), or pass a local folder that holds those files."
    )
    if os.path.isdir(name):
        return OSError(f"Could not load the CLIP model and processor from the folder {name!r}: {error}")
    cache = huggingface_hub.constants.HF_HUB_CACHE
    if not huggingface_hub.constants.HF_HUB_OFFLINE:
        return OSError(
            f"Could not load the CLIP model {name!r} with safetensors weights ({error}). CLIPScorer reads "
            f"`model.safetensors` only, never pickled weights (`pytorch_model.bin`). {how}"
        )
    if isinstance(huggingface_hub.try_to_load_from_cache(name, "config.json"), str):
        return OSError(
            f"The CLIP model {name!r} is in the Hugging Face cache ({cache}) without `model.safetensors` or without "
            f"its processor files. CLIPScorer never loads pickled weights (`pytorch_model.bin`). {how}"
        )
    return OSError(
        f"The CLIP model {name!r} is not in the Hugging Face cache ({cache}), and HF_HUB_OFFLINE is set, so it "
        f"cannot be downloaded. {how}"
    )


class CLIPScorer:
    """Scores image-caption pairs with a CLIP model: `100 · max(cos(E_image, E_caption), 0)` per pair.

    Args:
        model (`transformers.CLIPModel`): The CLIP model; put into eval mode.
        processor (`transformers.CLIPProcessor`): Its tokenizer and image processor.
        name (`str`, *optional*): The model's name in reports; defaults to `model.name_or_path`.
    """

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
        """Load a CLIP model and its processor from the Hub, the cache or a local folder.

        Only safetensors weights are read: pickled weights are refused (`OSError`, which also says how to get a
        missing model), never unpickled.

        Args:
            name_or_path (`str` or `os.PathLike`, *optional*, defaults to `"openai/clip-vit-large-patch14"`): A Hub
                id or a local folder; also the scorer's `name`.
            device (`str` or `torch.device`, *optional*): Where to run; CUDA when available, else CPU.
            dtype (`torch.dtype`, *optional*, defaults to `torch.float32`): The model's dtype.
        """
        name = os.fspath(name_or_path)
        if os.path.isdir(name):
            files = os.listdir(name)
            if not any(file in files for file in SAFETENSORS_FILES):
                pickled = sorted(file for file in files if file.endswith(PICKLE_SUFFIXES))
                found = (
                    f"It holds pickled weights only ({', '.join(pickled)}), which " if pickled else "Pickled weights "
                )
                raise OSError(
                    f"The CLIP folder {name!r} has no safetensors weights (`model.safetensors`). {found}CLIPScorer "
                    "never loads, since unpickling can run arbitrary code: convert trusted weights once (load them in "
                    "transformers and `save_pretrained`, which writes safetensors), or pass a folder with "
                    "`model.safetensors`."
                )
        try:
            from transformers import CLIPModel, CLIPProcessor

            model = CLIPModel.from_pretrained(name, use_safetensors=True, dtype=dtype or torch.float32)
            processor = CLIPProcessor.from_pretrained(name)
        except OSError as error:
            raise _load_error(name, error) from error
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        return cls(model.to(device), processor, name=name)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @staticmethod
    def _as_pil(images: list[Image.Image] | torch.Tensor) -> list[Image.Image]:
        """PIL images as given; a (N, 3, H, W) float tensor in [0, 1] rounded to 8 bits, as a saved PNG would be."""
        if not isinstance(images, torch.Tensor):
            images = list(images)
            for i, image in enumerate(images):
                if not isinstance(image, Image.Image):
                    raise ValueError(
                        f"Image {i} is a {type(image).__name__}; pass PIL images or one (N, 3, H, W) float tensor in "
                        "[0, 1]."
                    )
            return images
        if images.ndim != 4 or images.shape[1] != 3 or not images.is_floating_point():
            raise ValueError(
                f"An image tensor must be (N, 3, H, W) and float in [0, 1]; got {tuple(images.shape)} {images.dtype}."
            )
        if images.numel() and (images.min() < 0 or images.max() > 1):
            raise ValueError(
                f"An image tensor must be in [0, 1]; got values in [{images.min():.3g}, {images.max():.3g}] (a [-1, 1] "
                "tensor maps to [0, 1] with `(x + 1) / 2`)."
            )
        pixels = (images.detach().float().cpu() * 255).round().to(torch.uint8)  # (N, 3, H, W)
        return [Image.fromarray(array) for array in pixels.permute(0, 2, 3, 1).numpy()]  # N × (H, W, 3)

    @torch.no_grad()
    def embed(self, images: list[Image.Image], captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """The projected, unnormalised CLIP embeddings of one batch.

        Args:
            images (`list[PIL.Image.Image]`): B images of any size.
            captions (`list[str]`): B captions, truncated to `max_length` tokens.

        Returns:
            `tuple[torch.Tensor, torch.Tensor]`: (B, D) image and caption embeddings, on the model's device.
        """
        pixel_values = self.processor.image_processor(images=images, return_tensors="pt")["pixel_values"]
        text = self.processor.tokenizer(
            captions, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
        )  # input_ids, attention_mask: (B, L), L <= max_length
        pixel_values = pixel_values.to(self.device, self.model.dtype)  # (B, 3, S, S)
        image_embeds = _projected(self.model.get_image_features(pixel_values=pixel_values))  # (B, D)
        text_embeds = _projected(
            self.model.get_text_features(
                input_ids=text["input_ids"].to(self.device), attention_mask=text["attention_mask"].to(self.device)
            )
        )  # (B, D)
        return image_embeds, text_embeds

    def score(
        self,
        images: list[Image.Image] | torch.Tensor,
        captions: list[str],
        batch_size: int = 64,
        clamp: bool = True,
    ) -> torch.Tensor:
        """CLIP score of each image with its caption; their mean is the CLIP score papers report.

        Args:
            images (`list[PIL.Image.Image]` or `torch.Tensor`): N images of any size, or a (N, 3, H, W) float tensor
                in [0, 1] (rounded to 8 bits first, as a saved image is).
            captions (`list[str]`): N non-empty captions, one per image.
            batch_size (`int`, *optional*, defaults to 64): Pairs per forward pass.
            clamp (`bool`, *optional*, defaults to `True`): Clamp each score at 0; `False` gives the raw `100 · cos`.

        Returns:
            `torch.Tensor`: (N,) float64 scores on the CPU.
        """
        images = self._as_pil(images)
        captions = list(captions)
        if not images:
            raise ValueError("CLIPScorer.score needs at least one image.")
        if len(images) != len(captions):
            raise ValueError(f"Got {len(images)} images and {len(captions)} captions; pass one caption per image.")
        for i, caption in enumerate(captions):
            if not isinstance(caption, str) or not caption.strip():
                raise ValueError(f"Caption {i} is {caption!r}; every caption must be a non-empty string.")
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1; got {batch_size}.")
        scores = []
        for start in range(0, len(images), batch_size):
            stop = start + batch_size
            image_embeds, text_embeds = self.embed(images[start:stop], captions[start:stop])  # (B, D) each
            image_embeds = image_embeds.double().cpu()
            text_embeds = text_embeds.double().cpu()
            image_embeds = image_embeds / image_embeds.norm(p=2, dim=-1, keepdim=True)
            text_embeds = text_embeds / text_embeds.norm(p=2, dim=-1, keepdim=True)
            scores.append(100 * (image_embeds * text_embeds).sum(dim=-1))  # (B,)
        scores = torch.cat(scores)  # (N,)
        return scores.clamp(min=0) if clamp else scores

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, device={self.device}, dtype={self.model.dtype})"
