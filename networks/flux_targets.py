"""Which layers of FLUX.1 and its text encoders get a LoRA module, under which name and with which rank, as
upstream sd-scripts 48d368fa ``networks/lora_flux.py`` (``LoRANetwork.__init__`` / ``create_modules``).

Candidates, in upstream's order: CLIP-L (``lora_te1_``, Linear layers in ``CLIPAttention`` / ``CLIPMLP``), T5-XXL
(``lora_te3_``, in ``T5Attention`` / ``T5DenseGatedActDense``) only with ``train_t5xxl``, then the Linear layers of
the transformer's ``DoubleStreamBlock`` and/or ``SingleStreamBlock`` modules (``train_blocks``), then with
``in_dims`` the layers whose name contains ``_img_in``, ``_time_in``, ``_vector_in``, ``_guidance_in``, ``_txt_in``.
Names: prefix + module path with "." -> "_" (``lora_unet_double_blocks_0_img_attn_qkv``).

Rank of a candidate (``rank_of``): the first ``network_reg_dims`` regex that matches (``re.search``); else the
``in_dims`` entry (in-layers) or the network rank, replaced by the first matching per-part dim (``img_attn``,
``txt_attn``, ``img_mlp``, ``txt_mlp``, ``img_mod``, ``txt_mod``, ``single_blocks`` + ``linear``, ``modulation``),
then 0 for a block not in ``train_double_block_indices`` / ``train_single_block_indices``. Rank 0: no module.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from networks.families import LoRAFamily, no_block
from networks.flux_args import FluxLoRAArgs, parse_block_selection
from networks.lora_modules import TEXT_ENCODER_TARGETS, iter_targets, text_model_prefix

PREFIX_FLUX = "lora_unet"
PREFIX_CLIP = "lora_te1"
PREFIX_T5 = "lora_te3"
DOUBLE_BLOCK = "DoubleStreamBlock"
SINGLE_BLOCK = "SingleStreamBlock"
T5_TARGETS = ("T5Attention", "T5DenseGatedActDense")
IN_FILTERS = ("_img_in", "_time_in", "_vector_in", "_guidance_in", "_txt_in")
# substrings of the name that select each per-part dim, in flux_args.TYPE_DIM_KEYS order (upstream's ``identifier``)
TYPE_DIM_IDENTIFIERS = (("img_attn",), ("txt_attn",), ("img_mlp",), ("txt_mlp",), ("img_mod",), ("txt_mod",),
                        ("single_blocks", "linear"), ("modulation",))
# the LoRA family facts of FLUX.1: CLIP-L and T5-XXL prefixes, no U-Net block layout
FLUX_LORA_FAMILY = LoRAFamily("flux", (PREFIX_CLIP, PREFIX_T5), None, no_block, False)
_BLOCK = re.compile(r"^lora_unet_(double|single)_blocks_(\d+)_")


@dataclass(frozen=True)
class Candidate:
    """A layer that may get a LoRA module: its LoRA name, the layer, whether it is in the transformer, and the
    in_dims rank that replaces the network rank (in-layers only)."""

    name: str
    layer: nn.Linear | nn.Conv2d
    is_flux: bool
    in_dim: int | None = None


@dataclass(frozen=True)
class BlockSelection:
    """Which double / single blocks train (None: all)."""

    double: list[bool] | None
    single: list[bool] | None


def count_blocks(flux: nn.Module) -> tuple[int, int]:
    """The number of double and single blocks of the transformer (19 and 38 for FLUX.1)."""
    kinds = [m.__class__.__name__ for m in flux.modules()]
    return kinds.count(DOUBLE_BLOCK), kinds.count(SINGLE_BLOCK)


def block_selection(flux: nn.Module, args: FluxLoRAArgs) -> BlockSelection:
    """``train_double_block_indices`` / ``train_single_block_indices`` against this model's block counts (upstream
    checks them against FLUX.1's 19 / 38 whatever the model)."""
    doubles, singles = count_blocks(flux)
    double = None if args.double_indices is None else parse_block_selection(
        "train_double_block_indices", args.double_indices, doubles)
    single = None if args.single_indices is None else parse_block_selection(
        "train_single_block_indices", args.single_indices, singles)
    return BlockSelection(double, single)


def text_encoder_candidates(text_encoders: Sequence[nn.Module | None], train_t5xxl: bool) -> Iterator[Candidate]:
    """CLIP-L (index 0) always, T5-XXL (index 1) only with ``train_t5xxl``; a missing encoder is skipped."""
    for index, encoder in enumerate(text_encoders[:2]):
        if encoder is None or (index > 0 and not train_t5xxl):
            continue
        if index == 0:
            found = iter_targets(encoder, PREFIX_CLIP, TEXT_ENCODER_TARGETS, text_model_prefix(encoder))
        else:
            found = iter_targets(encoder, PREFIX_T5, T5_TARGETS)
        for name, layer in found:
            yield Candidate(name, layer, False)


def flux_candidates(flux: nn.Module, train_blocks: str, in_dims: Sequence[int] | None) -> Iterator[Candidate]:
    """The block layers (``train_blocks``: all, single, double), then the in-layers when ``in_dims`` is given."""
    classes = {"all": (DOUBLE_BLOCK, SINGLE_BLOCK), "single": (SINGLE_BLOCK,), "double": (DOUBLE_BLOCK,)}
    for name, layer in iter_targets(flux, PREFIX_FLUX, classes[train_blocks]):
        yield Candidate(name, layer, True)
    if in_dims is None:
        return
    for name_filter, in_dim in zip(IN_FILTERS, in_dims, strict=True):
        for path, layer in flux.named_modules():
            name = f"{PREFIX_FLUX}_{path.replace('.', '_')}"
            if isinstance(layer, (nn.Linear, nn.Conv2d)) and name_filter in name:
                yield Candidate(name, layer, True, in_dim)


def rank_of(candidate: Candidate, dim: int, args: FluxLoRAArgs, blocks: BlockSelection) -> int:
    """The rank of a candidate when the network is created from arguments (see the module docstring)."""
    name = candidate.name
    for pattern, reg_dim in args.reg_dims.items():
        if re.search(pattern, name):
            return reg_dim
    rank = candidate.in_dim if candidate.in_dim is not None else dim
    if not candidate.is_flux:
        return rank
    if args.type_dims is not None:
        for type_dim, identifiers in zip(args.type_dims, TYPE_DIM_IDENTIFIERS, strict=True):
            if type_dim is not None and all(part in name for part in identifiers):
                rank = type_dim
                break
    match = _BLOCK.match(name)
    if rank and match:
        selected = blocks.double if match.group(1) == "double" else blocks.single
        if selected is not None and not selected[int(match.group(2))]:
            return 0
    return rank


def split_dims(candidate: Candidate) -> tuple[int, ...] | None:
    """``split_qkv``: the parts of a fused projection, each with its own LoRA (diffusers' separate to_q/to_k/to_v,
    proj_mlp): a double block's ``img_attn.qkv`` / ``txt_attn.qkv`` is q, k, v (3 x hidden), a single block's
    ``linear1`` q, k, v and the MLP input (3 x hidden + mlp). None for every other layer."""
    match = _BLOCK.match(candidate.name)
    layer = candidate.layer
    if match is None or not isinstance(layer, nn.Linear):
        return None
    hidden = layer.in_features
    if match.group(1) == "double" and candidate.name.endswith("_attn_qkv"):
        return (hidden,) * 3
    if match.group(1) == "single" and candidate.name.endswith("_linear1"):
        return (hidden,) * 3 + (layer.out_features - 3 * hidden,)
    return None


class BlockDiagonalLinear(nn.Linear):
    """A LoRA ``up`` for ``split_qkv``: one (sum of parts, parts x rank) weight whose off-diagonal blocks are held
    at zero: masked in forward (so they get no gradient), in the state dict and when weights are loaded.
    ``up @ down`` is then the parts' own LoRAs side by side, and the weight is already in the merged layout
    upstream's ``LoRANetwork.state_dict`` writes for split modules (down (parts x rank, in), up block-diagonal)."""

    def __init__(self, rank: int, dims: Sequence[int]) -> None:
        super().__init__(rank * len(dims), sum(dims), bias=False)
        mask = torch.zeros(sum(dims), rank * len(dims))
        row = 0
        for part, size in enumerate(dims):
            mask[row:row + size, part * rank:(part + 1) * rank] = 1.0
            row += size
        self.register_buffer("mask", mask, persistent=False)
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight * self.mask.to(self.weight.dtype))

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if not keep_vars:
            destination[prefix + "weight"] = (self.weight * self.mask.to(self.weight.dtype)).detach()

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        with torch.no_grad():
            self.weight.mul_(self.mask.to(self.weight.dtype))
