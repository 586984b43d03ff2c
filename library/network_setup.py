"""The network stage: import ``--network_module`` (any module with sd-scripts' ``create_network`` protocol, e.g.
``networks.lora`` or ``lycoris.kohya``), merge ``--base_weights`` into the frozen models, attach the network to the
models, and hand its parameter groups to the optimizer.
"""

from __future__ import annotations

import importlib
import logging

import torch

from library.config import ModelConfig, NetworkConfig, OptimizerConfig
from library.errors import UserError
from library.model_parts import SDModel
from library.precision import PrecisionPolicy
from networks import NETWORK_MODULE_ALIASES
from networks.args import network_metadata

log = logging.getLogger(__name__)

def import_network_module(name: str):
    """The module named by ``--network_module`` (``lycoris.kohya`` through our adapter)."""
    try:
        return importlib.import_module(NETWORK_MODULE_ALIASES.get(name, name))
    except ImportError as exc:
        raise UserError(f"--network_module {name}: cannot import it ({exc}); use networks.lora, "
                        "or install the package that provides it (lycoris.kohya: pip install lycoris-lora)") from exc


def merge_base_weights(cfg: ModelConfig, network_module: str, model: SDModel, policy: PrecisionPolicy) -> None:
    """``--base_weights``: merge each file into the frozen UNet / text encoder, as sd-scripts' ``train_network.py``:
    ``--network_module``'s ``create_network_from_weights(multiplier, file, ..., for_inference=True)`` then its
    ``merge_to(text_encoder, unet, weights, dtype, device)``; the i-th file takes the i-th
    ``--base_weights_multiplier``, 1.0 where there is none. Runs before the weights are stored in fp8.

    A file that cannot be read, has no module of this network type, or names or shapes layers this model does
    not have is a ``UserError`` naming the file; sd-scripts would skip such modules without a word.
    """
    if not cfg.base_weights:
        return
    module = import_network_module(network_module)
    for i, file in enumerate(cfg.base_weights):
        multiplier = cfg.base_weights_multiplier[i] if i < len(cfg.base_weights_multiplier) else 1.0
        log.info("merging %s into the model with multiplier %s", file, multiplier)
        weights = _read_base_weights(file)
        network, weights = module.create_network_from_weights(multiplier, file, model.vae, model.text_encoder,
                                                              model.unet, weights_sd=weights, for_inference=True)
        _check_fits(file, network, weights, network_module)
        try:
            network.merge_to(model.text_encoder, model.unet, weights, policy.frozen_dtype, None)
        except (RuntimeError, ValueError) as exc:
            raise UserError(f"--base_weights {file}: does not fit this model ({exc}); give a LoRA trained on "
                            "this model type (SD 1.x or 2.x, matching --v2)") from exc
    log.info("all base weights merged: %s", ", ".join(cfg.base_weights))


def _read_base_weights(file: str) -> dict[str, torch.Tensor]:
    from networks.lora import load_weights_file

    try:
        return load_weights_file(file)
    except UserError as exc:  # its messages start with the file's path
        raise UserError(*(f"--base_weights {message}" for message in exc.messages)) from None


def _check_fits(file: str, network: torch.nn.Module, weights: dict[str, torch.Tensor], network_module: str) -> None:
    """Every module the file names must be a module of the network built on this model."""
    if not hasattr(network, "merge_to"):
        raise UserError(f"--base_weights {file}: the network module cannot merge weights (no merge_to); use "
                        "--network_module networks.lora")
    in_file = {key.split(".", 1)[0] for key in weights}
    # networks.lora registers its modules; LyCORIS keeps them in the unet_loras / text_encoder_loras lists only
    modules = [*network.modules(), *getattr(network, "unet_loras", []), *getattr(network, "text_encoder_loras", [])]
    in_model = {m.lora_name for m in modules if isinstance(getattr(m, "lora_name", None), str)}
    if not in_file & in_model:
        raise UserError(f"--base_weights {file}: none of its {len(in_file)} modules is a layer of this model "
                        f"(e.g. {min(in_file, default='no tensors')}); give a LoRA file (lora_unet_* / lora_te_* "
                        "keys) trained on this model type (SD 1.x or 2.x, matching --v2)")
    unknown = sorted(in_file - in_model)
    if unknown:
        raise UserError(f"--base_weights {file}: {len(unknown)} of its modules match no layer that "
                        f"--network_module {network_module} targets in this model (e.g. {unknown[0]}); give a LoRA "
                        "trained on this model type (SD 1.x or 2.x, matching --v2) with that network module")


def build_network(cfg: NetworkConfig, model: SDModel, policy: PrecisionPolicy, device: torch.device):
    """Create the network with ``--network_module``'s ``create_network`` and attach it to the models."""
    module = import_network_module(cfg.network_module)
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
