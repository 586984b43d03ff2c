"""The two FLUX.1 block kinds: ``DoubleStreamBlock`` (separate image and text weights, joint attention) and
``SingleStreamBlock`` (one stream over the text + image sequence, attention and MLP in parallel linears).

They reproduce upstream sd-scripts' ``library/flux_models.py`` ``DoubleStreamBlock._forward`` and
``SingleStreamBlock._forward`` (BFL's ``flux/modules/layers.py``) with BFL's parameter names. Gradient
checkpointing and offloading are the model's business (``FluxTransformer.run_block``), not the blocks'.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from library.families.flux.layers import Modulation, QKNorm, SelfAttention, attention, split_heads, text_mask


def modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    return (1 + scale) * x + shift


def mlp(hidden_size: int, mlp_hidden_dim: int) -> nn.Sequential:
    """``{img,txt}_mlp``: ``.0`` Linear up, ``.1`` tanh GELU, ``.2`` Linear down."""
    return nn.Sequential(
        nn.Linear(hidden_size, mlp_hidden_dim, bias=True),
        nn.GELU(approximate="tanh"),
        nn.Linear(mlp_hidden_dim, hidden_size, bias=True),
    )


class DoubleStreamBlock(nn.Module):
    """Image and text streams with their own modulation, attention projections and MLPs, attending jointly
    (text tokens first)."""

    def __init__(self, hidden_size: int, num_heads: int, mlp_ratio: float, qkv_bias: bool):
        super().__init__()
        mlp_hidden_dim = int(hidden_size * mlp_ratio)
        self.num_heads = num_heads
        self.img_mod = Modulation(hidden_size, double=True)
        self.img_norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.img_attn = SelfAttention(hidden_size, num_heads, qkv_bias)
        self.img_norm2 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.img_mlp = mlp(hidden_size, mlp_hidden_dim)
        self.txt_mod = Modulation(hidden_size, double=True)
        self.txt_norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.txt_attn = SelfAttention(hidden_size, num_heads, qkv_bias)
        self.txt_norm2 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.txt_mlp = mlp(hidden_size, mlp_hidden_dim)

    def forward(
        self, img: Tensor, txt: Tensor, vec: Tensor, pe: Tensor, txt_attention_mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        img_mods, txt_mods = self.img_mod(vec), self.txt_mod(vec)
        (img_q, img_k, img_v), (txt_q, txt_k, txt_v) = project_streams(self, img, txt, img_mods, txt_mods)
        q = torch.cat((txt_q, img_q), dim=2)
        k = torch.cat((txt_k, img_k), dim=2)
        v = torch.cat((txt_v, img_v), dim=2)
        attn = attention(q, k, v, pe, text_mask(txt_attention_mask, q.shape[2]))
        txt_attn, img_attn = attn[:, : txt.shape[1]], attn[:, txt.shape[1]:]
        return update_streams(self, img, txt, img_attn, txt_attn, img_mods, txt_mods)


def project_streams(block: nn.Module, img: Tensor, txt: Tensor, img_mods: Sequence[Tensor],
                    txt_mods: Sequence[Tensor]) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
    """A double block's q, k, v of each stream from its first (shift, scale) modulation (FLUX.1's and Chroma's
    blocks alike; ``*_mods``: shift1, scale1, gate1, shift2, scale2, gate2)."""
    return (block.img_attn.project(modulate(block.img_norm1(img), img_mods[0], img_mods[1])),
            block.txt_attn.project(modulate(block.txt_norm1(txt), txt_mods[0], txt_mods[1])))


def update_streams(block: nn.Module, img: Tensor, txt: Tensor, img_attn: Tensor, txt_attn: Tensor,
                   img_mods: Sequence[Tensor], txt_mods: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """A double block's residual updates: each stream's attention output and MLP, gated (gate1, gate2) and the MLP
    modulated by (shift2, scale2)."""
    img = img + img_mods[2] * block.img_attn.proj(img_attn)
    img = img + img_mods[5] * block.img_mlp(modulate(block.img_norm2(img), img_mods[3], img_mods[4]))
    txt = txt + txt_mods[2] * block.txt_attn.proj(txt_attn)
    txt = txt + txt_mods[5] * block.txt_mlp(modulate(block.txt_norm2(txt), txt_mods[3], txt_mods[4]))
    return img, txt


class SingleStreamLayers(nn.Module):
    """The layers of a single block (FLUX.1's and Chroma's): ``linear1`` gives q, k, v and the MLP input at once,
    ``linear2`` takes attention output and activated MLP together (the parallel block of arXiv:2302.05442)."""

    def __init__(self, hidden_size: int, num_heads: int, mlp_ratio: float):
        super().__init__()
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.mlp_hidden_dim = int(hidden_size * mlp_ratio)
        self.linear1 = nn.Linear(hidden_size, hidden_size * 3 + self.mlp_hidden_dim)
        self.linear2 = nn.Linear(hidden_size + self.mlp_hidden_dim, hidden_size)
        self.norm = QKNorm(hidden_size // num_heads)
        self.pre_norm = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.mlp_act = nn.GELU(approximate="tanh")


class SingleStreamBlock(SingleStreamLayers):
    """FLUX.1's single block: the layers with their own ``modulation`` (registered last, as upstream's)."""

    def __init__(self, hidden_size: int, num_heads: int, mlp_ratio: float):
        super().__init__(hidden_size, num_heads, mlp_ratio)
        self.modulation = Modulation(hidden_size, double=False)

    def forward(self, x: Tensor, vec: Tensor, pe: Tensor, txt_attention_mask: Tensor | None = None) -> Tensor:
        shift, scale, gate = self.modulation(vec)
        qkv, mlp = torch.split(
            self.linear1(modulate(self.pre_norm(x), shift, scale)), [3 * self.hidden_size, self.mlp_hidden_dim], -1
        )
        q, k, v = split_heads(qkv, self.num_heads)
        q, k = self.norm(q, k, v)
        attn = attention(q, k, v, pe, text_mask(txt_attention_mask, x.shape[1]))
        return x + gate * self.linear2(torch.cat((attn, self.mlp_act(mlp)), 2))
