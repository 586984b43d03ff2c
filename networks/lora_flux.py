"""LoRA for FLUX.1 (``--network_module networks.lora_flux``), file- and flag-compatible with upstream sd-scripts
48d368fa ``networks/lora_flux.py``.

Protocol as upstream: ``create_network(multiplier, network_dim, network_alpha, ae, text_encoders, flux,
neuron_dropout=None, **network_args)`` and ``create_network_from_weights(multiplier, file, ae, text_encoders, flux,
weights_sd=None, for_inference=False, **kwargs)``; ``text_encoders`` is [CLIP-L, T5-XXL] (either may be None).
The network is a ``networks.lora.LoRANetwork`` (apply_to, set_multiplier, merge_to, max-norm regularisation,
load/save with the sshs hashes are that class's) with FLUX's modules (``networks/flux_targets.py``) and upstream's
``prepare_optimizer_params_with_multiple_te_lrs`` (``networks/flux_groups.py``); the network args are
``networks/flux_args.py``. Modules are ``networks.lora_modules.LoRAModule`` (dropouts, rank dropout, module
dropout as ``networks.lora``); with ``ggpo_beta`` and ``ggpo_sigma``, ``networks.ggpo.GGPOLoRAModule``, whose norms
``norm_update`` (the trainer's hook between clipping and the optimizer step) keeps.

Keys: ``lora_unet_<BFL path>`` (``lora_unet_double_blocks_0_img_attn_qkv``, ``lora_unet_single_blocks_0_linear1``,
with ``in_dims`` also ``lora_unet_img_in`` ...), ``lora_te1_text_model_...`` (CLIP-L), ``lora_te3_encoder_block_...``
(T5-XXL, network arg ``train_t5xxl=True``); ``.lora_down.weight``, ``.lora_up.weight``, 0-d float32 ``.alpha``.

``split_qkv=True``: each part of a fused projection (q, k, v of a double block's ``*_attn.qkv``; q, k, v and the MLP
input of a single block's ``linear1``) has its own rank-r LoRA with scale alpha / r, as upstream. It is held as one
module of rank parts x r with a block-diagonal ``lora_up`` (``BlockDiagonalLinear``), which is also the layout the
file stores, as upstream's (down (parts x r, in), up (out, parts x r)). Two differences from upstream: (1) upstream
48d368fa raises ``ValueError: too many values to unpack`` when double blocks are trained with ``split_qkv``; here
they are split into q, k, v as its ``state_dict`` / ``load_state_dict`` already expect; (2) the file's alpha is
parts x alpha, so that alpha / rank-of-the-file is the trained scale alpha / r and every loader (diffusers, ComfyUI,
``create_network_from_weights``) applies the LoRA that was trained; upstream writes alpha unchanged, so its split
files apply at 1/parts of the trained strength outside its own split network.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from networks.args import LoRAArgs
from networks.flux_args import FluxLoRAArgs, parse_flux_network_args
from networks.flux_groups import part_groups, text_encoder_lrs
from networks.flux_targets import (
    FLUX_LORA_FAMILY,
    PREFIX_CLIP,
    PREFIX_FLUX,
    PREFIX_T5,
    BlockDiagonalLinear,
    Candidate,
    block_selection,
    flux_candidates,
    rank_of,
    split_dims,
    text_encoder_candidates,
)
from networks.ggpo import GGPO, GGPOLoRAModule
from networks.lora import LoRANetwork
from networks.lora_format import module_ranks
from networks.lora_modules import LoRAModule

__all__ = ["FluxLoRANetwork", "create_network", "create_network_from_weights"]

logger = logging.getLogger(__name__)


class FluxLoRANetwork(LoRANetwork):
    """The LoRA modules of a FLUX.1 transformer and its text encoders (upstream ``lora_flux.LoRANetwork``).

    With ``modules_dim`` (from a file) every candidate layer named there gets that rank and alpha and nothing else
    does; otherwise ranks follow ``flux_targets.rank_of``. Its ``family`` is ``flux_targets.FLUX_LORA_FAMILY``
    (``lora_te1`` / ``lora_te3``, no U-Net blocks), none of SD's.
    """

    LORA_PREFIX_FLUX = PREFIX_FLUX
    LORA_PREFIX_TEXT_ENCODER_CLIP = PREFIX_CLIP
    LORA_PREFIX_TEXT_ENCODER_T5 = PREFIX_T5

    def __init__(
        self,
        text_encoders: Sequence[nn.Module | None] | nn.Module | None,
        flux: nn.Module | None,
        multiplier: float = 1.0,
        args: LoRAArgs | None = None,
        flux_args: FluxLoRAArgs | None = None,
        modules_dim: Mapping[str, int] | None = None,
        modules_alpha: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(None, None, multiplier=multiplier, args=args, family=FLUX_LORA_FAMILY)
        self.flux_args = flux_args if flux_args is not None else FluxLoRAArgs()
        self.train_t5xxl = self.flux_args.train_t5xxl
        self.split_qkv = self.flux_args.split_qkv
        encoders = [text_encoders] if isinstance(text_encoders, nn.Module) else list(text_encoders or [])
        te_candidates = list(text_encoder_candidates(encoders, self.train_t5xxl))
        flux_found: list[Candidate] = []
        if flux is not None:
            in_dims = self.flux_args.in_dims if modules_dim is None else (0,) * 5
            train_blocks = self.flux_args.train_blocks if modules_dim is None else "all"
            flux_found = list(flux_candidates(flux, train_blocks, in_dims))
        if modules_dim is None:
            blocks = block_selection(flux, self.flux_args) if flux is not None else None
            ranks = {c.name: rank_of(c, self.args.dim, self.flux_args, blocks) for c in te_candidates + flux_found}
            alphas: Mapping[str, Any] = {}
        else:
            ranks, alphas = dict(modules_dim), modules_alpha or {}
        self.text_encoder_loras = self._make_loras(te_candidates, ranks, alphas)
        self.unet_loras = self._make_loras(flux_found, ranks, alphas)
        for lora in self.text_encoder_loras + self.unet_loras:
            self.add_module(lora.lora_name, lora)
        self._ggpo: GGPO | None = None
        self._log(te_candidates + flux_found, ranks)

    @property
    def norm_update(self) -> Any:
        """LoRA-GGPO's update of the norms (``networks.ggpo.GGPO.update``, called with the clipped gradients before
        each optimizer step, as upstream's ``update_grad_norms`` / ``update_norms``); None without GGPO. Taken at
        the first call, over the modules the network has then (``apply_to`` drops those of untrained parts)."""
        if self.flux_args.ggpo is None:
            return None
        if self._ggpo is None:
            beta, sigma = self.flux_args.ggpo
            modules = [m for m in self.text_encoder_loras + self.unet_loras if isinstance(m, GGPOLoRAModule)]
            self._ggpo = GGPO(beta, sigma, modules)
        return self._ggpo.update

    def _make_loras(self, candidates: Iterable[Candidate], ranks: Mapping[str, int],
                 alphas: Mapping[str, Any]) -> list[LoRAModule]:
        loras = []
        for candidate in candidates:
            rank = ranks.get(candidate.name, 0)
            if rank:
                loras.append(self._module(candidate, rank, alphas.get(candidate.name, self.args.alpha)))
        return loras

    def _module(self, candidate: Candidate, rank: int, alpha: Any) -> LoRAModule:
        """A LoRA module; with ``split_qkv`` on a fused projection, rank parts x r, alpha parts x alpha and a
        block-diagonal up (see the module docstring)."""
        a = self.args
        parts = split_dims(candidate) if self.split_qkv else None
        if parts is not None:
            alpha = (rank if alpha is None or alpha == 0 else alpha) * len(parts)
            rank = rank * len(parts)
        kind = GGPOLoRAModule if self.flux_args.ggpo is not None else LoRAModule
        lora = kind(candidate.name, candidate.layer, self.multiplier, rank, alpha, dropout=a.neuron_dropout,
                    rank_dropout=a.rank_dropout, module_dropout=a.module_dropout)
        if parts is not None:
            up = BlockDiagonalLinear(rank // len(parts), parts)
            lora.lora_up = up.to(lora.lora_down.weight.device)
        return lora

    def _log(self, candidates: list[Candidate], ranks: Mapping[str, int]) -> None:
        logger.info("FLUX LoRA: %d text encoder modules (CLIP-L%s), %d transformer modules (%s blocks)%s",
                    len(self.text_encoder_loras), " and T5-XXL" if self.train_t5xxl else "", len(self.unet_loras),
                    self.flux_args.train_blocks, ", split qkv" if self.split_qkv else "")
        if not self.flux_args.verbose:
            return
        for lora in self.unet_loras:
            logger.info("\t%-50s rank %d, alpha %s", lora.lora_name, lora.lora_dim, lora.alpha)
        skipped = [c.name for c in candidates if not ranks.get(c.name, 0)]
        if skipped:
            logger.warning("rank 0: %d LoRA modules skipped: %s", len(skipped), ", ".join(skipped))

    def text_encoder_prefixes(self) -> list[str]:
        """``lora_te1`` (CLIP-L) and/or ``lora_te3`` (T5-XXL), those this network has modules for."""
        return sorted({lora.lora_name[:len(PREFIX_CLIP)] for lora in self.text_encoder_loras})

    def prepare_optimizer_params_with_multiple_te_lrs(
        self, text_encoder_lr: float | Sequence[float] | None, unet_lr: float | None, default_lr: float | None
    ) -> tuple[list[dict[str, Any]], list[str]]:
        """Param groups and names as upstream (``networks/flux_groups.py``)."""
        self.requires_grad_(True)
        lrs = text_encoder_lrs(text_encoder_lr, default_lr)
        a, reg_lrs = self.args, self.flux_args.reg_lrs
        te_ratio = a.loraplus_text_encoder_lr_ratio or a.loraplus_lr_ratio
        groups: list[dict[str, Any]] = []
        names: list[str] = []
        for index, prefix in ((1, PREFIX_CLIP), (2, PREFIX_T5)):
            loras = [m for m in self.text_encoder_loras if m.lora_name.startswith(prefix + "_")]
            if loras:
                part, descriptions = part_groups(loras, lrs[index - 1], te_ratio, reg_lrs)
                groups += part
                names += [f"textencoder {index} " + (" " + d if d else "") for d in descriptions]
        if self.unet_loras:
            u_lr = unet_lr if unet_lr is not None else default_lr
            part, descriptions = part_groups(self.unet_loras, u_lr, a.loraplus_unet_lr_ratio or a.loraplus_lr_ratio,
                                             reg_lrs)
            groups += part
            names += ["unet" + (" " + d if d else "") for d in descriptions]
        return groups, names

    def prepare_optimizer_params(
        self, text_encoder_lr: float | Sequence[float] | None, unet_lr: float | None, default_lr: float | None
    ) -> tuple[list[dict[str, Any]], list[str]]:
        """The same groups as ``prepare_optimizer_params_with_multiple_te_lrs`` (upstream's FLUX network has only
        that one; the trainer prefers it)."""
        return self.prepare_optimizer_params_with_multiple_te_lrs(text_encoder_lr, unet_lr, default_lr)


def create_network(multiplier: float, network_dim: int | None, network_alpha: float | None, ae: Any,
                   text_encoders: Any, flux: nn.Module, neuron_dropout: float | None = None,
                   **kwargs: Any) -> FluxLoRANetwork:
    """Upstream's entry point; ``kwargs`` are the network args (strings), checked by ``networks.flux_args``."""
    args, flux_args = parse_flux_network_args(network_dim, network_alpha, neuron_dropout, kwargs)
    return FluxLoRANetwork(text_encoders, flux, multiplier=multiplier, args=args, flux_args=flux_args)


def create_network_from_weights(multiplier: float, file: str | os.PathLike[str] | None, ae: Any, text_encoders: Any,
                                flux: nn.Module, weights_sd: Mapping[str, torch.Tensor] | None = None,
                                for_inference: bool = False, **kwargs: Any) -> tuple[FluxLoRANetwork, dict]:
    """A network shaped like a saved file (rank from each ``lora_down``, alpha from ``.alpha``, rank when absent);
    T5 modules when the file has ``lora_te3_`` keys. Split modules of a ``split_qkv`` file load as plain modules of
    the file's rank, as upstream. Weights are not loaded here; ``kwargs`` may carry LoRA+ ratios,
    ``network_reg_lrs`` and the GGPO args (upstream drops those here; ``--dim_from_weights`` trains with GGPO as
    without); ``for_inference`` is accepted for compatibility."""
    weights_sd, dims, alphas = module_ranks(file, weights_sd)
    shaping = {k: v for k, v in kwargs.items()
               if k.startswith(("loraplus_", "ggpo_")) or k == "network_reg_lrs"}
    args, flux_args = parse_flux_network_args(None, None, None, shaping)
    flux_args.train_t5xxl = any(name.startswith(PREFIX_T5 + "_") for name in dims)
    network = FluxLoRANetwork(text_encoders, flux, multiplier=multiplier, args=args, flux_args=flux_args,
                              modules_dim=dims, modules_alpha=alphas)
    return network, dict(weights_sd)
