"""The model stage: load the SD model offline, freeze and cast it by the precision policy, set attention and
gradient checkpointing, cache latents with the VAE, and compile the UNet.
"""

from __future__ import annotations

import hashlib
import logging

import torch

from library.config import DataConfig, ModelConfig, PrecisionConfig
from library.model_parts import SDModel
from library.models import load_sd_model
from library.precision import PrecisionPolicy

log = logging.getLogger(__name__)

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

def compile_unet(model: SDModel, precision: PrecisionConfig) -> None:
    """``--torch_compile``: compile the UNet; a failure to compile raises at the first step, never runs eager."""
    if precision.torch_compile and precision.dynamo_backend == "no":
        log.info("--torch_compile with --dynamo_backend no: the UNet is not compiled (as in sd-scripts)")
    elif precision.torch_compile:
        model.unet = torch.compile(model.unet, backend=precision.dynamo_backend)
