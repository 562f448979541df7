"""Token I/O shared by every backbone, in the reference UL-MLP / U-ViT layout: `TokenEmbedder` makes [time (1) |
text (T) | image patches (N)] + a learned positional embedding, `OutputHead` the ε prediction."""

from collections.abc import Mapping

import torch
from diffusers.models.embeddings import get_timestep_embedding
from diffusers.models.modeling_utils import get_parameter_dtype
from torch import nn


def input_dtype(layer: nn.Module) -> torch.dtype:
    """The dtype `layer` computes in: diffusers' `get_parameter_dtype`, float32 for a dynamically quantized Linear."""
    if next(layer.parameters(), None) is None and next(layer.buffers(), None) is None:
        return torch.float32
    return get_parameter_dtype(layer)


class TokenEmbedder(nn.Module):
    """Patchify the latent, embed the timestep and adapt the text states into one (B, L, D) token sequence;
    `pooled_text_projection` adds a projection of the text's last state to every image token."""

    def __init__(self, config: Mapping):
        super().__init__()
        self.hidden_size = hidden_size = config["hidden_size"]
        self.num_extra_tokens = 1 + config["text_seq_len"]
        self.num_patches = (config["sample_size"] // config["patch_size"]) ** 2
        patch_size, text_embed_dim = config["patch_size"], config["text_embed_dim"]
        self.patch_embed = nn.Conv2d(config["in_channels"], hidden_size, kernel_size=patch_size, stride=patch_size)
        self.text_adapter = nn.Linear(text_embed_dim, hidden_size)
        self.pooled_text_proj = nn.Linear(text_embed_dim, hidden_size) if config["pooled_text_projection"] else None
        self.pos_embed = nn.Parameter(torch.zeros(1, self.num_extra_tokens + self.num_patches, hidden_size))

    @property
    def seq_len(self) -> int:
        return self.num_extra_tokens + self.num_patches  # L = 1 + T + N

    def forward(self, latents: torch.Tensor, text_states: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) latents, (B, T, E) text states, (B,) network timesteps (1..1000) → (B, L, D) tokens; each input
        is cast to the dtype of the layer that reads it."""
        latents = latents.to(input_dtype(self.patch_embed))
        text_states = text_states.to(input_dtype(self.text_adapter))
        patches = self.patch_embed(latents)  # (B, D, H/p, W/p)
        patches = patches.flatten(2).transpose(1, 2)  # (B, N, D), row-major over the patch grid
        if self.pooled_text_proj is not None:
            pooled = self.pooled_text_proj(text_states[:, -1]).to(patches.dtype)  # (B, D)
            patches = patches + pooled.unsqueeze(1)  # (B, N, D)
        # The reference time token is the bare sinusoid, cos half first, with no MLP.
        time = get_timestep_embedding(timestep, self.hidden_size, flip_sin_to_cos=True, downscale_freq_shift=0)
        time = time.to(self.pos_embed.dtype).unsqueeze(1)  # (B, 1, D)
        text = self.text_adapter(text_states)  # (B, T, D)
        # torch.cat promotes to the widest dtype, as in the reference: under bf16 autocast the stream is float32.
        tokens = torch.cat([time, text, patches], dim=1)  # (B, L, D)
        return tokens + self.pos_embed


class OutputHead(nn.Module):
    """LayerNorm, Linear to patch pixels, drop the time and text tokens, unpatchify, and the `conv_out` 3×3 conv."""

    def __init__(self, config: Mapping):
        super().__init__()
        self.patch_size = patch_size = config["patch_size"]
        self.grid_size = config["sample_size"] // patch_size
        self.out_channels = out_channels = config["out_channels"] or config["in_channels"]
        self.num_extra_tokens = 1 + config["text_seq_len"]
        self.norm = nn.LayerNorm(config["hidden_size"], eps=config["norm_eps"])
        self.proj = nn.Linear(config["hidden_size"], patch_size * patch_size * out_channels)
        self.conv = nn.Conv2d(out_channels, out_channels, 3, padding=1) if config["conv_out"] else nn.Identity()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        batch_size, g, p, c = tokens.shape[0], self.grid_size, self.patch_size, self.out_channels
        pixels = self.proj(self.norm(tokens))  # (B, L, p·p·C)
        pixels = pixels[:, self.num_extra_tokens :]  # (B, N, p·p·C); within a patch the order is (p1, p2, C)
        pixels = pixels.reshape(batch_size, g, g, p, p, c)  # (B, h, w, p1, p2, C)
        pixels = torch.einsum("nhwpqc->nchpwq", pixels).reshape(batch_size, c, g * p, g * p)  # (B, C, H, W)
        return self.conv(pixels)
