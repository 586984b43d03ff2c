"""The network stage: import ``--network_module`` (any module with sd-scripts' ``create_network`` protocol, e.g.
``networks.lora`` or ``lycoris.kohya``), merge ``--base_weights`` into the frozen models, attach the network to the
models, and hand its parameter groups to the optimizer.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

import torch

from library.base.errors import UserError
from library.config import ModelConfig, NetworkConfig, OptimizerConfig
from library.families.base import ModelFamily
from library.families.precision import PrecisionPolicy
from library.train.finite import refuse_non_finite
from networks import NETWORK_MODULE_ALIASES
from networks.args import network_metadata
from networks.lora import LoRANetwork
from networks.lora_format import load_weights_file, weights_shapes

log = logging.getLogger(__name__)


def import_network_module(name: str):
    """The module named by ``--network_module`` (``lycoris.kohya`` through our adapter)."""
    try:
        return importlib.import_module(NETWORK_MODULE_ALIASES.get(name, name))
    except ImportError as exc:
        raise UserError(f"--network_module {name}: cannot import it ({exc}); use networks.lora, "
                        "or install the package that provides it (lycoris.kohya: pip install lycoris-lora)") from exc


def merge_base_weights(cfg: ModelConfig, network_module: str, model: Any, policy: PrecisionPolicy,
                       family: ModelFamily) -> None:
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
        text_encoder = family.network_text_encoder(model)
        network, weights = module.create_network_from_weights(multiplier, file, model.vae, text_encoder,
                                                              model.unet, weights_sd=weights, for_inference=True)
        _check_fits(file, network, weights, network_module)
        try:
            network.merge_to(text_encoder, model.unet, weights, policy.frozen_dtype, None)
        except (RuntimeError, ValueError) as exc:
            raise UserError(f"--base_weights {file}: does not fit this model ({exc}); give a LoRA trained on "
                            "this model's family and version (with --v2 for SD 2.x)") from exc
    log.info("all base weights merged: %s", ", ".join(cfg.base_weights))


def _read_base_weights(file: str) -> dict[str, torch.Tensor]:
    weights = load_weights_file(file, "--base_weights")
    refuse_non_finite(weights, f"--base_weights {file}", "merge another file, or train without it")
    return weights


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
                        "keys) trained on this model's family and version (with --v2 for SD 2.x)")
    unknown = sorted(in_file - in_model)
    if unknown:
        raise UserError(f"--base_weights {file}: {len(unknown)} of its modules match no layer that "
                        f"--network_module {network_module} targets in this model (e.g. {unknown[0]}); give a LoRA "
                        "trained on this model's family and version (with --v2 for SD 2.x) with that network module")


def check_network_weights(cfg: NetworkConfig) -> None:
    """Refuse a ``--network_weights`` file holding NaN or Inf before any model loads (``UserError``, exit 2); a
    missing or unreadable file is named by the reader, as in ``network_weights_shapes``."""
    if cfg.network_weights:
        weights = load_weights_file(cfg.network_weights, "--network_weights")
        refuse_non_finite(weights, f"--network_weights {cfg.network_weights}",
                          "give the last good file of that run, or train without --network_weights")


def build_network(cfg: NetworkConfig, model: Any, policy: PrecisionPolicy, device: torch.device,
                  family: ModelFamily):
    """Create the network with ``--network_module``'s ``create_network`` and attach it to the models (several
    text encoders, as a list, as sd-scripts passes them)."""
    module = import_network_module(cfg.network_module)
    kwargs = parse_network_args(cfg.network_args)
    train_unet = not cfg.network_train_text_encoder_only
    train_te = not cfg.network_train_unet_only
    text_encoder = family.network_text_encoder(model)
    if cfg.network_weights and cfg.dim_from_weights:
        network, _ = module.create_network_from_weights(1.0, cfg.network_weights, model.vae, text_encoder,
                                                        model.unet, **kwargs)
    else:
        if cfg.network_module == "networks.lora":  # LyCORIS reads the dim otherwise (LoKr: 10000 = full matrix)
            check_rank(cfg.network_dim, model, family)
        # sd-scripts' --network_alpha defaults to 1 and is always passed (lycoris.kohya needs a number)
        alpha = cfg.network_alpha if cfg.network_alpha is not None else 1.0
        network = module.create_network(1.0, cfg.network_dim, alpha, model.vae, text_encoder, model.unet,
                                        neuron_dropout=cfg.network_dropout, **kwargs)
    network.apply_to(text_encoder, model.unet, train_te, train_unet)
    if cfg.network_weights:
        check_weights_fit(cfg, network_weights_shapes(cfg.network_weights), network, train_te, train_unet)
    if cfg.network_weights and not cfg.dim_from_weights:
        load_keeping_alphas(network, cfg.network_weights)
    network.to(device, policy.network_dtype)
    network.prepare_grad_etc(text_encoder, model.unet)
    check_trains_a_module(cfg, network)
    network.train()
    return network, train_te


def load_keeping_alphas(network: torch.nn.Module, path: str) -> None:
    """``--network_weights`` into a network built with this run's ``--network_alpha`` / ``conv_alpha``.

    sd-scripts (``networks/lora.py`` ``load_weights``) loads the file's ``alpha`` buffers too, while every module
    keeps the scale it computed from ``--network_alpha``: its run trains at one alpha and saves another, and loaders
    apply a scale the run never trained with. Here the run's alphas stay, so that its files record what it trained;
    a file saved at other alphas is named, with the factor by which its LoRA now acts more or less at the start."""
    alphas = {name: buffer.clone() for name, buffer in network.named_buffers() if name.rsplit(".", 1)[-1] == "alpha"}
    info = network.load_weights(path)
    log.info("loaded network weights from %s: %s", path, info)
    changed = []
    for name, buffer in network.named_buffers():
        if name in alphas and not torch.equal(buffer, alphas[name]):
            changed.append((float(buffer), float(alphas[name])))  # once, at the start: not a per-step sync
            buffer.copy_(alphas[name])
    if changed:
        saved, now = changed[0]
        log.warning("--network_weights %s: %d modules were saved at another alpha than this run's (e.g. %g, now "
                    "%g): they train and are saved at this run's alpha, so the loaded LoRA acts %.3gx as strongly "
                    "as the file did; pass the file's --network_alpha (and conv_alpha), or --dim_from_weights, to "
                    "continue at its scale", path, len(changed), saved, now, now / saved if saved else float("inf"))


def check_trains_a_module(cfg: NetworkConfig, network: torch.nn.Module) -> None:
    """A network whose arguments select no layer (every block left out, every rank 0, no pattern matching, the
    only part that had modules not trained) has no parameter to train. sd-scripts builds it, loads and caches, and
    stops at the first backward pass (``element 0 of tensors does not require grad``); here it is a ``UserError``
    naming the arguments when the network is attached, whatever ``--network_module`` built it."""
    if any(param.requires_grad for param in network.parameters()):
        return
    given = [f"--network_module {cfg.network_module}"]
    if cfg.network_args:
        given.append("--network_args " + " ".join(cfg.network_args))
    given += [flag for flag, on in (("--network_train_unet_only", cfg.network_train_unet_only),
                                    ("--network_train_text_encoder_only", cfg.network_train_text_encoder_only),
                                    ("--dim_from_weights", cfg.dim_from_weights)) if on]
    raise UserError(f"{' '.join(given)}: no module is trained (these arguments select no layer of the model, so the "
                    "network has no parameter to train); select at least one layer (a block, a rank above 0, a "
                    "pattern that matches), or leave out the flag that drops the part which has modules")


def check_rank(network_dim: int | None, model: Any, family: ModelFamily) -> None:
    """``networks.lora``: a rank above every layer's min(in, out) adds parameters (and memory, without bound) but no
    expressiveness; sd-scripts allocates it anyway and runs out of memory for a mistyped rank."""
    if network_dim is None:
        return
    widths = [min(m.in_features, m.out_features) if isinstance(m, torch.nn.Linear)
              else min(m.in_channels, m.out_channels)
              for part in (model.unet, *family.text_encoders(model)) for m in part.modules()
              if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))]
    if widths and network_dim > max(widths):
        raise UserError(f"--network_dim {network_dim} is above the width of every layer of this model (at most "
                        f"{max(widths)}): a LoRA's rank cannot usefully exceed min(in, out) of its layer; SD LoRAs "
                        "use 4 to 128")


def network_weights_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """``--network_weights``: every tensor's name and shape, read before any model loads (the header only, for
    .safetensors) by ``networks.lora_format``'s reader; a file that is missing, unreadable, empty or not a dict of
    tensors is a UserError naming it and what is wrong."""
    return weights_shapes(path, "--network_weights")


def _examples(keys) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:3]) + (f" ... ({len(keys)} in all)" if len(keys) > 3 else "")


def check_weights_fit(cfg: NetworkConfig, shapes: dict[str, tuple[int, ...]], network, train_te: bool,
                      train_unet: bool) -> None:
    """``--network_weights`` must fit the network it is loaded into. sd-scripts loads non-strictly, so a LoRA of
    another model family trains from scratch with zero keys loaded, and another rank fails with a size-mismatch
    traceback; here both are errors naming the mismatch, as are tensors the network has no module for (they would
    be dropped from the result). Modules the file lacks start from their initial values (an info line)."""
    own = {k: tuple(v.shape) for k, v in network.state_dict().items()}
    path = cfg.network_weights
    matched = own.keys() & shapes.keys()
    if not matched:
        raise UserError(f"--network_weights {path}: none of its {len(shapes)} tensors belongs to this network (the "
                        f"file has {_examples(shapes)}; this network has {_examples(own) or 'no modules'}): it is a "
                        f"LoRA for another model family or network module than {cfg.network_module}, or no "
                        "LoRA at all")
    wrong = sorted(k for k in matched if own[k] != shapes[k])
    if wrong:
        first = wrong[0]
        rank = (f"; the file has rank {shapes[first][0]}, this network {own[first][0]}: give --network_dim "
                f"{shapes[first][0]} or --dim_from_weights" if first.endswith("lora_down.weight") else "")
        raise UserError(f"--network_weights {path}: {len(wrong)} tensors have another shape than this network's "
                        f"({first}: {list(shapes[first])} in the file, {list(own[first])} here){rank}")
    extra = shapes.keys() - own.keys()
    frozen = {k for k in extra if (k.startswith("lora_te") and not train_te)
              or (k.startswith("lora_unet") and not train_unet)}
    if frozen:
        log.warning("--network_weights %s: %d tensors of the part not trained in this run (%s) are not loaded and "
                    "not in the saved LoRA", path, len(frozen), _examples(frozen))
    if extra - frozen:
        raise UserError(f"--network_weights {path}: {len(extra - frozen)} tensors have no module in this network "
                        f"({_examples(extra - frozen)}), so they would be dropped: the file was trained with other "
                        "--network_args (conv_dim for conv layers?); give those, or --dim_from_weights to shape the "
                        "network like the file")
    missing = own.keys() - shapes.keys()
    if missing:
        log.info("--network_weights %s: %d tensors of this network are not in the file and start fresh (%s)", path,
                 len(missing), _examples(missing))


def parse_network_args(items: list[str]) -> dict[str, str]:
    """``--network_args`` as sd-scripts parses it: split on the first "=", values stay strings."""
    kwargs = {}
    for item in items:
        if "=" not in item:
            raise UserError(f'--network_args "{item}": expected key=value, e.g. conv_dim=4')
        key, value = item.split("=", 1)
        kwargs[key.strip()] = value.strip()
    return kwargs


MULTIPLE_TE_LRS = "prepare_optimizer_params_with_multiple_te_lrs"


def text_encoder_lr(network, cfg: OptimizerConfig) -> float | list[float] | None:
    """The ``text_encoder_lr`` that sd-scripts' ``train_network.py`` (48d368fa, "make backward compatibility for
    text_encoder_lr") hands the network and writes as ``ss_text_encoder_lr``: a network with
    ``prepare_optimizer_params_with_multiple_te_lrs`` gets the ``--text_encoder_lr`` list, any other network
    (upstream's ``networks.lora``, LyCORIS) its first value, None when the flag is not given.

    This trainer's extension (``per_encoder_lrs``): ``networks.lora`` (and ``networks.lora_fa``) with modules of two
    text encoders and two different values gets both, one per encoder.
    """
    lrs = list(cfg.text_encoder_lr)
    if hasattr(network, MULTIPLE_TE_LRS):
        return lrs or None
    per_encoder = per_encoder_lrs(network, lrs)
    if per_encoder is not None:
        return per_encoder
    return lrs[0] if lrs else None


def per_encoder_lrs(network, lrs: list[float]) -> list[float] | None:
    """One learning rate per text encoder where this trainer gives it (upstream would use the first value only):
    a ``networks.lora`` network with modules of several text encoders (SDXL) and values that differ among the first
    of them; None otherwise (equal values train as upstream's single group, with the same numbers)."""
    if not isinstance(network, LoRANetwork):
        return None
    used = lrs[: len(network.text_encoder_prefixes())]
    return used if len(set(used)) > 1 else None


def text_encoder_lr_warnings(network, cfg: OptimizerConfig) -> list[str]:
    """Where ``--text_encoder_lr`` values would train otherwise in sd-scripts, or are not used."""
    lrs = list(cfg.text_encoder_lr)
    if hasattr(network, MULTIPLE_TE_LRS) or len(set(lrs)) < 2 or not getattr(network, "text_encoder_loras", None):
        return []
    given = " ".join(str(lr) for lr in lrs)
    used = per_encoder_lrs(network, lrs)
    if used is None:
        encoders = len(network.text_encoder_prefixes()) if isinstance(network, LoRANetwork) else 0
        if encoders > 1:  # equal values for the encoders and more after them
            return [f"--text_encoder_lr {given}: both text encoders train at {lrs[0]}; the values after the "
                    f"first {encoders} are not used"]
        which = "this model has one text encoder" if encoders else "this network takes one text encoder learning rate"
        return [f"--text_encoder_lr {given}: {which}: the first value, {lrs[0]}, is used and the others are not "
                "(as sd-scripts)"]
    unused = f"; {' '.join(str(lr) for lr in lrs[len(used):])} not used" if len(lrs) > len(used) else ""
    return [f"--text_encoder_lr {given}: text encoder 1 trains at {used[0]}, text encoder 2 at {used[1]} (groups "
            f"'textencoder 1' and 'textencoder 2'){unused}. This is an extension of this trainer: sd-scripts with "
            f"networks.lora would train both text encoders at the first value, {lrs[0]} (one group, lr/textencoder)"]


def param_groups(network, cfg: OptimizerConfig) -> tuple[list[dict], list[str]]:
    """The network's optimizer parameter groups and their names, as sd-scripts' ``train_network.py``: a network with
    ``prepare_optimizer_params_with_multiple_te_lrs`` gets every ``--text_encoder_lr`` value through it, any other
    network ``prepare_optimizer_params`` with ``text_encoder_lr`` (the first value, or this trainer's per-encoder
    values); the warnings of ``text_encoder_lr_warnings`` are logged."""
    for line in text_encoder_lr_warnings(network, cfg):
        log.warning(line)
    te_lr = text_encoder_lr(network, cfg)
    if hasattr(network, MULTIPLE_TE_LRS):
        result = network.prepare_optimizer_params_with_multiple_te_lrs(te_lr, cfg.unet_lr, cfg.learning_rate)
    else:
        result = network.prepare_optimizer_params(te_lr, cfg.unet_lr, cfg.learning_rate)
    if isinstance(result, tuple):
        return result
    return result, [f"group{i}" for i in range(len(result))]


def network_meta(cfg: NetworkConfig) -> dict[str, str]:
    return network_metadata(cfg.network_module, cfg.network_dim, cfg.network_alpha if cfg.network_alpha is not None
                            else 1, cfg.network_dropout, parse_network_args(cfg.network_args))
