"""The backbone and its frozen components, refused before any data is read when they do not fit; LoRA through PEFT."""

import contextlib
import inspect
from pathlib import Path

import torch
from diffusers import AutoencoderKL
from huggingface_hub import constants
from transformers import CLIPTextModel, CLIPTokenizer

from diffusers_lmlp import FAMILIES, LMLPPipeline, symmetry_breaking_penalty
from diffusers_lmlp.hub.lora_card import ADAPTER_NAME, adapted_modules, names_in_block
from diffusers_lmlp.models import family_of
from diffusers_lmlp.training.arguments import TextEncoderSource, VaeSource, load_text_encoder, load_vae
from diffusers_lmlp.worlds import WORLDS, load


def build_model(
    model_type: str | None, model_config: str | None = None, overrides: dict | None = None, *,
    values: dict | None = None, pretrained: str | None = None, revision: str | None = None,
    variant: str | None = None, load_balance_weight: float = 0.0, symmetry_breaking_weight: float = 0.0,
) -> torch.nn.Module:  # fmt: skip
    """`pretrained`'s backbone, or a new `model_type` of `values` (a JSON file's or, without `model_config`, a
    skeleton) or of the named `model_config`, with `overrides`; refuses the losses it cannot take."""
    if pretrained:
        saved = family_of(LMLPPipeline.load_config(pretrained, revision=revision)["transformer"][1]).name
        if model_type not in (None, saved):
            raise SystemExit(f"error: --model_type {model_type} conflicts with the base pipeline's {saved}: drop it.")
    model_class = FAMILIES[saved if pretrained else model_type].model_class
    if load_balance_weight and "output_router_probs" not in inspect.signature(model_class.forward).parameters:
        raise SystemExit("error: --load_balance_weight applies to MoE-MLP backbones only")
    if pretrained:
        model = model_class.from_pretrained(pretrained, subfolder="transformer", revision=revision, variant=variant)
    else:
        try:
            if model_config is None or model_config.endswith(".json"):
                model = model_class(**{**(values or {}), **(overrides or {})})
            else:
                model = model_class.from_named_config(model_config, **(overrides or {}))
        except ValueError as error:  # a value the model refuses (hidden_size=0)
            source = f"--model_config {model_config}" if model_config else f"--model_type {model_type}"
            raise SystemExit(f"error: {source} with --model_overrides: {error}") from None
    if symmetry_breaking_weight:
        try:
            symmetry_breaking_penalty(model)  # refuses a backbone without symmetry-breaking weights
        except ValueError as error:
            raise SystemExit(f"error: --symmetry_breaking_weight: {error}") from None
    return model


def load_components(
    *, pretrained: str | None = None, revision: str | None = None, world: str | None = None,
    text_encoder: TextEncoderSource | None = None, vae: VaeSource | None = None, latent_scale: float | None = None,
) -> tuple[CLIPTokenizer, CLIPTextModel, AutoencoderKL]:  # fmt: skip
    """The frozen tokenizer, text encoder and VAE: `pretrained`'s or the `world`'s, replaced from the sources given."""
    if pretrained:
        pipe = LMLPPipeline.from_pretrained(pretrained, revision=revision)
        tokenizer, text_model, autoencoder = pipe.tokenizer, pipe.text_encoder, pipe.vae
    elif world:
        tokenizer, text_model, autoencoder = load(WORLDS[world].components)()
    if text_encoder is not None:
        with loading_from("the text encoder", text_encoder.source, "--pretrained_text_encoder"):
            tokenizer, text_model = load_text_encoder(text_encoder)
    if vae is not None:
        with loading_from("the VAE", vae.source, "--pretrained_vae"):
            autoencoder = load_vae(vae)
    if latent_scale is not None:
        autoencoder.register_to_config(scaling_factor=latent_scale)
    return tokenizer, text_model.requires_grad_(False).eval(), autoencoder.requires_grad_(False).eval()


@contextlib.contextmanager
def loading_from(what: str, source: str, option: str):
    """A loader's `OSError` or `ValueError` for `what` from `source` as a message that says what to do."""
    try:
        yield
    except ValueError as error:  # what the component's checkpoint holds is wrong
        raise SystemExit(f"error: {error}") from None
    except OSError as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        if Path(source).is_dir():
            raise SystemExit(f"error: could not load {what} from the folder {source}: {first}") from None
        offline = " (HF_HUB_OFFLINE=1: only the Hugging Face cache is read)" if constants.HF_HUB_OFFLINE else ""
        fix = f"Fetch it once (`hf download {source}`, see docs/coco.md), or pass a local folder with {option}."
        raise SystemExit(f"error: could not load {what} from the Hub repo {source}{offline}: {first} {fix}") from None


def check_compatible(model, tokenizer, text_encoder, vae, resolution: int, fine_tuning: bool = False) -> None:
    """Refuse components and a resolution that do not fit the backbone: the VAE must turn `resolution` px images
    into latents of exactly its `sample_size` (it mixes a fixed number of tokens), by its config and its layers."""
    config = model.config
    factor = 2 ** (len(vae.config.block_out_channels) - 1)  # the factor LMLPPipeline sizes images by
    native = config.sample_size * factor
    if resolution != native:
        fix = f"pass --resolution {native}"
        if fine_tuning:
            fix += " (a fine-tuned model keeps its sample_size)"
        elif resolution % (factor * config.patch_size) == 0:
            fix += f", or --model_overrides sample_size={resolution // factor}"
        raise SystemExit(
            f"error: --resolution {resolution} does not match the model: sample_size {config.sample_size} × VAE "
            f"factor {factor} = {native} px. Token mixing is over a fixed number of tokens: {fix}."
        )
    height, width = vae_latent_size(vae, resolution)
    if (height, width) != (config.sample_size, config.sample_size):
        raise SystemExit(
            f"error: the VAE encodes {resolution}×{resolution} px images to {height}×{width} latents, but the "
            f"model's sample_size is {config.sample_size}: its config (block_out_channels of "
            f"{len(vae.config.block_out_channels)} entries) gives a factor of {factor}, its layers downsample by "
            f"{resolution // height}. Use a VAE whose config matches its layers."
        )
    try:  # the constructor checks text width, tokenizer length and latent channels
        LMLPPipeline(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=model, scheduler=None)
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None


def vae_latent_size(vae: AutoencoderKL, resolution: int) -> tuple[int, int]:
    """The (height, width) of the VAE encoder's output for a `resolution`² image, run on the meta device."""
    encoder, tensors = vae.encoder, [*vae.encoder.named_parameters(), *vae.encoder.named_buffers()]
    meta = {name: torch.empty_like(tensor, device="meta") for name, tensor in tensors}
    image = torch.empty(1, vae.config.in_channels, resolution, resolution, dtype=vae.dtype, device="meta")
    try:
        with torch.no_grad():
            moments = torch.func.functional_call(encoder, meta, (image,))  # (1, 2C, h, w)
    except RuntimeError as error:
        raise SystemExit(f"error: the VAE cannot encode {resolution}×{resolution} px images: {error}") from None
    return tuple(moments.shape[-2:])


CHECKPOINT_FOLDER = "transformer_lora"  # a checkpoint's adapter, instead of the backbone's `transformer/`


def lora_config(
    model: torch.nn.Module, rank: int, alpha: float | None, dropout: float, target_modules: list[str] | None
):
    """The adapter's `LoraConfig`: `alpha` defaults to the rank, `target_modules` (names, suffixes) to the family's."""
    try:
        import peft
    except ImportError:
        raise SystemExit('error: --lora_rank needs peft: pip install "diffusers-lmlp[train]"') from None
    family = family_of(model)
    targets = list(target_modules) if target_modules else family.lora_target_regex
    parameters = [] if target_modules else list(family.lora_target_parameters)
    if not targets and not parameters:
        raise SystemExit(f"error: --lora_target_modules: {family.label} blocks have no nn.Linear layer to adapt")
    return peft.LoraConfig(  # target_modules [] with parameters only: None would make PEFT look up a model type
        r=rank, lora_alpha=rank if alpha is None else alpha, lora_dropout=dropout, init_lora_weights="gaussian",
        target_modules=targets or [], target_parameters=parameters or None,
    )  # fmt: skip


def add_lora(model: torch.nn.Module, config) -> list[str]:
    """Freeze the backbone, add the adapter, return the adapted modules' names; exit if a target matches no layer."""
    model.requires_grad_(False)
    linear_names = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    if isinstance(config.target_modules, set | list | tuple):
        for target in sorted(config.target_modules):
            if not any(name == target or name.endswith(f".{target}") for name in linear_names):
                layers = f"no nn.Linear layer is named so (its blocks have {', '.join(names_in_block(linear_names))})"
                raise SystemExit(f"error: --lora_target_modules {target}: {layers}")
    try:
        model.add_adapter(config, adapter_name=ADAPTER_NAME)
    except ValueError as error:  # PEFT: none of the targets matched
        raise SystemExit(f"error: --lora_target_modules: {error}") from None
    return adapted_modules(model)


def adapter_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's weights, keyed as diffusers' LoRA files without the `transformer.` prefix."""
    from peft.utils import get_peft_model_state_dict

    return get_peft_model_state_dict(model, adapter_name=ADAPTER_NAME)


def save_adapter(model: torch.nn.Module, folder: Path) -> Path:
    """Write the model's adapter to `folder/pytorch_lora_weights.safetensors`, in diffusers' format."""
    LMLPPipeline.save_lora_weights(
        folder, transformer_lora_layers=adapter_state_dict(model),
        transformer_lora_adapter_metadata=model.peft_config[ADAPTER_NAME].to_dict()
    )  # fmt: skip
    return Path(folder) / "pytorch_lora_weights.safetensors"


def load_adapter(model: torch.nn.Module, folder: Path) -> None:
    """Load a `save_adapter` folder into the backbone's adapter; exits when their layers or shapes differ."""
    from peft.utils import set_peft_model_state_dict

    saved = LMLPPipeline.lora_state_dict(str(folder))
    saved = {key.removeprefix("transformer."): value for key, value in saved.items()}
    expected = adapter_state_dict(model)
    mismatched = sorted(set(saved) ^ set(expected)) or [k for k in expected if saved[k].shape != expected[k].shape]
    if mismatched:
        fix = f"({mismatched[0]}): resume with the --lora_rank and --lora_target_modules of the run that saved it"
        raise SystemExit(f"error: the LoRA adapter in {folder} does not fit this run's adapter {fix}")
    set_peft_model_state_dict(model, saved, adapter_name=ADAPTER_NAME)
