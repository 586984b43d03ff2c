"""Which layers of the Anima DiT and its Qwen3 text encoder get a LoRA module, under which name and with which rank,
as upstream sd-scripts 48d368fa ``networks/lora_anima.py`` (``LoRANetwork.__init__`` / ``create_modules``).

Candidates, in upstream's order: the Qwen3 text encoder (``lora_te``, the Linear layers inside ``Qwen3Attention``
/ ``Qwen3MLP``, also under their older SDPA / FlashAttention2 class names), then the Linear / Conv2d layers inside
the DiT's ``Block``, ``PatchEmbed``, ``TimestepEmbedding`` and ``FinalLayer`` modules (``lora_unet``), with
``train_llm_adapter`` also inside the adapter's ``LLMAdapterTransformerBlock`` modules. A layer's path is its
module path in that model (``blocks.0.self_attn.q_proj``, ``layers.0.mlp.gate_proj``); its name is the prefix and
the path with "." -> "_" (``lora_unet_blocks_0_self_attn_q_proj``, ``lora_te_layers_0_mlp_gate_proj``).

Selection (``selected``): a path that an exclude pattern matches as a whole (``re.fullmatch``) is left out unless an
include pattern matches it as a whole (an include overrides every exclusion, the default one too). Rank
(``rank_alpha``): the first ``network_reg_dims`` regex that matches the whole path, with the network alpha; else
the network rank and alpha for a Linear or 1x1 conv; a 3x3 conv only through ``network_reg_dims``. Rank 0: no
module; an excluded path gets none whatever ``network_reg_dims`` says.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from library.base.errors import UserError
from networks.families import LoRAFamily, no_block
from networks.lora_modules import iter_target_layers

PREFIX_DIT = "lora_unet"
PREFIX_QWEN3 = "lora_te"
DIT_TARGETS = ("Block", "PatchEmbed", "TimestepEmbedding", "FinalLayer")
ADAPTER_TARGETS = ("LLMAdapterTransformerBlock",)
QWEN3_TARGETS = ("Qwen3Attention", "Qwen3MLP", "Qwen3SdpaAttention", "Qwen3FlashAttention2")
# the LoRA family facts of Anima: one text encoder under ``lora_te``, no U-Net block layout
ANIMA_LORA_FAMILY = LoRAFamily("anima", (PREFIX_QWEN3,), None, no_block, False)


@dataclass(frozen=True)
class Candidate:
    """A layer that may get a LoRA module: its LoRA name, its module path (what the patterns match), the layer and
    whether it is in the DiT."""

    name: str
    path: str
    layer: nn.Linear | nn.Conv2d
    is_dit: bool


def iter_candidates(root: nn.Module, prefix: str, target_classes: Sequence[str], is_dit: bool) -> Iterator[Candidate]:
    """The Linear / Conv2d layers inside every module of ``root`` whose class name is targeted, each once."""
    for path, layer in iter_target_layers(root, tuple(target_classes)):
        yield Candidate(f"{prefix}.{path}".replace(".", "_"), path, layer, is_dit)


def text_encoder_candidates(text_encoders: Sequence[nn.Module | None] | nn.Module | None) -> Iterator[Candidate]:
    """The Qwen3 layers; ``text_encoders`` is [qwen3] (or the module, or None). Upstream names every encoder's
    modules ``lora_te_...`` and fails on the duplicates of a second one: more than one is refused here."""
    encoders = [text_encoders] if isinstance(text_encoders, nn.Module) else list(text_encoders or [])
    encoders = [encoder for encoder in encoders if encoder is not None]
    if len(encoders) > 1:
        raise UserError(f"networks.lora_anima: {len(encoders)} text encoders given; Anima has one (Qwen3)")
    for encoder in encoders:
        yield from iter_candidates(encoder, PREFIX_QWEN3, QWEN3_TARGETS, False)


def dit_candidates(dit: nn.Module, train_llm_adapter: bool) -> Iterator[Candidate]:
    """The DiT's layers; with ``train_llm_adapter`` the adapter blocks' too."""
    targets = DIT_TARGETS + (ADAPTER_TARGETS if train_llm_adapter else ())
    yield from iter_candidates(dit, PREFIX_DIT, targets, True)


def compile_patterns(patterns: Sequence[str]) -> list[re.Pattern[str]]:
    return [re.compile(pattern) for pattern in patterns]


def selected(path: str, excludes: Sequence[re.Pattern[str]], includes: Sequence[re.Pattern[str]]) -> bool:
    """Whether a layer is trained: not excluded, or included."""
    if not any(pattern.fullmatch(path) for pattern in excludes):
        return True
    return any(pattern.fullmatch(path) for pattern in includes)


def rank_alpha(candidate: Candidate, dim: int, alpha: Any, reg_dims: dict[str, int]) -> tuple[int, Any]:
    """The rank and alpha of a selected layer (see the module docstring)."""
    for pattern, reg_dim in reg_dims.items():
        if re.fullmatch(pattern, candidate.path):
            return reg_dim, alpha
    layer = candidate.layer
    if isinstance(layer, nn.Linear) or layer.kernel_size == (1, 1):
        return dim, alpha
    return 0, None
