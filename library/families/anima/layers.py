"""The Anima DiT's building blocks with upstream's parameter names, each the class of the same name (or role) in
upstream sd-scripts 48d368fa ``library/anima_models.py``: ``PatchEmbed``, ``VideoRopePosition3DEmb`` (3D RoPE),
``Timesteps`` / ``TimestepEmbedding`` (with the adaLN-LoRA output), ``RMSNorm``, ``Attention`` (self and cross,
QK-norm), ``GPT2FeedForward``, ``FinalLayer`` and the adaLN-LoRA modulation ``Sequential``s.

The class names are upstream's: its LoRA (``networks/lora_anima.py``) picks ``PatchEmbed``, ``TimestepEmbedding``,
``FinalLayer`` and ``Block`` by class name. Attention is PyTorch's SDPA without a mask (upstream's ``torch``
attention mode; it masks nothing, padded text tokens included). Every op runs in the order upstream's runs it, so a
forward and its backward are bit-identical to upstream's in fp32 (``tests/unit/families/anima/test_anima_parity.py``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


def rotate_half(x: Tensor) -> Tensor:
    """(x1, x2) -> (-x2, x1) over the last dim's halves (non-interleaved rotary pairs i and i + d/2)."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` by the angles whose cosines and sines are ``cos``/``sin`` (broadcast to ``x``), taken in
    ``x``'s dtype."""
    return x * cos.to(x.dtype) + rotate_half(x) * sin.to(x.dtype)


def modulation(dim: int, rank: int, chunks: int) -> nn.Sequential:
    """adaLN-LoRA modulation: SiLU, ``dim -> rank``, ``rank -> chunks * dim``, no biases (keys ``.1``, ``.2``)."""
    return nn.Sequential(nn.SiLU(), nn.Linear(dim, rank, bias=False), nn.Linear(rank, chunks * dim, bias=False))


def broadcast_over_tokens(vector: Tensor) -> Tensor:
    """(b, t, d) -> (b, t, 1, 1, d): one value per frame for every token of the frame."""
    return vector[:, :, None, None, :]


class PatchFlatten(nn.Module):
    """(b, c, t*r, h*m, w*n) -> (b, t, h, w, c*r*m*n): each patch's values, channel-major."""

    def __init__(self, spatial: int, temporal: int):
        super().__init__()
        self.spatial, self.temporal = spatial, temporal

    def forward(self, x: Tensor) -> Tensor:
        b, c, frames, height, width = x.shape
        r, p = self.temporal, self.spatial
        x = x.reshape(b, c, frames // r, r, height // p, p, width // p, p)
        return x.permute(0, 2, 4, 6, 1, 3, 5, 7).reshape(b, frames // r, height // p, width // p, c * r * p * p)


class PatchEmbed(nn.Module):
    """``proj``: ``PatchFlatten`` then a bias-free ``Linear`` to the model width (key ``proj.1.weight``)."""

    def __init__(self, spatial: int, temporal: int, in_channels: int, out_channels: int):
        super().__init__()
        self.spatial, self.temporal = spatial, temporal
        dim = in_channels * spatial * spatial * temporal
        self.proj = nn.Sequential(PatchFlatten(spatial, temporal), nn.Linear(dim, out_channels, bias=False))

    def forward(self, x: Tensor) -> Tensor:
        _, _, frames, height, width = x.shape
        if height % self.spatial or width % self.spatial or frames % self.temporal:
            raise ValueError(f"latent size {(frames, height, width)} is not a multiple of the patch size "
                             f"{(self.temporal, self.spatial, self.spatial)}")
        return self.proj(x)


def _axis_exponents(dim: int) -> Tensor:
    """2i / dim for the dim/2 rotary pairs of one axis."""
    return (2 * torch.arange(dim // 2)).float() / dim


class VideoRopePosition3DEmb(nn.Module):
    """Rotary angles of every (frame, row, column) token. The head dim splits into t/h/w shares (h = w =
    ``head_dim // 6 * 2``, t the rest); an axis of width d turns pair i by ``position / theta ** (2i / d)`` with the
    NTK-scaled ``theta = 10000 * ratio ** (d / (d - 2))``; positions are plain indices (no fps modulation). The
    angles of a token are [t, h, w] twice (both rotate-half halves). Buffers ``seq``, ``dim_spatial_range``,
    ``dim_temporal_range`` are persistent, as upstream's (they follow the model's dtype when it is cast)."""

    def __init__(self, head_dim: int, lengths: tuple[int, int, int], ratios: tuple[float, float, float]):
        super().__init__()
        self.max_h, self.max_w, _ = lengths
        spatial = head_dim // 6 * 2
        temporal = head_dim - 2 * spatial
        self.register_buffer("seq", torch.arange(max(lengths)).float())
        self.register_buffer("dim_spatial_range", _axis_exponents(spatial))
        self.register_buffer("dim_temporal_range", _axis_exponents(temporal))
        h_ratio, w_ratio, t_ratio = ratios
        self.h_ntk_factor = h_ratio ** (spatial / (spatial - 2))
        self.w_ntk_factor = w_ratio ** (spatial / (spatial - 2))
        self.t_ntk_factor = t_ratio ** (temporal / (temporal - 2))

    def forward(self, frames: int, height: int, width: int) -> Tensor:
        """Angles (frames * height * width, head_dim), float32, tokens in (t, h, w) order."""
        if height > self.max_h or width > self.max_w:
            raise ValueError(f"token grid {height}x{width} exceeds the position embedding's {self.max_h}x{self.max_w}")
        h_freqs = 1.0 / ((10000.0 * self.h_ntk_factor) ** self.dim_spatial_range)
        w_freqs = 1.0 / ((10000.0 * self.w_ntk_factor) ** self.dim_spatial_range)
        t_freqs = 1.0 / ((10000.0 * self.t_ntk_factor) ** self.dim_temporal_range)
        grid = (frames, height, width)
        t = torch.outer(self.seq[:frames], t_freqs)[:, None, None, :].expand(*grid, -1)
        h = torch.outer(self.seq[:height], h_freqs)[None, :, None, :].expand(*grid, -1)
        w = torch.outer(self.seq[:width], w_freqs)[None, None, :, :].expand(*grid, -1)
        return torch.cat([t, h, w, t, h, w], dim=-1).reshape(frames * height * width, -1).float()


class Timesteps(nn.Module):
    """Sinusoidal features (b, t) -> (b, t, dim): [cos, sin] of ``t * exp(-ln(10000) i / (dim/2))``, computed in
    float32 and returned in the timesteps' dtype (upstream passes sigmas in [0, 1], not 0..1000)."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def forward(self, timesteps: Tensor) -> Tensor:
        half = self.dim // 2
        exponent = -math.log(10000) * torch.arange(half, dtype=torch.float32, device=timesteps.device) / half
        angles = timesteps.flatten().float()[:, None] * torch.exp(exponent)[None, :]
        features = torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1).to(timesteps.dtype)
        return features.reshape(*timesteps.shape, self.dim)


class TimestepEmbedding(nn.Module):
    """adaLN-LoRA timestep MLP: ``linear_1`` (dim -> dim), SiLU, ``linear_2`` (dim -> 3 dim), no biases. Returns the
    input features unchanged (the blocks' conditioning, after ``t_embedding_norm``) and the MLP's output (the
    adaLN-LoRA term every modulation adds)."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear_1 = nn.Linear(dim, dim, bias=False)
        self.activation = nn.SiLU()
        self.linear_2 = nn.Linear(dim, 3 * dim, bias=False)

    def forward(self, features: Tensor) -> tuple[Tensor, Tensor]:
        return features, self.linear_2(self.activation(self.linear_1(features)))


class RMSNorm(nn.Module):
    """RMS normalisation over the last dim in float32 (eps 1e-6), back to the input's dtype, times ``weight``."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


class Attention(nn.Module):
    """Multi-head attention without biases: ``q_proj``/``k_proj``/``v_proj``/``output_proj``, per-head RMSNorm
    ``q_norm``/``k_norm`` on queries and keys; RoPE on both when it is self-attention (``context_dim`` None), none
    in cross-attention (keys and values from the context, width ``context_dim``)."""

    def __init__(self, dim: int, num_heads: int, context_dim: int | None = None):
        super().__init__()
        self.is_selfattn = context_dim is None
        self.n_heads, self.head_dim = num_heads, dim // num_heads
        context_dim = dim if context_dim is None else context_dim
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.q_norm = RMSNorm(self.head_dim)
        self.k_proj = nn.Linear(context_dim, dim, bias=False)
        self.k_norm = RMSNorm(self.head_dim)
        self.v_proj = nn.Linear(context_dim, dim, bias=False)
        self.output_proj = nn.Linear(dim, dim, bias=False)

    def _heads(self, x: Tensor) -> Tensor:
        return x.view(*x.shape[:-1], self.n_heads, self.head_dim)

    def forward(self, x: Tensor, context: Tensor | None = None, rope: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """``x`` (b, n, dim); ``rope`` the (cos, sin) of every query token, (1, n, 1, head_dim), self-attention
        only. Returns (b, n, dim)."""
        context = x if context is None else context
        q = self.q_norm(self._heads(self.q_proj(x)))
        k = self.k_norm(self._heads(self.k_proj(context)))
        v = self._heads(self.v_proj(context))
        if self.is_selfattn and rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        out = nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        out = out.transpose(1, 2)
        return self.output_proj(out.reshape(out.shape[0], out.shape[1], -1))


class GPT2FeedForward(nn.Module):
    """``layer1`` (dim -> hidden), exact GELU, ``layer2`` (hidden -> dim), no biases."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.activation = nn.GELU()
        self.layer1 = nn.Linear(dim, hidden, bias=False)
        self.layer2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.layer2(self.activation(self.layer1(x)))


class FinalLayer(nn.Module):
    """LayerNorm (no affine, eps 1e-6) modulated by (shift, scale) = ``adaln_modulation(emb)`` plus the first two
    thirds of the adaLN-LoRA term, then ``linear`` (no bias) to one patch of output channels."""

    def __init__(self, dim: int, patch_values: int, rank: int):
        super().__init__()
        self.hidden_size = dim
        self.layer_norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(dim, patch_values, bias=False)
        self.adaln_modulation = modulation(dim, rank, 2)

    def forward(self, x: Tensor, emb: Tensor, adaln_lora: Tensor) -> Tensor:
        mods = self.adaln_modulation(emb) + adaln_lora[:, :, : 2 * self.hidden_size]
        shift, scale = (broadcast_over_tokens(m) for m in mods.chunk(2, dim=-1))
        return self.linear(self.layer_norm(x) * (1 + scale) + shift)
