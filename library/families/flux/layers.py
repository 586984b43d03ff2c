"""The FLUX.1 transformer's small pieces: rotary position embedding over the three id axes, the sinusoidal
timestep embedding, the MLP embedders, QK RMSNorm, modulation and the final layer.

Each reproduces the function or class of the same role in upstream sd-scripts' ``library/flux_models.py`` (BFL's
``flux/math.py`` and ``flux/modules/layers.py``): ``rope``/``apply_rope``/``EmbedND``, ``timestep_embedding``,
``MLPEmbedder``, ``RMSNorm``/``QKNorm``, ``SelfAttention``, ``Modulation``, ``LastLayer``. Parameter names are
BFL's, so a BFL state dict loads as it is. The precision choices are upstream's: RoPE tables in float64 then
float32, rotation and RMSNorm in float32, the result cast back to the input's dtype.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


def rope(pos: Tensor, dim: int, theta: int) -> Tensor:
    """Rotation matrices for positions ``pos`` (b, n) on ``dim`` channels: (b, n, dim/2, 2, 2), float32.

    Channel pair i turns by ``pos * theta ** (-2i/dim)``; each 2x2 block is [[cos, -sin], [sin, cos]].
    """
    exponent = torch.arange(0, dim, 2, dtype=torch.float64, device=pos.device) / dim
    angle = pos.to(torch.float64)[..., None] * (1.0 / theta**exponent)
    cos, sin = torch.cos(angle), torch.sin(angle)
    rows = torch.stack([cos, -sin, sin, cos], dim=-1)
    return rows.reshape(*angle.shape, 2, 2).float()


def _rotate(x: Tensor, freqs: Tensor) -> Tensor:
    pairs = x.float().reshape(*x.shape[:-1], -1, 1, 2)
    turned = freqs[..., 0] * pairs[..., 0] + freqs[..., 1] * pairs[..., 1]
    return turned.reshape(x.shape).type_as(x)


def apply_rope(q: Tensor, k: Tensor, freqs: Tensor) -> tuple[Tensor, Tensor]:
    """Rotate the channel pairs of ``q`` and ``k`` (b, heads, n, head_dim) by the tables of ``rope``."""
    return _rotate(q, freqs), _rotate(k, freqs)


def attention(q: Tensor, k: Tensor, v: Tensor, pe: Tensor, mask: Tensor | None = None) -> Tensor:
    """RoPE, then scaled-dot-product attention; (b, heads, n, d) -> (b, n, heads * d)."""
    q, k = apply_rope(q, k, pe)
    out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.transpose(1, 2).flatten(2)


def split_heads(qkv: Tensor, num_heads: int) -> tuple[Tensor, Tensor, Tensor]:
    """(b, n, 3 * heads * d) -> q, k, v each (b, heads, n, d), the ``"B L (K H D) -> K B H L D"`` split."""
    b, n, _ = qkv.shape
    q, k, v = qkv.reshape(b, n, 3, num_heads, -1).permute(2, 0, 3, 1, 4)
    return q, k, v


def text_mask(txt_attention_mask: Tensor | None, total_len: int) -> Tensor | None:
    """The T5 attention mask (b, txt_len) widened to every key (image keys always attended): (b, 1, 1, total_len),
    boolean, broadcast over heads and queries by SDPA."""
    if txt_attention_mask is None:
        return None
    keep = txt_attention_mask.to(torch.bool)
    image = torch.ones(keep.shape[0], total_len - keep.shape[1], dtype=torch.bool, device=keep.device)
    return torch.cat((keep, image), dim=1)[:, None, None, :]


class EmbedND(nn.Module):
    """RoPE tables for ids (b, n, axes): each axis gets its ``axes_dim`` share of the head channels."""

    def __init__(self, theta: int, axes_dim: tuple[int, ...]):
        super().__init__()
        self.theta = theta
        self.axes_dim = tuple(axes_dim)

    def forward(self, ids: Tensor) -> Tensor:
        tables = [rope(ids[..., axis], dim, self.theta) for axis, dim in enumerate(self.axes_dim)]
        return torch.cat(tables, dim=-3).unsqueeze(1)


def timestep_embedding(t: Tensor, dim: int, max_period: int = 10_000, time_factor: float = 1000.0) -> Tensor:
    """Sinusoidal embedding (cos half, then sin half) of ``time_factor * t``; in ``t``'s dtype when it is a float.

    The scaling happens in ``t``'s own dtype before the float32 product, as upstream's does.
    """
    t = time_factor * t
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32) / half).to(t.device)
    args = t[:, None].float() * freqs[None]
    embedding = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    if dim % 2:
        embedding = torch.cat([embedding, torch.zeros_like(embedding[:, :1])], dim=-1)
    return embedding.to(t) if torch.is_floating_point(t) else embedding


class MLPEmbedder(nn.Module):
    """``in_layer`` -> SiLU -> ``out_layer`` (``time_in``, ``vector_in``, ``guidance_in``)."""

    def __init__(self, in_dim: int, hidden_dim: int):
        super().__init__()
        self.in_layer = nn.Linear(in_dim, hidden_dim, bias=True)
        self.silu = nn.SiLU()
        self.out_layer = nn.Linear(hidden_dim, hidden_dim, bias=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.out_layer(self.silu(self.in_layer(x)))


class RMSNorm(nn.Module):
    """RMS normalisation over the last dim in float32 with a learned ``scale`` (eps 1e-6).

    The square is one op (``square``, a power of 2, as upstream's ``x**2``), not ``x * x``: both give the same
    forward, but ``x * x`` hands autograd two gradient terms for ``x`` that it sums in another order than upstream's
    one, which moved every LoRA gradient by an fp32 ulp or so from the first update on (issue 28 item 6)."""

    def __init__(self, dim: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(torch.mean(x32.square(), dim=-1, keepdim=True) + 1e-6)
        return (normed * self.scale.float()).to(x.dtype)


class QKNorm(nn.Module):
    """``query_norm`` and ``key_norm``; the results take ``v``'s dtype and device."""

    def __init__(self, dim: int):
        super().__init__()
        self.query_norm = RMSNorm(dim)
        self.key_norm = RMSNorm(dim)

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return self.query_norm(q).to(v), self.key_norm(k).to(v)


class SelfAttention(nn.Module):
    """Holds a stream's ``qkv``, ``norm`` and ``proj``; the blocks call them directly (joint attention)."""

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.norm = QKNorm(dim // num_heads)
        self.proj = nn.Linear(dim, dim)

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q, k (RMS-normed) and v of ``x``, each (b, heads, n, d)."""
        q, k, v = split_heads(self.qkv(x), self.num_heads)
        q, k = self.norm(q, k, v)
        return q, k, v


class Modulation(nn.Module):
    """``lin(silu(vec))`` split into (shift, scale, gate) triples: two for a double block, one for a single."""

    def __init__(self, dim: int, double: bool):
        super().__init__()
        self.multiplier = 6 if double else 3
        self.lin = nn.Linear(dim, self.multiplier * dim, bias=True)

    def forward(self, vec: Tensor) -> tuple[Tensor, ...]:
        return self.lin(nn.functional.silu(vec))[:, None, :].chunk(self.multiplier, dim=-1)


class LastLayer(nn.Module):
    """Adaptive LayerNorm (``adaLN_modulation``: SiLU, Linear -> shift, scale) then ``linear`` to the patch."""

    def __init__(self, hidden_size: int, out_channels: int):
        super().__init__()
        self.norm_final = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(hidden_size, out_channels, bias=True)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size, bias=True))

    def forward(self, x: Tensor, vec: Tensor) -> Tensor:
        shift, scale = self.adaLN_modulation(vec).chunk(2, dim=1)
        return self.linear((1 + scale[:, None, :]) * self.norm_final(x) + shift[:, None, :])
