"""The ``ss_*`` training metadata and the SAI ModelSpec entries written into every LoRA file.

Key names and value formats follow sd-scripts' ``train_network.py`` and ``library/sai_model_spec.py``
(SD_SCRIPTS_BEHAVIOR.md §10): every value is a string, booleans as "True"/"False", missing values as
"None". Keys of our own (``ss_full_bf16``, ``ss_stochastic_rounding``) are additive.
"""

from __future__ import annotations

import datetime
import time
import uuid
from typing import Any

from library.config import TrainConfig
from library.schedule import StepPlan

# sd-scripts keeps only these under --no_metadata.
MINIMAL_KEYS = ("ss_v2", "ss_base_model_version", "ss_network_module", "ss_network_dim", "ss_network_alpha",
                "ss_network_args")
PROJECT_VERSION = "sd-scripts-bf16/0.1"


def _s(value: Any) -> str:
    return str(value)


def base_model_version(v2: bool, v_parameterization: bool) -> str:
    """``ss_base_model_version``: sd_v1, sd_v2, or sd_v2_v (sd-scripts' get_sai_model_spec naming)."""
    return ("sd_v2" if v2 else "sd_v1") + ("_v" if v_parameterization else "")


def modelspec(cfg: TrainConfig, resolution: tuple[int, int], started: float) -> dict[str, str]:
    """SAI ModelSpec 1.0.1 entries for a LoRA (sd-scripts' ``sai_model_spec.build_metadata``)."""
    m, s = cfg.model, cfg.save
    if not m.v2:
        arch = "stable-diffusion-v1/lora"
    else:
        arch = "stable-diffusion-v2-768-v/lora" if m.v_parameterization else "stable-diffusion-v2-512/lora"
    title = s.metadata_title or s.output_name or f"LoRA@{datetime.datetime.fromtimestamp(started).isoformat()}"
    spec = {
        "modelspec.sai_model_spec": "1.0.1",
        "modelspec.architecture": arch,
        "modelspec.implementation": "diffusers",
        "modelspec.title": title,
        "modelspec.resolution": f"{resolution[0]}x{resolution[1]}",
        "modelspec.date": datetime.datetime.fromtimestamp(started).strftime("%Y-%m-%dT%H:%M:%S"),
        "modelspec.prediction_type": "v" if m.v_parameterization else "epsilon",
        "modelspec.implementation_version": PROJECT_VERSION,
    }
    if m.clip_skip is not None:
        spec["modelspec.encoder_layer"] = _s(m.clip_skip)
    for key in ("author", "description", "license", "tags"):
        value = getattr(s, f"metadata_{key}")
        if value:
            spec[f"modelspec.{key}"] = value
    return spec


def training_metadata(cfg: TrainConfig, plan: StepPlan, *, dataset_meta: dict[str, str],
                      network_meta: dict[str, str], optimizer_name: str, stochastic_rounding: bool,
                      num_train_images: int, num_reg_images: int, resolution: tuple[int, int],
                      started: float) -> dict[str, str]:
    """Everything sd-scripts writes at the start of training (``ss_steps``/``ss_epoch`` come at save time)."""
    m, d, n, o, sc, p, nz, lo = (cfg.model, cfg.data, cfg.network, cfg.optimizer, cfg.schedule, cfg.precision,
                                 cfg.noise, cfg.loss)
    meta = {
        "ss_session_id": _s(uuid.uuid4().int % 2**31),
        "ss_training_started_at": _s(started),
        "ss_output_name": _s(cfg.save.output_name),
        "ss_learning_rate": _s(o.learning_rate),
        "ss_text_encoder_lr": _s(o.text_encoder_lr or None),
        "ss_unet_lr": _s(o.unet_lr),
        "ss_num_train_images": _s(num_train_images),
        "ss_num_validation_images": "0",
        "ss_num_reg_images": _s(num_reg_images),
        "ss_num_batches_per_epoch": _s(plan.batches_per_epoch),
        "ss_num_epochs": _s(plan.num_epochs),
        "ss_gradient_checkpointing": _s(p.gradient_checkpointing),
        "ss_gradient_accumulation_steps": _s(sc.gradient_accumulation_steps),
        "ss_max_train_steps": _s(plan.max_train_steps),
        "ss_lr_warmup_steps": _s(sc.lr_warmup_steps),
        "ss_lr_scheduler": _s(sc.lr_scheduler),
        "ss_mixed_precision": _s(p.mixed_precision),
        "ss_full_fp16": _s(p.full_fp16),
        "ss_full_bf16": _s(p.full_bf16),
        "ss_stochastic_rounding": _s(stochastic_rounding),
        "ss_v2": _s(m.v2),
        "ss_base_model_version": base_model_version(m.v2, m.v_parameterization),
        "ss_clip_skip": _s(m.clip_skip),
        "ss_max_token_length": _s(m.max_token_length),
        "ss_cache_latents": _s(d.cache_latents or d.cache_latents_to_disk),
        "ss_seed": _s(cfg.run.seed),
        "ss_lowram": _s(m.lowram),
        "ss_noise_offset": _s(nz.noise_offset),
        "ss_multires_noise_iterations": _s(nz.multires_noise_iterations),
        "ss_multires_noise_discount": _s(nz.multires_noise_discount),
        "ss_adaptive_noise_scale": _s(nz.adaptive_noise_scale),
        "ss_zero_terminal_snr": _s(nz.zero_terminal_snr),
        "ss_training_comment": _s(cfg.save.training_comment),
        "ss_sd_scripts_commit_hash": PROJECT_VERSION,
        "ss_optimizer": optimizer_name,
        "ss_max_grad_norm": _s(o.max_grad_norm),
        "ss_caption_dropout_rate": _s(d.caption_dropout_rate),
        "ss_caption_dropout_every_n_epochs": _s(d.caption_dropout_every_n_epochs),
        "ss_caption_tag_dropout_rate": _s(d.caption_tag_dropout_rate),
        "ss_face_crop_aug_range": _s(d.face_crop_aug_range),
        "ss_prior_loss_weight": _s(d.prior_loss_weight),
        "ss_min_snr_gamma": _s(lo.min_snr_gamma),
        "ss_scale_weight_norms": _s(n.scale_weight_norms),
        "ss_ip_noise_gamma": _s(nz.ip_noise_gamma),
        "ss_debiased_estimation": _s(lo.debiased_estimation_loss),
        "ss_noise_offset_random_strength": _s(nz.noise_offset_random_strength),
        "ss_ip_noise_gamma_random_strength": _s(nz.ip_noise_gamma_random_strength),
        "ss_loss_type": _s(lo.loss_type),
        "ss_huber_schedule": _s(lo.huber_schedule),
        "ss_huber_scale": _s(lo.huber_scale),
        "ss_huber_c": _s(lo.huber_c),
        "ss_fp8_base": "False",
        "ss_fp8_base_unet": "False",
        "ss_validation_seed": "None",
        "ss_validation_split": "0.0",
        "ss_max_validation_steps": "None",
        "ss_validate_every_n_epochs": "None",
        "ss_validate_every_n_steps": "None",
        "ss_resize_interpolation": _s(d.resize_interpolation),
        **dataset_meta,
        **network_meta,
    }
    if cfg.save.no_metadata:
        meta = {k: v for k, v in meta.items() if k in MINIMAL_KEYS}
    return {**meta, **modelspec(cfg, resolution, started)}


def at_save(meta: dict[str, str], *, steps: int, epoch: int, no_metadata: bool) -> dict[str, str]:
    """The metadata of one save: the training metadata plus when, at which step and epoch."""
    if no_metadata:
        return dict(meta)
    return {**meta, "ss_training_finished_at": _s(time.time()), "ss_steps": _s(steps), "ss_epoch": _s(epoch)}


def optimizer_description(optimizer: Any, options: dict[str, Any]) -> str:
    """``ss_optimizer``: "<module>.<Class>(k=v,...)" as sd-scripts writes it."""
    cls = type(optimizer)
    args = ",".join(f"{k}={v}" for k, v in options.items())
    return f"{cls.__module__}.{cls.__name__}" + (f"({args})" if args else "")
