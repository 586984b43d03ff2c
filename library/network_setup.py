"""The network stage: import ``--network_module`` (any module with sd-scripts' ``create_network`` protocol, e.g.
``networks.lora`` or ``lycoris.kohya``), attach it to the models, and hand its parameter groups to the optimizer.
"""

from __future__ import annotations

import importlib
import logging

import torch

from library.config import NetworkConfig, OptimizerConfig
from library.errors import UserError
from library.model_parts import SDModel
from library.precision import PrecisionPolicy
from networks import NETWORK_MODULE_ALIASES
from networks.args import network_metadata

log = logging.getLogger(__name__)

def build_network(cfg: NetworkConfig, model: SDModel, policy: PrecisionPolicy, device: torch.device):
    """Create the network with ``--network_module``'s ``create_network`` and attach it to the models."""
    try:
        module = importlib.import_module(NETWORK_MODULE_ALIASES.get(cfg.network_module, cfg.network_module))
    except ImportError as exc:
        raise UserError(f"--network_module {cfg.network_module}: cannot import it ({exc}); use networks.lora, "
                        "or install the package that provides it (lycoris.kohya: pip install lycoris-lora)") from exc
    kwargs = parse_network_args(cfg.network_args)
    train_unet = not cfg.network_train_text_encoder_only
    train_te = not cfg.network_train_unet_only
    if cfg.network_weights and cfg.dim_from_weights:
        network, _ = module.create_network_from_weights(1.0, cfg.network_weights, model.vae, model.text_encoder,
                                                        model.unet, **kwargs)
    else:
        network = module.create_network(1.0, cfg.network_dim, cfg.network_alpha, model.vae, model.text_encoder,
                                        model.unet, neuron_dropout=cfg.network_dropout, **kwargs)
    network.apply_to(model.text_encoder, model.unet, train_te, train_unet)
    if cfg.network_weights and not cfg.dim_from_weights:
        info = network.load_weights(cfg.network_weights)
        log.info("loaded network weights from %s: %s", cfg.network_weights, info)
    network.to(device, policy.network_dtype)
    network.prepare_grad_etc(model.text_encoder, model.unet)
    network.train()
    return network, train_te

def parse_network_args(items: list[str]) -> dict[str, str]:
    """``--network_args`` as sd-scripts parses it: split on the first "=", values stay strings."""
    kwargs = {}
    for item in items:
        if "=" not in item:
            raise UserError(f'--network_args "{item}": expected key=value, e.g. conv_dim=4')
        key, value = item.split("=", 1)
        kwargs[key.strip()] = value.strip()
    return kwargs

def param_groups(network, cfg: OptimizerConfig) -> tuple[list[dict], list[str]]:
    """The network's optimizer parameter groups and their names. As sd-scripts' ``train_network.py``: a network
    with ``prepare_optimizer_params_with_multiple_te_lrs`` gets every ``--text_encoder_lr`` value (one per text
    encoder), any other network the first one."""
    te_lrs = list(cfg.text_encoder_lr)
    if hasattr(network, "prepare_optimizer_params_with_multiple_te_lrs"):
        result = network.prepare_optimizer_params_with_multiple_te_lrs(te_lrs, cfg.unet_lr, cfg.learning_rate)
    else:
        result = network.prepare_optimizer_params(te_lrs[0] if te_lrs else None, cfg.unet_lr, cfg.learning_rate)
    if isinstance(result, tuple):
        return result
    return result, [f"group{i}" for i in range(len(result))]

def network_meta(cfg: NetworkConfig) -> dict[str, str]:
    return network_metadata(cfg.network_module, cfg.network_dim, cfg.network_alpha if cfg.network_alpha is not None
                            else 1, cfg.network_dropout, parse_network_args(cfg.network_args))
