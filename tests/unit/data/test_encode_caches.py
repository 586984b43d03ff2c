"""Memory between the batches of latent caching (``library/data/encode_caches.py``): sd-scripts'
``clean_memory_on_device`` after each VAE batch unless ``--highvram``."""

from __future__ import annotations

import torch

from library.data import encode_caches


def test_latent_caching_empties_the_cuda_cache_unless_highvram(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(1))
    encode_caches.release_cached_memory(torch.device("cuda"), highvram=False)
    assert len(calls) == 1
    encode_caches.release_cached_memory(torch.device("cuda"), highvram=True)
    encode_caches.release_cached_memory(torch.device("cpu"), highvram=False)
    assert len(calls) == 1
