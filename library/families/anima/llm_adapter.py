"""Anima's LLM adapter with upstream's state-dict names, as upstream sd-scripts 48d368fa ``library/anima_models.py``
``LLMAdapter`` (with ``LLMAdapterTransformerBlock``, ``LLMAdapterAttention``, ``LLMAdapterRMSNorm``,
``AdapterRotaryEmbedding``). It lives inside the DiT (key prefix ``llm_adapter.``; upstream's checkpoints hold it
there) and turns Qwen3 states into the T5-like context the DiT cross-attends to.

The real config (``params.ANIMA``): Qwen3-0.6B states (b, 512, 1024) and T5 token ids (b, 512) of a 32128-token
vocabulary; width 1024, 6 blocks of 16 heads of 64, MLP 4096; 134,663,680 parameters (the embedding 32,899,072).

Math: x = ``embed``(T5 ids); each block adds self-attention (keys masked by the T5 mask), cross-attention over the
Qwen3 states (keys masked by the Qwen3 mask) and an MLP (Linear with bias, exact GELU, Linear with bias), each on an
RMSNorm of x. Attention: no projection biases, per-head RMSNorm on queries and keys, 1D RoPE (theta 10000,
rotate-half) with positions 0.. of the T5 tokens for queries and self-attention keys and 0.. of the Qwen3 tokens for
cross-attention keys, PyTorch SDPA with boolean masks (a query whose keys are all masked gets zeros). Output
``norm(out_proj(x))``. The class names are upstream's: its LoRA (``train_llm_adapter``) picks
``LLMAdapterTransformerBlock`` by class name.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from library.families.anima.layers import rotate_half

Rope = tuple[Tensor, Tensor]


class LLMAdapterRMSNorm(nn.Module):
    """T5-style RMSNorm (eps 1e-6): the variance in float32, the input scaled by its rsqrt, cast to ``weight``'s
    dtype only when that is fp16/bf16, then ``weight *``."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, x: Tensor) -> Tensor:
        variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.variance_epsilon)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            x = x.to(self.weight.dtype)
        return self.weight * x


def rotary_tables(inv_freq: Tensor, length: int, dtype: torch.dtype) -> Rope:
    """(cos, sin) of positions 0..length-1 at frequencies ``inv_freq``, (1, length, head_dim), in ``dtype``."""
    angles = torch.outer(torch.arange(length, device=inv_freq.device).float(), inv_freq.float())
    angles = torch.cat((angles, angles), dim=-1)[None]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate(x: Tensor, rope: Rope) -> Tensor:
    cos, sin = (table[:, None] for table in rope)
    return x * cos + rotate_half(x) * sin


class LLMAdapterAttention(nn.Module):
    """``q_proj``/``k_proj``/``v_proj``/``o_proj`` (no biases), ``q_norm``/``k_norm`` per head; RoPE on queries and
    keys with their own position tables."""

    def __init__(self, dim: int, context_dim: int, num_heads: int):
        super().__init__()
        self.n_heads, self.head_dim = num_heads, dim // num_heads
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.q_norm = LLMAdapterRMSNorm(self.head_dim)
        self.k_proj = nn.Linear(context_dim, dim, bias=False)
        self.k_norm = LLMAdapterRMSNorm(self.head_dim)
        self.v_proj = nn.Linear(context_dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def _heads(self, x: Tensor) -> Tensor:
        """(b, n, heads * d) -> (b, n, heads, d)."""
        return x.view(*x.shape[:-1], self.n_heads, self.head_dim)

    def forward(self, x: Tensor, context: Tensor, mask: Tensor | None, rope: Rope, context_rope: Rope) -> Tensor:
        """Queries of ``x`` (b, l, dim) over keys and values of ``context`` (b, s, context_dim), ``mask`` the keys'
        boolean (b, 1, 1, s); ``rope``/``context_rope`` the (cos, sin) tables of the queries/keys."""
        q = self.q_norm(self._heads(self.q_proj(x)))
        k = self.k_norm(self._heads(self.k_proj(context)))
        v = self._heads(self.v_proj(context)).transpose(1, 2)
        out = nn.functional.scaled_dot_product_attention(_rotate(q.transpose(1, 2), rope),
                                                         _rotate(k.transpose(1, 2), context_rope), v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(*x.shape[:-1], -1))


class LLMAdapterTransformerBlock(nn.Module):
    """Self-attention, cross-attention over the text encoder's states, MLP; each pre-normed (``norm_self_attn``,
    ``norm_cross_attn``, ``norm_mlp``) and added back."""

    def __init__(self, source_dim: int, dim: int, num_heads: int, mlp_ratio: float):
        super().__init__()
        hidden = int(dim * mlp_ratio)
        self.norm_self_attn = LLMAdapterRMSNorm(dim)
        self.self_attn = LLMAdapterAttention(dim, dim, num_heads)
        self.norm_cross_attn = LLMAdapterRMSNorm(dim)
        self.cross_attn = LLMAdapterAttention(dim, source_dim, num_heads)
        self.norm_mlp = LLMAdapterRMSNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, x: Tensor, context: Tensor, target_mask: Tensor | None, source_mask: Tensor | None,
                rope: Rope, context_rope: Rope) -> Tensor:
        normed = self.norm_self_attn(x)
        x = x + self.self_attn(normed, normed, target_mask, rope, rope)
        x = x + self.cross_attn(self.norm_cross_attn(x), context, source_mask, rope, context_rope)
        return x + self.mlp(self.norm_mlp(x))


def _key_mask(mask: Tensor | None) -> Tensor | None:
    """A (b, n) key mask (1 = attend) as SDPA's boolean (b, 1, 1, n)."""
    return None if mask is None else mask.to(torch.bool)[:, None, None, :]


class LLMAdapter(nn.Module):
    """Qwen3 states (source) and T5 token ids (target) -> the DiT's cross-attention context (see the module
    docstring). ``embed`` (vocab, dim), ``blocks``, ``out_proj`` (with bias), ``norm``; the RoPE frequencies
    ``rotary_emb.inv_freq`` are a non-persistent buffer."""

    def __init__(self, source_dim: int, dim: int, num_layers: int, num_heads: int, vocab: int, mlp_ratio: float):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.rotary_emb = nn.Module()
        head_dim = dim // num_heads
        inv_freq = 1.0 / (10000 ** ((2 * torch.arange(head_dim // 2)).float() / head_dim))
        self.rotary_emb.register_buffer("inv_freq", inv_freq, persistent=False)
        self.blocks = nn.ModuleList(LLMAdapterTransformerBlock(source_dim, dim, num_heads, mlp_ratio)
                                    for _ in range(num_layers))
        self.out_proj = nn.Linear(dim, dim)
        self.norm = LLMAdapterRMSNorm(dim)

    def forward(self, source_hidden_states: Tensor, target_input_ids: Tensor,
                target_attention_mask: Tensor | None = None, source_attention_mask: Tensor | None = None) -> Tensor:
        """(b, s, source_dim) states and (b, l) ids, with their (b, s) / (b, l) masks -> (b, l, dim)."""
        x = self.embed(target_input_ids)
        inv_freq = self.rotary_emb.inv_freq
        rope = rotary_tables(inv_freq, x.shape[1], x.dtype)
        context_rope = rotary_tables(inv_freq, source_hidden_states.shape[1], x.dtype)
        target_mask, source_mask = _key_mask(target_attention_mask), _key_mask(source_attention_mask)
        for block in self.blocks:
            x = block(x, source_hidden_states, target_mask, source_mask, rope, context_rope)
        return self.norm(self.out_proj(x))
