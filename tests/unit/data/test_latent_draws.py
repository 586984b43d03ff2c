"""The latent cache's VAE posterior draws are upstream's (``library/data/encode_caches.latent_generator``): sd-scripts
48d368fa samples them from torch's global generator after ``set_seed`` and its model load, which on the CPU drew
one number per element of its SD 1.5 U-Net's Linear and Conv layers first. Expected values: upstream's own, kept as
data (``tests/data/upstream_validation/cache_latents.json``, made by ``generate_cache_latents.py`` beside it on the
upstream harness: a seeded SD 1.5 run with ``--cache_latents``, 6 training and 2 validation images of 256 px, one per
VAE batch)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

from library.config import DataConfig, ModelConfig
from library.data import encode_caches
from library.data.latent_cache import LatentFiles
from library.families.model_parts import config_dir
from library.families.registry import model_family

UPSTREAM = json.loads((Path(__file__).resolve().parents[2] / "data" / "upstream_validation" /
                       "cache_latents.json").read_text())


def test_sd_counts_the_numbers_upstreams_unet_construction_draws(tmp_path):
    from accelerate import init_empty_weights
    from diffusers import UNet2DConditionModel

    with init_empty_weights():  # shapes only
        unet = UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(str(config_dir("sd15") / "unet")))
    family = model_family("sd")
    folder = ModelConfig(pretrained_model_name_or_path=str(tmp_path))  # a diffusers folder, as the harness's
    assert family.upstream_draws_before_latents(folder, SimpleNamespace(unet=unet)) == \
        UPSTREAM["cpu_draws_before_latents"]
    assert model_family("flux").upstream_draws_before_latents(folder, SimpleNamespace(unet=unet)) == 0


class NoiseVAE(torch.nn.Module):
    """A VAE whose posterior is N(0, 1): each sample is the generator's draw itself."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.dtype = torch.float32

    def encode(self, images: torch.Tensor) -> SimpleNamespace:
        b, _, h, w = images.shape
        return SimpleNamespace(latent_dist=DiagonalGaussianDistribution(torch.zeros(b, 8, h // 8, w // 8)))


class ImagesInUpstreamOrder:
    """Stands for ``TrainData``: encodes one 256 px image per batch, as many as upstream cached."""

    def __init__(self):
        self.latents = []

    def cache_latents(self, encode, **_):
        self.latents += [encode(torch.zeros(1, 3, 256, 256)) for _ in UPSTREAM["draws"]]


def test_cached_latents_are_upstreams_draws_in_upstreams_order():
    global_state = torch.get_rng_state()
    generator = encode_caches.latent_generator(1, torch.device("cpu"), UPSTREAM["cpu_draws_before_latents"])
    data = ImagesInUpstreamOrder()
    encode_caches.cache_latents(data, SimpleNamespace(vae=NoiseVAE()), SimpleNamespace(vae_dtype=torch.float32),
                                torch.device("cpu"), DataConfig(cache_latents=True), LatentFiles("_sd", 4),
                                generator=generator)
    for latents, draw in zip(data.latents, UPSTREAM["draws"], strict=True):
        assert list(latents.shape) == draw["shape"]
        assert latents.flatten()[:len(draw["head"])].tolist() == pytest.approx(draw["head"], abs=1e-5)
        assert float(latents.sum()) == pytest.approx(draw["sum"], abs=1e-2)
    assert torch.equal(torch.get_rng_state(), global_state)  # the run's own streams are left alone


def test_cuda_draws_start_at_the_seed():
    """On CUDA upstream's loading draws nothing from the device's generator before the cache: no numbers skipped."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    generator = encode_caches.latent_generator(1, torch.device("cuda"), UPSTREAM["cpu_draws_before_latents"])
    first = torch.randn(4, device="cuda", generator=generator)
    assert torch.equal(first, torch.randn(4, device="cuda", generator=torch.Generator("cuda").manual_seed(1)))
