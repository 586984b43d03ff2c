"""LoRA for Anima (``--network_module networks.lora_anima``), file- and flag-compatible with upstream sd-scripts
48d368fa ``networks/lora_anima.py``.

Protocol as upstream: ``create_network(multiplier, network_dim, network_alpha, vae, text_encoders, dit,
neuron_dropout=None, **network_args)`` and ``create_network_from_weights(multiplier, file, vae, text_encoders, dit,
weights_sd=None, for_inference=False, **kwargs)``; ``text_encoders`` is [Qwen3] (``Qwen3Model``; may be None or
empty). The network is a ``networks.lora.LoRANetwork`` (apply_to, set_multiplier, merge_to, max-norm
regularisation, load/save with the sshs hashes are that class's) with Anima's modules (``networks/anima_targets.py``)
and upstream's ``prepare_optimizer_params_with_multiple_te_lrs`` (``networks/anima_groups.py``); the network args
are ``networks/anima_args.py``. Modules are ``networks.lora_modules.LoRAModule`` (upstream uses
``lora_flux.LoRAModule``: the same math, dropouts and saved keys), each with its module path as ``original_name``.

Keys: ``lora_unet_<DiT path>`` (``lora_unet_blocks_0_self_attn_q_proj``, ``lora_unet_blocks_0_mlp_layer1``; with
``train_llm_adapter`` also ``lora_unet_llm_adapter_blocks_0_cross_attn_k_proj``, ``..._mlp_0``), ``lora_te_<Qwen3
path>`` (``lora_te_layers_0_self_attn_q_proj``, ``lora_te_layers_0_mlp_gate_proj``); ``.lora_down.weight``,
``.lora_up.weight``, 0-d float32 ``.alpha``. Defaults on the real model: 280 DiT modules (10 per block), 60 more
with the adapter, 196 Qwen3 modules (the trainer drops them with ``--network_train_unet_only``).
``networks/convert_anima_lora_to_comfy.py`` renames them for ComfyUI and back.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from networks.anima_args import AnimaLoRAArgs, parse_anima_network_args
from networks.anima_groups import anima_groups
from networks.anima_targets import (
    ANIMA_LORA_FAMILY,
    PREFIX_DIT,
    PREFIX_QWEN3,
    Candidate,
    compile_patterns,
    dit_candidates,
    rank_alpha,
    selected,
    text_encoder_candidates,
)
from networks.args import LoRAArgs
from networks.lora import LoRANetwork
from networks.lora_format import module_ranks
from networks.lora_modules import LoRAModule

__all__ = ["AnimaLoRANetwork", "create_network", "create_network_from_weights"]

logger = logging.getLogger(__name__)


class AnimaLoRANetwork(LoRANetwork):
    """The LoRA modules of an Anima DiT and its Qwen3 text encoder (upstream ``lora_anima.LoRANetwork``).

    With ``modules_dim`` (from a file) every candidate layer named there gets that rank and alpha and nothing else
    does (no exclusions); otherwise the layers are selected and ranked by ``anima_targets.selected`` /
    ``rank_alpha``. Its ``family`` is ``anima_targets.ANIMA_LORA_FAMILY`` (``lora_te``, no U-Net blocks).
    """

    LORA_PREFIX_ANIMA = PREFIX_DIT
    LORA_PREFIX_TEXT_ENCODER = PREFIX_QWEN3

    def __init__(
        self,
        text_encoders: Sequence[nn.Module | None] | nn.Module | None,
        dit: nn.Module | None,
        multiplier: float = 1.0,
        args: LoRAArgs | None = None,
        anima_args: AnimaLoRAArgs | None = None,
        modules_dim: Mapping[str, int] | None = None,
        modules_alpha: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(None, None, multiplier=multiplier, args=args, family=ANIMA_LORA_FAMILY)
        self.anima_args = anima_args if anima_args is not None else AnimaLoRAArgs()
        self.train_llm_adapter = self.anima_args.train_llm_adapter
        te_found = list(text_encoder_candidates(text_encoders))
        dit_found = list(dit_candidates(dit, self.train_llm_adapter)) if dit is not None else []
        if modules_dim is None:
            ranks = self._ranks(te_found + dit_found)
        else:
            alphas = modules_alpha or {}
            ranks = {name: (dim, alphas.get(name)) for name, dim in modules_dim.items()}
        self.text_encoder_loras = self._make_loras(te_found, ranks)
        self.unet_loras = self._make_loras(dit_found, ranks)
        for lora in self.text_encoder_loras + self.unet_loras:
            self.add_module(lora.lora_name, lora)
        self._log(te_found + dit_found, ranks)

    def _ranks(self, candidates: Iterable[Candidate]) -> dict[str, tuple[int, Any]]:
        """Rank and alpha of every candidate that the patterns select (upstream ``create_modules``)."""
        a, anima = self.args, self.anima_args
        excludes, includes = compile_patterns(anima.exclude_patterns), compile_patterns(anima.include_patterns)
        return {c.name: rank_alpha(c, a.dim, a.alpha, anima.reg_dims) for c in candidates
                if selected(c.path, excludes, includes)}

    def _make_loras(self, candidates: Iterable[Candidate], ranks: Mapping[str, tuple[int, Any]]) -> list[LoRAModule]:
        a = self.args
        loras = []
        for candidate in candidates:
            rank, alpha = ranks.get(candidate.name, (0, None))
            if not rank:
                continue
            lora = LoRAModule(candidate.name, candidate.layer, self.multiplier, rank, alpha, dropout=a.neuron_dropout,
                              rank_dropout=a.rank_dropout, module_dropout=a.module_dropout)
            lora.original_name = candidate.path
            loras.append(lora)
        return loras

    def _log(self, candidates: list[Candidate], ranks: Mapping[str, tuple[int, Any]]) -> None:
        logger.info("Anima LoRA: %d text encoder modules (Qwen3), %d DiT modules%s", len(self.text_encoder_loras),
                    len(self.unet_loras), " (LLM adapter included)" if self.train_llm_adapter else "")
        if not self.anima_args.verbose:
            return
        for lora in self.text_encoder_loras + self.unet_loras:
            logger.info("\t%-60s rank %d, alpha %s", lora.lora_name, lora.lora_dim,
                        lora.scale * lora.lora_dim)
        skipped = [c.name for c in candidates if c.name in ranks and not ranks[c.name][0]]
        if skipped:
            logger.warning("rank 0: %d LoRA modules skipped: %s", len(skipped), ", ".join(skipped))

    def text_encoder_prefixes(self) -> list[str]:
        """``lora_te`` when this network has Qwen3 modules."""
        return [PREFIX_QWEN3] if self.text_encoder_loras else []

    def prepare_optimizer_params_with_multiple_te_lrs(
        self, text_encoder_lr: float | Sequence[float] | None, unet_lr: float | None, default_lr: float | None
    ) -> tuple[list[dict[str, Any]], list[str]]:
        """Param groups and names as upstream (``networks/anima_groups.py``)."""
        self.requires_grad_(True)
        a = self.args
        ratios = (a.loraplus_text_encoder_lr_ratio or a.loraplus_lr_ratio,
                  a.loraplus_unet_lr_ratio or a.loraplus_lr_ratio)
        return anima_groups(self.text_encoder_loras, self.unet_loras, (text_encoder_lr, unet_lr, default_lr), ratios,
                            self.anima_args.reg_lrs)

    def prepare_optimizer_params(
        self, text_encoder_lr: float | Sequence[float] | None, unet_lr: float | None, default_lr: float | None
    ) -> tuple[list[dict[str, Any]], list[str]]:
        """The same groups as ``prepare_optimizer_params_with_multiple_te_lrs`` (upstream's Anima network has only
        that one; the trainer prefers it)."""
        return self.prepare_optimizer_params_with_multiple_te_lrs(text_encoder_lr, unet_lr, default_lr)


def create_network(multiplier: float, network_dim: int | None, network_alpha: float | None, vae: Any,
                   text_encoders: Any, dit: nn.Module, neuron_dropout: float | None = None,
                   **kwargs: Any) -> AnimaLoRANetwork:
    """Upstream's entry point; ``kwargs`` are the network args (strings), checked by ``networks.anima_args``."""
    args, anima_args = parse_anima_network_args(network_dim, network_alpha, neuron_dropout, kwargs)
    return AnimaLoRANetwork(text_encoders, dit, multiplier=multiplier, args=args, anima_args=anima_args)


def create_network_from_weights(multiplier: float, file: str | os.PathLike[str] | None, vae: Any, text_encoders: Any,
                                dit: nn.Module, weights_sd: Mapping[str, torch.Tensor] | None = None,
                                for_inference: bool = False, **kwargs: Any) -> tuple[AnimaLoRANetwork, dict]:
    """A network shaped like a saved file (rank from each ``lora_down``, alpha from ``.alpha``, rank when absent);
    the adapter's layers are candidates when a name holds ``llm_adapter``, as upstream. Weights are not loaded
    here; ``kwargs`` may carry the LoRA+ ratios and ``network_reg_lrs`` (upstream drops them here);
    ``for_inference`` is accepted for compatibility (the modules are the same)."""
    weights_sd, dims, alphas = module_ranks(file, weights_sd)
    shaping = {k: v for k, v in kwargs.items() if k.startswith("loraplus_") or k == "network_reg_lrs"}
    args, anima_args = parse_anima_network_args(None, None, None, shaping)
    anima_args.train_llm_adapter = any("llm_adapter" in name for name in dims)
    network = AnimaLoRANetwork(text_encoders, dit, multiplier=multiplier, args=args, anima_args=anima_args,
                               modules_dim=dims, modules_alpha=alphas)
    return network, dict(weights_sd)
