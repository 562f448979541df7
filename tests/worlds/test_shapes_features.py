"""The shapes world's feature network (the Inception of shapes-FID): the shipped weights, the features, the heads.
That they separate renders from corrupted ones: tests/evaluation (shapes-FID grows with corruption)."""

import os

import numpy as np
import pytest
import torch

from diffusers_lmlp.evaluation.shapes_features import (
    ATTRIBUTES,
    FEATURES_PATH,
    ShapesFeatureNetwork,
    pretrained_shapes_features,
)
from diffusers_lmlp.shapes.world import ShapeSpec, all_specs, render


SEED = 2024  # training used seed 0 and evaluation seed 1000 (`scripts/train_shapes_features.py`): these are new


def renders(specs: list[ShapeSpec], seed: int, image_size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Jittered renders (N, 3, S, S) in [0, 1] and their (N, 4) labels, a column per attribute of `ATTRIBUTES`."""
    rng = np.random.default_rng(seed)
    pixels = np.stack([np.asarray(render(spec, image_size, rng), dtype=np.float32) for spec in specs])  # (N, S, S, 3)
    labels = [[values.index(getattr(spec, name)) for name, values in ATTRIBUTES.items()] for spec in specs]
    return torch.from_numpy(pixels / 255).permute(0, 3, 1, 2).contiguous(), torch.tensor(labels)


def some_specs(count: int, seed: int) -> list[ShapeSpec]:
    return [all_specs()[i] for i in np.random.default_rng(seed).integers(0, len(all_specs()), count)]


@pytest.fixture(scope="module")
def network() -> ShapesFeatureNetwork:
    return pretrained_shapes_features()


@torch.no_grad()
def test_shipped_network_loads_offline_gives_deterministic_per_image_features_and_saves_them(network, tmp_path):
    assert not network.training and network.num_features == 128 and network.name == "shapes-features"
    assert sum(p.numel() for p in network.parameters()) < 150_000  # a few hundred KB of fp32 weights
    images, _ = renders(some_specs(8, SEED), SEED)
    features = network(images)
    assert features.shape == (8, 128) and features.dtype == torch.float32 and torch.equal(features, network(images))
    torch.testing.assert_close(network(images[:3]), features[:3], rtol=1e-5, atol=1e-6)  # whatever the batch
    network.save_pretrained(tmp_path)
    saved = {path.name for path in tmp_path.iterdir()}
    assert saved == {"config.json", "diffusion_pytorch_model.safetensors"} <= set(os.listdir(FEATURES_PATH))
    loaded = ShapesFeatureNetwork.from_pretrained(tmp_path).eval()
    config = lambda model: {k: v for k, v in model.config.items() if k != "_name_or_path"}  # noqa: E731
    assert config(loaded) == config(network) and torch.equal(loaded(images), network(images))
    assert all(torch.equal(loaded.classify(images)[k], v) for k, v in network.classify(images).items())


@torch.no_grad()
@pytest.mark.parametrize(("count", "seed", "image_size"), [(216, SEED, 32), (108, SEED + 1, 64)])
def test_reads_every_attribute_of_fresh_renders_at_32_and_64_pixels(network, count, seed, image_size):
    images, labels = renders(some_specs(count, seed), seed, image_size)
    assert network(images).shape == (count, network.num_features)
    logits = network.classify(images)
    scores = {
        name: (logits[name].argmax(1) == labels[:, i]).float().mean().item() for i, name in enumerate(ATTRIBUTES)
    }
    assert min(scores.values()) >= 0.98, scores


@torch.no_grad()
def test_a_64_pixel_upsampled_image_gives_nearly_the_32_pixel_features(network):
    small, _ = renders(some_specs(108, SEED + 1), SEED + 1)
    upsampled = small.repeat_interleave(2, dim=2).repeat_interleave(2, dim=3)  # (N, 3, 64, 64)
    features = network(small)  # (N, num_features)
    relative = (network(upsampled) - features).norm(dim=1) / features.norm(dim=1)  # (N,)
    assert relative.max() < 0.15, relative.max()


@pytest.mark.parametrize(
    "images",
    [torch.rand(3, 32, 32), torch.rand(2, 1, 32, 32), torch.rand(2, 4, 32, 32), torch.rand(2, 32, 32, 3)]
    + [torch.zeros(2, 3, 32, 32, dtype=torch.uint8)],
    ids=["3-d", "grey", "rgba", "channels-last", "uint8"],
)
def test_bad_images_raise_a_clear_error(network, images):
    with pytest.raises(ValueError, match=r"float tensor of shape \(B, 3, H, W\)"):
        network.classify(images)
