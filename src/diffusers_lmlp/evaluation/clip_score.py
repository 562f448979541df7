"""CLIP score, as text-to-image papers report it: how well each image matches its caption, by a CLIP model.

For an image I and its caption C, with E_I and E_C the projected CLIP embeddings of the two towers,

    CLIPScore(I, C) = 100 · max(cos(E_I, E_C), 0),

which is torchmetrics' `CLIPScore` (and Hessel et al.'s CLIP-S with weight 100 instead of 2.5). The papers report
the mean over a set of generated images (e.g. 30k COCO captions) with OpenAI's ViT-L/14,
`openai/clip-vit-large-patch14`, the default here. Two details of torchmetrics 1.9 that this module documents:

- torchmetrics clamps the *mean* at 0, not each pair: `max(mean(100 · cos), 0)`. Both agree whenever no pair has a
  negative cosine (the usual case for real CLIP models on real captions); `score(..., clamp=False)` gives the raw
  `100 · cos`, from which torchmetrics' number follows exactly.
- Captions longer than the text tower's 77 positions: torchmetrics slices the token ids after tokenizing, which drops
  the end-of-text token that CLIP pools from, so it pools another token; here the tokenizer truncates
  (`truncation=True`), keeping the end-of-text token last, as OpenAI's `clip.tokenize(..., truncate=True)` does.
  Both agree on captions that fit.
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

    Build one with `CLIPScorer.from_pretrained(...)`, or from a loaded model and processor.

    Args:
        model (`transformers.CLIPModel`): The CLIP model; put into eval mode.
        processor (`transformers.CLIPProcessor`): Its processor: the tokenizer and the image processor (resize to
            the shortest side, centre crop, normalise).
        name (`str`, *optional*): What to call the model in reports; defaults to `model.name_or_path`.
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
        """Load a CLIP model and its processor from the Hub, the Hugging Face cache or a local folder.

        Only safetensors weights are read (`use_safetensors=True`); a model with pickled weights only is refused,
        never unpickled. With `HF_HUB_OFFLINE=1`, a Hub id loads from a pre-filled cache.

        Args:
            name_or_path (`str` or `os.PathLike`, *optional*, defaults to `"openai/clip-vit-large-patch14"`): A Hub
                id or a local folder. ViT-L/14 is the model text-to-image papers report CLIP score with.
            device (`str` or `torch.device`, *optional*): Where to run the model; CUDA when available, else CPU.
            dtype (`torch.dtype`, *optional*, defaults to `torch.float32`): The model's dtype.

        Returns:
            `CLIPScorer`: The scorer, with `name` set to `name_or_path` as given.

        Raises:
            `OSError`: The model cannot be found (the message says how to get it), or it has no safetensors weights.
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
        """The projected CLIP embeddings of one batch of images and captions, not normalised.

        Args:
            images (`list[PIL.Image.Image]`): B images of any size.
            captions (`list[str]`): B captions; longer ones are truncated to `max_length` tokens.

        Returns:
            `tuple[torch.Tensor, torch.Tensor]`: Image and caption embeddings, each (B, D), on the model's device.
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
        """CLIP score of each image with its caption: `100 · max(cos(E_image, E_caption), 0)`.

        The mean of the result is the CLIP score papers report (torchmetrics' `CLIPScore`).

        Args:
            images (`list[PIL.Image.Image]` or `torch.Tensor`): N images of any size (the processor resizes and
                crops them), or a (N, 3, H, W) float tensor in [0, 1], rounded to 8 bits first as a saved image is.
            captions (`list[str]`): N non-empty captions, one per image. Captions longer than the text tower's
                `max_length` tokens (77 for CLIP) are truncated, keeping the end-of-text token.
            batch_size (`int`, *optional*, defaults to 64): Pairs per forward pass.
            clamp (`bool`, *optional*, defaults to `True`): Clamp each score at 0. With `False`, the raw
                `100 · cos`, whose clamped mean `max(mean, 0)` is what torchmetrics 1.9 computes.

        Returns:
            `torch.Tensor`: (N,) float64 scores on the CPU, in [0, 100] when clamped.

        Raises:
            `ValueError`: No images, different numbers of images and captions, an empty or non-string caption, or
                images that are neither PIL images nor a (N, 3, H, W) float tensor in [0, 1].
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
