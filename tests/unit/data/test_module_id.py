"""``encode_caches.module_id``, which names the text encoders a text-output cache was written with, hashes a weight
in chunks: the same id as hashing each of the first four weights whole, and another id for other weights or dtype."""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from library.data import encode_caches


def whole_tensor_id(module: nn.Module) -> str:
    digest = hashlib.sha1(str(next(module.parameters()).dtype).encode())
    for param in list(module.parameters())[:4]:
        digest.update(param.detach().float().numpy().tobytes())
    return digest.hexdigest()[:16]


def test_chunks_hash_as_the_whole_tensors(monkeypatch):
    torch.manual_seed(0)
    module = nn.Sequential(nn.Embedding(37, 5), nn.Linear(5, 3), nn.Linear(3, 2))
    monkeypatch.setattr(encode_caches, "ID_CHUNK", 7)  # 185 elements of the embedding in 27 chunks
    assert encode_caches.module_id(module) == whole_tensor_id(module)
    before = encode_caches.module_id(module)
    with torch.no_grad():
        module[0].weight[-1, -1] += 1  # the embedding's last chunk
    assert encode_caches.module_id(module) != before
    assert encode_caches.module_id(module.to(torch.bfloat16)) != encode_caches.module_id(module.float())
