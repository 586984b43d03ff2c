"""``--network_module networks.lora_fa``: LoRA-FA (Zhang et al. 2023, "LoRA-FA: Memory-efficient Low-rank Adaptation
for Large Language Models Fine-tuning", arXiv:2308.03303), with the semantics of sd-scripts' ``networks/lora_fa.py``.

The network is ``networks.lora``'s (same targets, ``network_args``, keys and file format, so the file loads wherever
a LoRA does) with two differences, as sd-scripts:

* ``lora_down`` is drawn from N(0, 2 / (in + rank)) (``in`` = in_features, or in_channels for a conv) instead of
  Kaiming-uniform, and is frozen: it is saved but never trained;
* only ``lora_up`` goes to the optimizer, so the optimizer state is that of ``lora_up`` alone.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from networks import lora
from networks.args import parse_network_args
from networks.families import family_of


class LoRAFANetwork(lora.LoRANetwork):
    """``networks.lora.LoRANetwork`` whose ``lora_down`` weights are frozen at their random start."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for module in self.loras:
            down = module.lora_down
            fan_in = down.in_channels if isinstance(down, nn.Conv2d) else down.in_features
            nn.init.normal_(down.weight, std=math.sqrt(2.0 / (fan_in + module.lora_dim)))
        self.requires_grad_(True)

    def requires_grad_(self, requires_grad: bool = True) -> LoRAFANetwork:
        super().requires_grad_(requires_grad)
        for module in self.loras:
            module.lora_down.requires_grad_(False)
        return self

    def prepare_optimizer_params(
        self, text_encoder_lr: float | Sequence[float] | None, unet_lr: float | None, default_lr: float | None
    ) -> tuple[list[dict[str, Any]], list[str]]:
        """``networks.lora``'s groups without the frozen ``lora_down`` weights (a group left empty is dropped)."""
        groups, names = super().prepare_optimizer_params(text_encoder_lr, unet_lr, default_lr)
        kept_groups, kept_names = [], []
        for group, name in zip(groups, names, strict=True):
            params = [p for p in group["params"] if p.requires_grad]
            if params:
                kept_groups.append({**group, "params": params})
                kept_names.append(name)
        return kept_groups, kept_names

    def get_trainable_params(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]


def create_network(multiplier: float, network_dim: int | None, network_alpha: float | None, vae: Any,
                   text_encoder: Any, unet: Any, neuron_dropout: float | None = None,
                   **kwargs: Any) -> LoRAFANetwork:
    """sd-scripts' entry point; ``kwargs`` are the network_args, as for ``networks.lora``."""
    args = parse_network_args(network_dim, network_alpha, neuron_dropout, kwargs, layout=family_of(unet).blocks)
    return LoRAFANetwork(text_encoder, unet, multiplier=multiplier, args=args)


def create_network_from_weights(multiplier: float, file: str | os.PathLike[str] | None, vae: Any, text_encoder: Any,
                                unet: Any, weights_sd: Mapping[str, torch.Tensor] | None = None,
                                for_inference: bool = False, **kwargs: Any) -> tuple[LoRAFANetwork, dict]:
    """A LoRA-FA network shaped like a saved file (rank and alpha per module from the file, as ``networks.lora``)."""
    shaped, weights = lora.create_network_from_weights(multiplier, file, vae, text_encoder, unet, weights_sd,
                                                       for_inference, **kwargs)
    network = LoRAFANetwork(text_encoder, unet, multiplier=multiplier, args=shaped.args,
                            modules_dim={m.lora_name: m.lora_dim for m in shaped.loras},
                            modules_alpha={m.lora_name: m.alpha for m in shaped.loras})
    return network, weights
