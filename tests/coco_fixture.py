"""A tiny offline COCO world, real in layout: COCO-2014, SD v1-4's VAE and CLIP L/14 (narrow), cached by real ids."""

import json
from pathlib import Path

import numpy as np
import torch
from diffusers import AutoencoderKL
from PIL import Image
from test_pipeline_loading import fill_hub_cache
from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel

from diffusers_lmlp.tiny import tiny_clip_tokenizer


SD_REPO, CLIP_REPO = "CompVis/stable-diffusion-v1-4", "openai/clip-vit-large-patch14"
CLIP_TEXT_WIDTH = 32  # the text tower's hidden size: the backbone's text_embed_dim (768 for the real L/14)
WORDS = ("a", "an", "the", "of", "on", "in", "with", "man", "woman", "dog", "cat", "bus", "street", "table", "plate")
SUBJECTS = ("a man", "a woman", "a dog", "a cat", "two people", "a red bus", "a plate of food", "a train")
PLACES = ("on a street", "in a kitchen", "next to a table", "in a park", "at the station", "on the beach")


def write_coco2014(root: Path, num_train: int = 24, num_val: int = 6, seed: int = 0) -> Path:
    """Write `root/{train2014,val2014,annotations}` in the official layout and JSON schema: JPEGs of varied sizes and
    aspect ratios, 5 to 7 captions per image, files and annotations not in id order; returns `root`."""
    rng = np.random.default_rng(seed)
    (root / "annotations").mkdir(parents=True)
    annotation_id = 0
    for split, count in (("train2014", num_train), ("val2014", num_val)):
        (root / split).mkdir()
        image_ids = sorted(rng.choice(600_000, size=count, replace=False).tolist())
        images, annotations = [], []
        for image_id in rng.permutation(image_ids).tolist():  # the real files are not in id order either
            width, height = int(rng.integers(40, 97)), int(rng.integers(32, 81))  # landscape and portrait
            name = f"COCO_{split}_{image_id:012d}.jpg"
            pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / split / name, quality=90)
            images.append({
                "license": int(rng.integers(1, 9)), "file_name": name,
                "coco_url": f"http://images.cocodataset.org/{split}/{name}", "height": height, "width": width,
                "date_captured": "2013-11-14 16:28:13",
                "flickr_url": f"http://farm4.staticflickr.com/{image_id}.jpg", "id": image_id,
            })  # fmt: skip
            for _ in range(int(rng.choice([5, 5, 5, 6, 7]))):
                annotation_id += int(rng.integers(1, 50))
                caption = f"{rng.choice(SUBJECTS).capitalize()} {rng.choice(PLACES)}."
                annotations.append({"image_id": image_id, "id": annotation_id, "caption": caption})
        order = rng.permutation(len(annotations)).tolist()
        info = {"description": "This is stable 1.0 version of the 2014 MS COCO dataset.", "url": "http://mscoco.org",
                "version": "1.0", "year": 2014, "contributor": "Microsoft COCO group",
                "date_created": "2015-01-27 09:11:52.357475"}  # fmt: skip
        licenses = [{"url": "http://creativecommons.org/licenses/by-nc-sa/2.0/", "id": 1, "name": "CC BY-NC-SA"}]
        coco = {"info": info, "images": images, "licenses": licenses, "annotations": [annotations[i] for i in order]}
        (root / "annotations" / f"captions_{split}.json").write_text(json.dumps(coco))
    return root


def write_sd_vae_repo(folder: Path, seed: int = 0) -> Path:
    """Write `folder/model_index.json` and `folder/vae/` as SD v1-4 has them: its KL-f8 VAE, widths 8 and 16."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = AutoencoderKL(
            in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 16, 16, 16), layers_per_block=2,
            latent_channels=4, norm_num_groups=8, sample_size=512, scaling_factor=0.18215,
        )  # fmt: skip
    vae.save_pretrained(folder / "vae")
    components = {"feature_extractor": ["transformers", "CLIPImageProcessor"],
                  "safety_checker": ["stable_diffusion", "StableDiffusionSafetyChecker"],
                  "scheduler": ["diffusers", "PNDMScheduler"],
                  "text_encoder": ["transformers", "CLIPTextModel"], "tokenizer": ["transformers", "CLIPTokenizer"],
                  "unet": ["diffusers", "UNet2DConditionModel"], "vae": ["diffusers", "AutoencoderKL"]}  # fmt: skip
    model_index = {"_class_name": "StableDiffusionPipeline", "_diffusers_version": "0.2.2", **components}
    (folder / "model_index.json").write_text(json.dumps(model_index, indent=2))
    return folder


def write_clip_repo(folder: Path, seed: int = 0) -> Path:
    """Write `openai/clip-vit-large-patch14`'s files to `folder`: a narrow `CLIPModel`, image processor, tokenizer."""
    tokenizer = tiny_clip_tokenizer(model_max_length=77, save_directory=folder, words=WORDS)
    text_config = dict(
        vocab_size=len(tokenizer), hidden_size=CLIP_TEXT_WIDTH, intermediate_size=37, num_attention_heads=4,
        num_hidden_layers=2, max_position_embeddings=77, projection_dim=CLIP_TEXT_WIDTH,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    vision_config = dict(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_hidden_layers=1,
                         image_size=28, patch_size=14)  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        config = CLIPConfig(text_config=text_config, vision_config=vision_config, projection_dim=CLIP_TEXT_WIDTH)
        model = CLIPModel(config)
    model.save_pretrained(folder)
    # The image processor's config, as the real repo's (resize the short side, centre crop, CLIP's mean and std).
    CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}).save_pretrained(folder)
    special = {"content": None, "lstrip": False, "normalized": True, "rstrip": False, "single_word": False}
    bos, eos = {**special, "content": "<|startoftext|>"}, {**special, "content": "<|endoftext|>"}
    special_tokens = {"bos_token": bos, "eos_token": eos, "pad_token": "<|endoftext|>", "unk_token": eos}
    (folder / "special_tokens_map.json").write_text(json.dumps(special_tokens, indent=2))
    tokenizer_config = {
        "add_prefix_space": False, "bos_token": bos, "do_lower_case": True, "eos_token": eos, "errors": "replace",
        "model_max_length": 77, "name_or_path": CLIP_REPO, "pad_token": "<|endoftext|>",
        "tokenizer_class": "CLIPTokenizer", "unk_token": eos,
    }  # fmt: skip
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return folder


def write_hub_cache(root: Path) -> Path:
    """Write both repos to `root/repos/<owner>/<name>` and into the HF cache `root/hub`; returns the cache."""
    fill_hub_cache(write_sd_vae_repo(root / "repos" / SD_REPO), root / "hub", SD_REPO)
    fill_hub_cache(write_clip_repo(root / "repos" / CLIP_REPO), root / "hub", CLIP_REPO)
    return root / "hub"
