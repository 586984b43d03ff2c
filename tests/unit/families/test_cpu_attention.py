"""library/families/cpu_attention.py: the CPU attention picks SDPA for long key sequences and the classic path for
short ones, and both give the attention SDPA gives."""

from __future__ import annotations

import torch
from diffusers.models.attention_processor import Attention, AttnProcessor2_0

from library.families.cpu_attention import LONG_KEYS, CPUAttention


def _attention(cross: int | None) -> Attention:
    torch.manual_seed(0)
    return Attention(query_dim=32, cross_attention_dim=cross, heads=2, dim_head=16)


def test_short_and_long_keys_give_sdpas_attention():
    for cross, keys in ((24, 77), (None, LONG_KEYS + 16), (None, 64)):
        attn = _attention(cross)
        hidden = torch.randn(2, keys if cross is None else 40, 32)
        context = torch.randn(2, keys, cross) if cross is not None else None
        expected = AttnProcessor2_0()(attn, hidden, context)
        torch.testing.assert_close(CPUAttention()(attn, hidden, context), expected, rtol=1e-5, atol=1e-5)


def test_the_key_length_picks_the_kernel(monkeypatch):
    used = []
    processor = CPUAttention()
    monkeypatch.setattr(processor, "short", lambda *args: used.append("classic") or args[1])
    monkeypatch.setattr(processor, "long", lambda *args: used.append("sdpa") or args[1])
    attn = _attention(None)
    processor(attn, torch.randn(1, LONG_KEYS, 32))
    processor(attn, torch.randn(1, LONG_KEYS + 1, 32))
    processor(attn, torch.randn(1, 32, 32, 32))  # [B, C, H, W]: 1,024 keys
    processor(attn, torch.randn(1, 4096, 32), torch.randn(1, 77, 32))  # cross-attention: 77 keys
    assert used == ["classic", "sdpa", "sdpa", "classic"]
