"""LoRA / LoCon network for SD1.x/2.x and SDXL, file- and flag-compatible with sd-scripts' ``networks/lora.py``.

The trainer imports the module named by ``--network_module`` and uses this protocol (as sd-scripts does):
``create_network(multiplier, network_dim, network_alpha, vae, text_encoder, unet, neuron_dropout=None, **kwargs)``
and ``create_network_from_weights(multiplier, file, vae, text_encoder, unet, weights_sd=None, for_inference=False,
**kwargs)``, then on the network ``apply_to``, ``load_weights``, ``prepare_optimizer_params``, ``prepare_grad_etc``,
``on_epoch_start``, ``get_trainable_params``, ``apply_max_norm_regularization``, ``set_multiplier``,
``save_weights``; ``is_mergeable`` / ``merge_to`` for ``--base_weights``.

Targets: Linear / Conv2d inside ``Transformer2DModel`` (U-Net) and CLIP attention / MLP (text encoder); with
``conv_dim`` or ``conv_block_dims`` also inside ``ResnetBlock2D`` / ``Downsample2D`` / ``Upsample2D``, where 3x3
convs get conv_dim/conv_alpha and Linear / 1x1 convs the linear dim/alpha. Keys: ``lora_unet_<path>`` and
``lora_te_text_model_<path>`` (``text_model`` kept for transformers 5, whose CLIPTextModel lost that submodule), each
with ``.lora_down.weight``, ``.lora_up.weight`` and a 0-dim ``.alpha``; files load in diffusers, ComfyUI and A1111.
SDXL (told by the U-Net, ``networks/families.py``): original-layout U-Net names, ``lora_te1_`` / ``lora_te2_`` for
the two text encoders, 23 blocks for block dims / LR weights. Text encoder learning rates as upstream's
``networks.lora``: one "textencoder" group for both encoders (this network has no
``prepare_optimizer_params_with_multiple_te_lrs``, so sd-scripts' trainer hands it one value); the trainer's
extension, one group per encoder, is asked for by passing ``prepare_optimizer_params`` two or more values.

Reading and writing the files (atomic, with sd-scripts' ``sshs_model_hash`` / ``sshs_legacy_hash``) is
``networks/lora_format.py``; the modules and the search for the layers they wrap are ``networks/lora_modules.py``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from library.base.errors import UserError
from networks.args import LoRAArgs, network_metadata, parse_network_args
from networks.families import LoRAFamily, family_of, unet_module_names
from networks.lora_format import cast_for_saving, load_weights_file, module_ranks, save_weights_file
from networks.lora_modules import (
    TEXT_ENCODER_TARGETS,
    UNET_CONV_TARGETS,
    UNET_TARGETS,
    LoRAModule,
    iter_targets,
    lora_product,
    set_multipliers,
    text_model_prefix,
)

__all__ = ["LoRANetwork", "create_network", "create_network_from_weights", "network_metadata"]

logger = logging.getLogger(__name__)

LORA_PREFIX_UNET = "lora_unet"
LORA_PREFIX_TEXT_ENCODER = "lora_te"


class LoRANetwork(nn.Module):
    """All LoRA modules of one U-Net + text encoder; modules are registered under their flat ``lora_name``.

    Per-module rank/alpha come from ``modules_dim``/``modules_alpha`` (loaded from a file) when given, else from
    the block dims, else from ``args.dim``/``args.conv_dim``; a rank of 0 creates no module. ``family`` (names,
    prefixes, blocks) is told by the U-Net unless given (a subclass for another model passes its own).
    """

    def __init__(
        self,
        text_encoder: nn.Module | Sequence[nn.Module] | None,
        unet: nn.Module | None,
        multiplier: float = 1.0,
        args: LoRAArgs | None = None,
        modules_dim: Mapping[str, int] | None = None,
        modules_alpha: Mapping[str, Any] | None = None,
        family: LoRAFamily | None = None,
    ) -> None:
        super().__init__()
        self.args = args if args is not None else LoRAArgs()
        self.multiplier = multiplier
        self.block_lr_weight = self.args.block_lr_weight
        self._modules_dim = modules_dim
        self._modules_alpha = modules_alpha or {}
        self.family = family if family is not None else family_of(unet)
        encoders = _text_encoders(text_encoder, len(self.family.text_encoder_prefixes))
        prefixes = self.family.text_encoder_prefixes if len(encoders) > 1 else (LORA_PREFIX_TEXT_ENCODER,)
        self.text_encoder_loras: list[LoRAModule] = []
        for te, prefix in zip(encoders, prefixes, strict=False):
            targets = iter_targets(te, prefix, TEXT_ENCODER_TARGETS, text_model_prefix(te))
            self.text_encoder_loras += self._create(targets, is_unet=False)
        unet_classes = UNET_TARGETS
        if modules_dim is not None or self.args.conv_dim is not None or self.args.conv_block_dims is not None:
            unet_classes = UNET_TARGETS + UNET_CONV_TARGETS
        self.unet_loras = []
        if unet is not None:
            rename = unet_module_names(unet, self.family)
            self.unet_loras = self._create(iter_targets(unet, LORA_PREFIX_UNET, unet_classes, rename=rename), True)
        for lora in self.text_encoder_loras + self.unet_loras:
            self.add_module(lora.lora_name, lora)
        if text_encoder is not None or unet is not None:  # a subclass given neither targets its own modules
            logger.info("LoRA: %d text encoder modules, %d U-Net modules", len(self.text_encoder_loras),
                        len(self.unet_loras))

    def _dim_alpha(self, name: str, layer: nn.Module, is_unet: bool) -> tuple[int, Any]:
        is_3x3 = isinstance(layer, nn.Conv2d) and layer.kernel_size != (1, 1)
        a = self.args
        if self._modules_dim is not None:
            return self._modules_dim.get(name, 0), self._modules_alpha.get(name)
        if is_unet and a.block_dims is not None:
            idx = self.family.block_index(name)
            if idx < 0:
                return 0, None
            if not is_3x3:
                return a.block_dims[idx], a.block_alphas[idx] if a.block_alphas else a.alpha
            if a.conv_block_dims is None or a.conv_block_alphas is None:
                return 0, None
            return a.conv_block_dims[idx], a.conv_block_alphas[idx]
        if not is_3x3:
            return a.dim, a.alpha
        return a.conv_dim or 0, a.conv_alpha

    def _create(self, targets: Iterable[tuple[str, nn.Module]], is_unet: bool) -> list[LoRAModule]:
        loras = []
        for name, layer in targets:
            dim, alpha = self._dim_alpha(name, layer, is_unet)
            if dim:
                loras.append(
                    LoRAModule(name, layer, self.multiplier, dim, alpha, dropout=self.args.neuron_dropout,
                               rank_dropout=self.args.rank_dropout, module_dropout=self.args.module_dropout)
                )
        return loras

    @property
    def loras(self) -> list[LoRAModule]:
        return self.text_encoder_loras + self.unet_loras

    # --- protocol used by the trainer -------------------------------------------------------------------------
    def apply_to(self, text_encoder: Any, unet: Any, apply_text_encoder: bool = True, apply_unet: bool = True) -> None:
        """Patch the original layers' forward; the side not applied loses its modules (not trained, not saved)."""
        if not apply_text_encoder:
            self._drop(self.text_encoder_loras)
            self.text_encoder_loras = []
        if not apply_unet:
            self._drop(self.unet_loras)
            self.unet_loras = []
        for lora in self.loras:
            lora.apply_to()

    def _drop(self, loras: list[LoRAModule]) -> None:
        for lora in loras:
            delattr(self, lora.lora_name)

    def set_multiplier(self, multiplier: float) -> None:
        """Every module's multiplier (a dataset's ``network_multiplier``, per batch): floats for eager code and the
        metadata, device buffers for a compiled U-Net, refilled together only when the value changes."""
        self.multiplier = multiplier
        set_multipliers(self.loras, multiplier)

    def is_mergeable(self) -> bool:
        return True

    def merge_to(self, text_encoder: Any, unet: Any, weights_sd: Mapping[str, torch.Tensor], dtype: torch.dtype | None,
                 device: torch.device | str | None) -> None:
        """Add ``multiplier * alpha/rank * up @ down`` from ``weights_sd`` into the original weights (no patching).

        A 1x1-conv product merges into a Linear and back (same numbers); any other shape mismatch is a ValueError.
        """
        for lora in self.loras:
            down = weights_sd.get(f"{lora.lora_name}.lora_down.weight")
            up = weights_sd.get(f"{lora.lora_name}.lora_up.weight")
            if down is None or up is None:
                continue
            alpha = weights_sd.get(f"{lora.lora_name}.alpha")
            rank = down.shape[0]
            scale = (float(alpha) if alpha is not None and float(alpha) != 0 else rank) / rank
            weight = lora.org_module.weight
            target = device if device is not None else weight.device
            delta = lora_product(up.to(target, torch.float32), down.to(target, torch.float32))
            if delta.numel() != weight.numel():
                raise ValueError(f"{lora.lora_name}: the file's up @ down is {tuple(delta.shape)}, the layer's "
                                 f"weight {tuple(weight.shape)}")
            delta = delta.reshape(weight.shape)
            merged = weight.to(target, torch.float32) + lora.multiplier * scale * delta
            with torch.no_grad():
                weight.copy_(merged.to(dtype or weight.dtype))
        logger.info("LoRA weights merged")

    def text_encoder_prefixes(self) -> list[str]:
        """The key prefixes of the text encoders this network has modules for, in order: ``lora_te`` (SD 1.x/2.x),
        ``lora_te1`` and ``lora_te2`` (SDXL); none when the text encoders are not trained."""
        return sorted({lora.lora_name.split("_text_model_")[0] for lora in self.text_encoder_loras})

    def prepare_optimizer_params(
        self, text_encoder_lr: float | Sequence[float] | None, unet_lr: float | None, default_lr: float | None
    ) -> tuple[list[dict[str, Any]], list[str]]:
        """Param groups and their names, as upstream's ``networks.lora`` ``LoRANetwork.prepare_optimizer_params``
        (sd-scripts 48d368fa).

        One "textencoder" group holding the modules of every text encoder (SDXL: both, in the order te1, te2) at
        ``text_encoder_lr`` (else ``default_lr``), a "unet" group at ``unet_lr`` (else ``default_lr``), or one
        ``unet_block<i>`` group per block when block LR weights are set. LoRA+ moves every ``lora_up`` into a
        "... plus" group at lr x ratio. A group whose LR is 0 or None is dropped (it will not train).

        This trainer's extension: a sequence of two or more values, on a network with modules of two text encoders
        (SDXL), gives one group per encoder, "textencoder 1" at the first value and "textencoder 2" at the second;
        any other sequence counts as its first value (none: ``default_lr``).
        """
        self.requires_grad_(True)
        lrs = [text_encoder_lr] if not isinstance(text_encoder_lr, Sequence) else list(text_encoder_lr) or [None]
        lrs = [default_lr if lr is None else lr for lr in lrs]
        prefixes = self.text_encoder_prefixes()
        a = self.args
        groups: list[dict[str, Any]] = []
        names: list[str] = []
        te_ratio = a.loraplus_text_encoder_lr_ratio or a.loraplus_lr_ratio
        unet_ratio = a.loraplus_unet_lr_ratio or a.loraplus_lr_ratio
        if len(lrs) > 1 and len(prefixes) > 1:
            for i, prefix in enumerate(prefixes):
                loras = [m for m in self.text_encoder_loras if m.lora_name.startswith(prefix + "_text_model_")]
                _add_groups(groups, names, f"textencoder {i + 1}", loras, lrs[min(i, len(lrs) - 1)], te_ratio)
        else:
            _add_groups(groups, names, "textencoder", self.text_encoder_loras, lrs[0], te_ratio)
        u_lr = unet_lr if unet_lr is not None else default_lr
        if self.block_lr_weight is None:
            _add_groups(groups, names, "unet", self.unet_loras, u_lr, unet_ratio)
        else:
            by_block: dict[int, list[LoRAModule]] = {}
            for lora in self.unet_loras:
                by_block.setdefault(self.family.block_index(lora.lora_name), []).append(lora)
            for idx, loras in by_block.items():
                weight = self.block_lr_weight[idx] if idx >= 0 else 1.0
                lr = None if u_lr is None else u_lr * weight
                _add_groups(groups, names, f"unet_block{idx}", loras, lr, unet_ratio)
        return groups, names

    def enable_gradient_checkpointing(self) -> None:
        """No-op: LoRA modules are not checkpointed themselves (sd-scripts does the same)."""

    def prepare_grad_etc(self, text_encoder: Any, unet: Any) -> None:
        self.requires_grad_(True)

    def on_epoch_start(self, text_encoder: Any, unet: Any) -> None:
        self.train()

    def get_trainable_params(self) -> Iterable[nn.Parameter]:
        return self.parameters()

    def apply_max_norm_regularization(
        self, max_norm_value: float, device: torch.device | str, apply: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """As sd-scripts: W = up·down·alpha/rank; norm = max(|W|, max/2); if min(norm, max)/norm != 1, up and down
        are each scaled by its square root. Returns (keys scaled, mean norm after, max norm after) as 0-d tensors on
        ``device``: nothing is read on the host (every pair is multiplied, by exactly 1 where no scaling is needed;
        sd-scripts reads each ratio to decide and returns numbers).

        sd-scripts loops over the modules (~10 kernels each); here the modules are grouped by shapes, dtype and
        device (``_max_norm_groups``, built once) and each group takes a fixed number of stacked ops, so the count
        does not grow with the modules. |W| is sqrt(<upᵀup, down·downᵀ>) in fp32 (the same Frobenius norm, from
        rank x rank matrices instead of an out x in product); the scaled weights are rounded once into their dtype.
        ``apply`` (a 0-d bool device tensor, or None): where false no module is scaled, without a host read (an
        update whose step the optimizer skipped on the device, ``library/train/update/deferred.py``).
        """
        groups, inv_rank = self._max_norm_groups(device)
        if not groups:
            zero = torch.zeros((), device=device)
            return zero, zero, zero
        with torch.no_grad():
            stacks = [tuple(torch.stack(part).to(torch.float32) for part in group) for group in groups]
            squares = torch.cat([_norm_squares(up, down).to(device) for up, down, _ in stacks])
            before = squares.clamp(min=0).sqrt() * torch.cat([alpha.to(device) for _, _, alpha in stacks]) * inv_rank
            norm = before.clamp(min=max_norm_value / 2)
            ratio = norm.clamp(max=max_norm_value) / norm
            if apply is not None:  # an update skipped on the device scales nothing
                ratio = torch.where(apply.to(ratio.device), ratio, 1.0)
            factors = ratio.sqrt().split([len(group[0]) for group in groups])
            for (ups, downs, _), (up, down, _), factor in zip(groups, stacks, factors, strict=True):
                _scale_into(ups, up, factor)
                _scale_into(downs, down, factor)
            after = before * ratio
        return (ratio != 1).sum(), after.mean(), after.max()

    def _max_norm_groups(self, device: torch.device | str) -> tuple[list[_NormGroup], torch.Tensor]:
        """The modules' (ups, downs, alphas) grouped by (up shape, down shape, dtype, device), and 1/rank of each
        module in group order on ``device``; cached, and built again when a module, weight, dtype or device changes
        (a per-update walk over the modules on the host, no device op)."""
        loras = self.loras
        key = (str(device), *((id(m.lora_up.weight), id(m.lora_down.weight), id(m.alpha), m.lora_up.weight.dtype,
                               m.lora_down.weight.dtype, m.lora_up.weight.device, m.alpha.device) for m in loras))
        cached = getattr(self, "_max_norm_cache", None)
        if cached is not None and cached[0] == key:
            return cached[1], cached[2]
        by_kind: dict[tuple[Any, ...], _NormGroup] = {}
        for m in loras:
            up, down = m.lora_up.weight, m.lora_down.weight
            kind = (tuple(up.shape), tuple(down.shape), up.dtype, down.dtype, up.device, m.alpha.device)
            group = by_kind.setdefault(kind, ([], [], []))
            for part, tensor in zip(group, (up, down, m.alpha), strict=True):
                part.append(tensor)
        groups = list(by_kind.values())
        inv_rank = torch.tensor([1.0 / downs[0].shape[0] for _, downs, _ in groups for _ in downs], device=device)
        self._max_norm_cache = (key, groups, inv_rank)
        return groups, inv_rank

    def load_weights(self, file: str | os.PathLike[str]) -> Any:
        """Non-strict load (``--network_weights``); returns torch's missing/unexpected keys info."""
        return self.load_state_dict(load_weights_file(file), strict=False)

    def save_weights(self, file: str | os.PathLike[str], dtype: torch.dtype | None,
                     metadata: Mapping[str, str] | None) -> None:
        """Save the LoRA tensors (``cast_for_saving``); see the module docstring for format and hashes."""
        save_weights_file(cast_for_saving(self.state_dict(), dtype), file, metadata)


_NormGroup = tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]  # ups, downs, alphas of one shape


def _norm_squares(up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """|up_i·down_i|² for stacked fp32 ups [N, out, r, ...] and downs [N, r, in, ...] (a k x k conv's down flattens
    to [r, in·k·k], as ``lora_product`` sums over the rank only): the sum of (upᵀup) ⊙ (down·downᵀ)."""
    up, down = up.flatten(2), down.flatten(2)
    return (torch.bmm(up.mT, up) * torch.bmm(down, down.mT)).sum((1, 2))


def _scale_into(weights: list[torch.Tensor], stacked: torch.Tensor, factor: torch.Tensor) -> None:
    """weights[i] = stacked[i] · factor[i], computed in fp32 and rounded once into the weights' dtype."""
    factor = factor.to(stacked.device).view(-1, *([1] * (stacked.dim() - 1)))
    torch._foreach_copy_(weights, (stacked * factor).to(weights[0].dtype).unbind(0))


def _add_groups(groups: list[dict[str, Any]], names: list[str], label: str, loras: Iterable[LoRAModule],
                lr: float | None, plus_ratio: float | None) -> None:
    plain: list[nn.Parameter] = []
    plus: list[nn.Parameter] = []
    for lora in loras:
        for pname, param in lora.named_parameters():
            (plus if plus_ratio is not None and "lora_up" in pname else plain).append(param)
    for params, suffix, group_lr in ((plain, "", lr), (plus, " plus", None if lr is None else lr * (plus_ratio or 1))):
        if not params:
            continue
        if not group_lr:
            logger.info("no learning rate for %s%s: those parameters are not trained", label, suffix)
            continue
        groups.append({"params": params, "lr": group_lr})
        names.append(label + suffix)


def _text_encoders(text_encoder: nn.Module | Sequence[nn.Module] | None, most: int) -> list[nn.Module]:
    if text_encoder is None:
        return []
    if isinstance(text_encoder, nn.Module):
        return [text_encoder]
    encoders = list(text_encoder)
    if len(encoders) > most:
        raise UserError(f"networks.lora: {len(encoders)} text encoders given for a U-Net that takes {most} "
                        "(SD1.x/2.x: one, SDXL: two)")
    return encoders


def create_network(multiplier: float, network_dim: int | None, network_alpha: float | None, vae: Any,
                   text_encoder: Any, unet: Any, neuron_dropout: float | None = None, **kwargs: Any) -> LoRANetwork:
    """sd-scripts' entry point; ``kwargs`` are the network_args (strings), validated by ``networks.args``."""
    args = parse_network_args(network_dim, network_alpha, neuron_dropout, kwargs, layout=family_of(unet).blocks)
    return LoRANetwork(text_encoder, unet, multiplier=multiplier, args=args)


def create_network_from_weights(multiplier: float, file: str | os.PathLike[str] | None, vae: Any, text_encoder: Any,
                                unet: Any, weights_sd: Mapping[str, torch.Tensor] | None = None,
                                for_inference: bool = False, **kwargs: Any) -> tuple[LoRANetwork, dict]:
    """A network shaped like a saved file: rank from each ``lora_down`` and alpha from ``.alpha`` (rank when
    absent, as old files), conv modules wherever the file has them. Weights are not loaded here (they may be merged
    instead); ``kwargs`` may carry block LR weights and LoRA+ ratios. ``for_inference`` is accepted for
    compatibility; the modules are the same."""
    weights_sd, dims, alphas = module_ranks(file, weights_sd)
    args = parse_network_args(None, None, None, kwargs, layout=family_of(unet).blocks)
    network = LoRANetwork(text_encoder, unet, multiplier=multiplier, args=args, modules_dim=dims, modules_alpha=alphas)
    return network, dict(weights_sd)
