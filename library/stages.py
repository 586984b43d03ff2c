"""The stages ``run()`` wires together, each built from its own config section.

Models are frozen and cast by the precision policy; the network module is imported by name (any module
with sd-scripts' ``create_network`` protocol, e.g. ``networks.lora`` or ``lycoris.kohya``); the optimizer
comes from the ``optimizers`` registry.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import optimizers
from library.config import (
    DataConfig,
    ModelConfig,
    NetworkConfig,
    OptimizerConfig,
    PrecisionConfig,
    SaveConfig,
    ScheduleConfig,
)
from library.errors import UserError
from library.models import SDModel, load_sd_model
from library.precision import PrecisionPolicy
from library.schedule import StepPlan, build_lr_scheduler, resolve_steps
from library.train import Position
from networks import NETWORK_MODULE_ALIASES
from networks.args import network_metadata

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OptimizerChoice:
    """The optimizer a run uses: its registry entry (None for a dotted ``module.Class``) and checked options."""

    name: str
    spec: optimizers.OptimizerSpec | None
    options: dict[str, Any]

    @property
    def adafactor_schedule(self) -> bool:
        return optimizers.needs_adafactor_scheduler(self.name, self.options)


def check_optimizer(cfg: OptimizerConfig, schedule: ScheduleConfig) -> OptimizerChoice:
    """Resolve the optimizer name and options before anything loads; every mistake is a ``UserError``."""
    try:
        options = optimizers.parse_optimizer_args(cfg.optimizer_args)
        spec = optimizers.find_spec(cfg.optimizer_type)
        optimizers.validate_options(cfg.optimizer_type, options)
    except optimizers.OptimizerConfigError as exc:
        raise UserError(f"--optimizer_type {cfg.optimizer_type or 'AdamW'}: {exc}") from exc
    choice = OptimizerChoice(cfg.optimizer_type or "AdamW", spec, options)
    if choice.adafactor_schedule and schedule.lr_scheduler not in ("constant", "adafactor"):
        log.warning("Adafactor with relative_step=True sets its own step size: --lr_scheduler %s is replaced by "
                    "the adafactor schedule (as sd-scripts does); pass relative_step=False scale_parameter=False "
                    "to use a normal schedule", schedule.lr_scheduler)
    if cfg.fused_backward_pass and (spec is None or not spec.fused_backward):
        raise UserError(f"--fused_backward_pass needs an optimizer that can step one parameter at a time; "
                        f"{choice.name} cannot. Use one of: {', '.join(_fused_backward_names())}")
    return choice


def _fused_backward_names() -> list[str]:
    return [spec.name for spec in optimizers.REGISTRY.values() if spec.fused_backward]


def load_model(cfg: ModelConfig, precision: PrecisionConfig, policy: PrecisionPolicy,
               device: torch.device) -> SDModel:
    """Load, freeze and cast the SD model; set the attention backend and gradient checkpointing."""
    model = load_sd_model(cfg.pretrained_model_name_or_path, v2=cfg.v2,
                          v_parameterization=cfg.v_parameterization, vae=cfg.vae)
    for part in (model.unet, model.text_encoder, model.vae):
        part.requires_grad_(False)
        part.eval()
    model.unet.to(device, policy.frozen_dtype)
    model.text_encoder.to(device, policy.frozen_dtype)
    model.vae.to(device, policy.vae_dtype)
    if precision.xformers:
        model.unet.enable_xformers_memory_efficient_attention()
    else:
        from diffusers.models.attention_processor import AttnProcessor2_0

        model.unet.set_attn_processor(AttnProcessor2_0())
    if precision.gradient_checkpointing:
        # diffusers and transformers only checkpoint modules in training mode (sd-scripts sets train() too).
        model.unet.enable_gradient_checkpointing()
        model.unet.train()
        model.text_encoder.gradient_checkpointing_enable()
        model.text_encoder.train()
    return model


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


def cache_latents(data, model: SDModel, policy: PrecisionPolicy, device: torch.device, cfg: DataConfig) -> None:
    """Encode every image once (``--cache_latents``), then move the VAE off the training device."""
    vae = model.vae

    @torch.no_grad()
    def encode(images: torch.Tensor) -> torch.Tensor:
        return vae.encode(images.to(device, policy.vae_dtype)).latent_dist.sample().float().cpu()

    # Identify the VAE by its weights (the first tensors are enough to tell VAEs apart) and dtype, so that a cache
    # written with another VAE (--vae, another checkpoint, fp16 vs fp32) is rebuilt.
    digest = hashlib.sha1(str(vae.dtype).encode())
    for param in list(vae.parameters())[:4]:
        digest.update(param.detach().float().cpu().numpy().tobytes())
    vae_id = digest.hexdigest()[:16]
    data.cache_latents(encode, to_disk=cfg.cache_latents_to_disk, vae_id=vae_id, batch_size=cfg.vae_batch_size)
    vae.to("cpu")


def build_optimizer(choice: OptimizerChoice, groups: list[dict], lr: float):
    try:
        return optimizers.build_optimizer(choice.name, groups, lr, **choice.options)
    except optimizers.OptimizerConfigError as exc:
        raise UserError(f"--optimizer_type {choice.name}: {exc}") from exc


def build_scheduler(optimizer, cfg: ScheduleConfig, choice: OptimizerChoice, plan: StepPlan, base_lr: float):
    if choice.adafactor_schedule:
        return optimizers.build_adafactor_schedule(optimizer, base_lr)
    return build_lr_scheduler(optimizer, cfg, plan.max_train_steps, base_lr)


def optimizer_warnings(choice: OptimizerChoice, groups: list[dict], schedule: ScheduleConfig, full_bf16: bool,
                       plan: StepPlan) -> list[str]:
    warmup = resolve_steps(schedule.lr_warmup_steps, plan.max_train_steps)
    return optimizers.startup_warnings(choice.name, choice.options, [g["lr"] for g in groups], warmup, full_bf16)


def rounds_stochastically(choice: OptimizerChoice, policy: PrecisionPolicy) -> bool:
    """Whether bf16 weight updates of this run are stochastically rounded."""
    if policy.network_dtype != torch.bfloat16 or choice.spec is None:
        return False
    options, spec = choice.options, choice.spec
    if spec.stochastic_rounding == "native":
        return bool(options.get("use_stochastic_rounding", options.get("stochastic_rounding", True)))
    return bool(options.get("stochastic_rounding", spec.sr_default))


def optimizer_state_label(choice: OptimizerChoice, policy: PrecisionPolicy) -> str:
    """The optimizer state's dtype as it will be allocated, for the start-of-run precision line."""
    from library.precision import dtype_name

    spec = choice.spec
    if spec is None:
        return "as the optimizer allocates it"
    if spec.eight_bit_state:
        return "8-bit (tensors under 4096 elements fp32)"
    if spec.stochastic_rounding != "native" and rounds_stochastically(choice, policy):
        return "fp32 (stochastic-rounding wrapper)"
    return dtype_name(policy.network_dtype)


def save_dtype(cfg: SaveConfig) -> torch.dtype | None:
    return {None: None, "float": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[cfg.save_precision]


def compile_unet(model: SDModel, precision: PrecisionConfig) -> None:
    """``--torch_compile``: compile the UNet; a failure to compile raises at the first step, never runs eager."""
    if precision.torch_compile and precision.dynamo_backend == "no":
        log.info("--torch_compile with --dynamo_backend no: the UNet is not compiled (as in sd-scripts)")
    elif precision.torch_compile:
        model.unet = torch.compile(model.unet, backend=precision.dynamo_backend)


def lr_reporter(optimizer, descriptions: list[str], choice: OptimizerChoice) -> Callable[[], dict[str, float]]:
    """The per-group learning rates to log, as sd-scripts tags them: ``lr/<group>`` is the scheduled LR; for
    learning-rate-free optimizers (D-Adaptation, Prodigy) also ``lr/d*lr/<group>``, the step size they apply."""
    from library.tracking import lr_tags

    tags = lr_tags(descriptions)
    lr_free = choice.spec is not None and choice.spec.lr_free

    def values() -> dict[str, float]:
        effective = optimizers.effective_lrs(optimizer)
        if not lr_free:
            return dict(zip(tags, effective, strict=True))
        scheduled = [group["lr"] for group in optimizer.param_groups]
        out = dict(zip(tags, scheduled, strict=True))
        out.update({tag.replace("lr/", "lr/d*lr/", 1): value for tag, value in zip(tags, effective, strict=True)})
        return out

    return values


def restore(resume: tuple[dict, dict], network, optimizer, scheduler, noise_generator: torch.Generator,
            plan: StepPlan) -> Position:
    """Load a ``--save_state`` folder; mismatches are explained instead of surfacing as tensor errors."""
    state, train_state = resume
    try:
        network.load_state_dict(state["network"], strict=False)
        optimizer.load_state_dict(state["optimizer"])
    except (RuntimeError, ValueError, KeyError) as exc:
        raise UserError(f"--resume: the saved state does not fit this run ({exc}); resume with the same network "
                        "and optimizer settings as the run that saved it") from exc
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"])
    noise_generator.set_state(state["noise_rng"])
    step = int(train_state["current_step"])
    if step >= plan.max_train_steps:
        raise UserError(f"--resume: the saved state is at step {step}, which already reaches --max_train_steps "
                        f"{plan.max_train_steps}; raise the step or epoch count to train further")
    return Position(epoch=step // plan.updates_per_epoch, step=step)
