"""The options of diffusers' `train_text_to_image.py` that this script does not take, and what to do instead, so a
diffusers user's usual command stops with the way to say it here rather than argparse's bare "unrecognized arguments".

This module imports nothing heavy: `diffusers_lmlp.train --help` reads it.
"""

# Option → what to do instead.
DIFFUSERS_ONLY_OPTIONS = {
    "--num_train_epochs": (
        "this script counts optimizer steps: give --max_train_steps (one epoch is ⌈images / (--train_batch_size × "
        "--gradient_accumulation_steps × processes)⌉ steps)"
    ),
    "--center_crop": (
        "images are always center-cropped to a square and resized to --resolution, as U-ViT prepares COCO; drop it"
    ),
    "--image_interpolation_mode": "images are always resized with Lanczos, diffusers' default; drop it",
    "--scale_lr": "multiply --learning_rate by the total batch (batch × accumulation × processes) yourself",
    "--prediction_type": "the backbones predict the noise ε, as both papers train them; drop it",
    "--input_perturbation": "it is not implemented here; drop it",
    "--dream_training": "DREAM is not implemented here; drop it",
    "--dream_detail_preservation": "DREAM is not implemented here; drop it",
    "--use_8bit_adam": "the trainer steps torch's AdamW (fused on the CPU and CUDA); drop it",
    "--validation_epochs": "give --validation_steps (optimizer steps between validations)",
    "--enable_xformers_memory_efficient_attention": (
        "the MLP backbones have no attention, and U-ViT runs torch's scaled_dot_product_attention, which picks a "
        "fused kernel itself; drop it"
    ),
    "--non_ema_revision": "a fine-tune starts from the weights at --pretrained_model_name_or_path and --revision; drop it",
    "--offload_ema": "the EMA weights stay on the model's device; drop it",
    "--foreach_ema": "the EMA always updates in one multi-tensor pass; drop it",
    "--local_rank": "`accelerate launch` gives each process its rank; drop it",
}


def diffusers_only_options(unknown: list[str]) -> list[str]:
    """One line per diffusers option among the arguments argparse left over (`unknown`, as `parse_known_args` gives
    them), in the order given."""
    lines = []
    for argument in unknown:
        option = argument.split("=", 1)[0]
        if option in DIFFUSERS_ONLY_OPTIONS:
            lines.append(
                f"{option} is an option of diffusers' train_text_to_image.py: {DIFFUSERS_ONLY_OPTIONS[option]}"
            )
    return lines
