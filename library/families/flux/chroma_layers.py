"""Chroma's configuration and pieces, as upstream sd-scripts 48d368fa ``library/chroma_models.py`` (lodestone-rock's
``flow/src/models/chroma/model.py``): ``ChromaParams``/``chroma_params``, ``Approximator``, ``distribute_modulations``,
the per-sample trimmed attention of its ``DoubleStreamBlock``/``SingleStreamBlock``, and its ``LastLayer``.

Chroma is FLUX.1-schnell's transformer without the per-block modulation layers (``img_mod``, ``txt_mod``,
``modulation``, ``final_layer.adaLN_modulation``) and without ``time_in``/``vector_in``/``guidance_in``: one MLP, the
``distilled_guidance_layer`` (``Approximator``), maps (timestep, guidance, modulation index) to every shift, scale
and gate vector of the model at once. The blocks compute what FLUX.1's do (``blocks.py``: same norms, projections,
QK-norm, RoPE, MLPs, modulation formulas) except that the modulations come in as inputs and attention runs per sample
over the image tokens then that sample's real text tokens only (no mask; outputs of the cut-off text positions are
zero). The class names stay ``DoubleStreamBlock``/``SingleStreamBlock``: LoRA picks its targets by class name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from library.families.flux.blocks import SingleStreamLayers, mlp, modulate, project_streams, update_streams
from library.families.flux.layers import MLPEmbedder, RMSNorm, SelfAttention, attention, split_heads
from library.families.flux.params import FluxParams

Mods = tuple[Tensor, ...]


@dataclass(frozen=True)
class ChromaParams:
    """Widths and depths of Chroma (upstream ``chroma_models.chroma_params`` as defaults; its ``guidance_embed`` and
    ``_use_compiled`` are read by nothing and left out)."""

    in_channels: int = 64
    context_in_dim: int = 4096
    hidden_size: int = 3072
    mlp_ratio: float = 4.0
    num_heads: int = 24
    depth: int = 19
    depth_single_blocks: int = 38
    axes_dim: tuple[int, ...] = (16, 56, 56)
    theta: int = 10_000
    qkv_bias: bool = True
    approximator_in_dim: int = 64
    approximator_depth: int = 5
    approximator_hidden_size: int = 5120

    @property
    def modulation_count(self) -> int:
        """Vectors the approximator makes: 3 per single block, 2 x 6 per double block, 2 for the final layer."""
        return 3 * self.depth_single_blocks + 2 * 6 * self.depth + 2

    def check(self) -> None:
        """Raise ``ValueError`` for widths the model cannot be built with: FLUX.1's rules, and an approximator input
        that splits into timestep (1/4), guidance (1/4) and modulation index (1/2) embeddings."""
        FluxParams(hidden_size=self.hidden_size, num_heads=self.num_heads, axes_dim=self.axes_dim).check()
        if self.approximator_in_dim % 4:
            raise ValueError(f"approximator_in_dim {self.approximator_in_dim} must be a multiple of 4")


CHROMA = ChromaParams()


class Approximator(nn.Module):
    """``distilled_guidance_layer``: ``in_proj``, ``n_layers`` residual RMSNorm -> ``MLPEmbedder`` steps
    (``norms``, ``layers``), ``out_proj`` to the hidden size."""

    def __init__(self, in_dim: int, out_dim: int, hidden_dim: int, n_layers: int):
        super().__init__()
        self.in_proj = nn.Linear(in_dim, hidden_dim, bias=True)
        self.layers = nn.ModuleList(MLPEmbedder(hidden_dim, hidden_dim) for _ in range(n_layers))
        self.norms = nn.ModuleList(RMSNorm(hidden_dim) for _ in range(n_layers))
        self.out_proj = nn.Linear(hidden_dim, out_dim)

    def forward(self, x: Tensor) -> Tensor:
        x = self.in_proj(x)
        for layer, norm in zip(self.layers, self.norms, strict=True):
            x = x + layer(norm(x))
        return self.out_proj(x)


@dataclass(frozen=True)
class Modulations:
    """The approximator's vectors (b, 1, hidden) per consumer: ``double[i]`` = (image six, text six) as
    (shift, scale, gate) x 2, ``single[i]`` = (shift, scale, gate), ``final`` = (shift, scale)."""

    double: list[tuple[Mods, Mods]]
    single: list[Mods]
    final: Mods


def split_modulations(vectors: Tensor, depth: int, depth_single_blocks: int) -> Modulations:
    """Slice ``vectors`` (b, modulation_count, hidden) in upstream's ``distribute_modulations`` order: the single
    blocks' triples, then every double block's image six, then every double block's text six, then the final two."""
    rows = vectors.split(1, dim=1)
    img_start = 3 * depth_single_blocks
    txt_start = img_start + 6 * depth
    final_start = txt_start + 6 * depth
    single = [rows[3 * i: 3 * i + 3] for i in range(depth_single_blocks)]
    double = [(rows[img_start + 6 * i: img_start + 6 * i + 6], rows[txt_start + 6 * i: txt_start + 6 * i + 6])
              for i in range(depth)]
    return Modulations(double, single, rows[final_start: final_start + 2])


def ragged_attention(q: Tensor, k: Tensor, v: Tensor, pe: Tensor, lengths: Sequence[int]) -> Tensor:
    """Attention of sample i over its first ``lengths[i]`` tokens only (image tokens, then its real text tokens);
    the outputs of the tokens after them are zero. (b, heads, n, d) -> (b, n, heads * d), one SDPA call per sample
    as upstream's block loops."""
    n = q.shape[2]
    out = []
    for i, length in enumerate(lengths):
        part = attention(q[i:i + 1, :, :length], k[i:i + 1, :, :length], v[i:i + 1, :, :length],
                         pe[i:i + 1, :, :length])
        out.append(nn.functional.pad(part, (0, 0, 0, n - length)))
    return torch.cat(out)


class DoubleStreamBlock(nn.Module):
    """FLUX.1's double block (``blocks.DoubleStreamBlock``) without ``img_mod``/``txt_mod``: the modulations are
    inputs, the joint sequence is image then text, attention is ``ragged_attention``."""

    def __init__(self, hidden_size: int, num_heads: int, mlp_ratio: float, qkv_bias: bool):
        super().__init__()
        mlp_hidden_dim = int(hidden_size * mlp_ratio)
        self.num_heads = num_heads
        self.img_norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.img_attn = SelfAttention(hidden_size, num_heads, qkv_bias)
        self.img_norm2 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.img_mlp = mlp(hidden_size, mlp_hidden_dim)
        self.txt_norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.txt_attn = SelfAttention(hidden_size, num_heads, qkv_bias)
        self.txt_norm2 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.txt_mlp = mlp(hidden_size, mlp_hidden_dim)

    def forward(self, img: Tensor, txt: Tensor, pe: Tensor, img_mods: Mods, txt_mods: Mods,
                lengths: Sequence[int]) -> tuple[Tensor, Tensor]:
        (img_q, img_k, img_v), (txt_q, txt_k, txt_v) = project_streams(self, img, txt, img_mods, txt_mods)
        q = torch.cat((img_q, txt_q), dim=2)
        k = torch.cat((img_k, txt_k), dim=2)
        v = torch.cat((img_v, txt_v), dim=2)
        attn = ragged_attention(q, k, v, pe, lengths)
        img_attn, txt_attn = attn[:, : img.shape[1]], attn[:, img.shape[1]:]
        return update_streams(self, img, txt, img_attn, txt_attn, img_mods, txt_mods)


class SingleStreamBlock(SingleStreamLayers):
    """FLUX.1's single block layers (``blocks.SingleStreamLayers``) without ``modulation``: the (shift, scale, gate)
    triple is an input, attention is ``ragged_attention`` over the image + text sequence."""

    def forward(self, x: Tensor, pe: Tensor, mods: Mods, lengths: Sequence[int]) -> Tensor:
        shift, scale, gate = mods
        qkv, mlp = torch.split(
            self.linear1(modulate(self.pre_norm(x), shift, scale)), [3 * self.hidden_size, self.mlp_hidden_dim], -1
        )
        q, k, v = split_heads(qkv, self.num_heads)
        q, k = self.norm(q, k, v)
        attn = ragged_attention(q, k, v, pe, lengths)
        return x + gate * self.linear2(torch.cat((attn, self.mlp_act(mlp)), 2))


class LastLayer(nn.Module):
    """``norm_final`` modulated by the approximator's (shift, scale), then ``linear`` to the patch (FLUX.1's
    ``layers.LastLayer`` without ``adaLN_modulation``)."""

    def __init__(self, hidden_size: int, out_channels: int):
        super().__init__()
        self.norm_final = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(hidden_size, out_channels, bias=True)

    def forward(self, x: Tensor, mods: Mods) -> Tensor:
        shift, scale = mods
        return self.linear(modulate(self.norm_final(x), shift, scale))
