"""The model stage: load the SD model offline, freeze and cast it by the precision policy, set attention and
gradient checkpointing, store the frozen weights in fp8 (``--fp8_base``), cache latents with the VAE, and compile
the UNet.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable

import torch

from library.config import DataConfig, ModelConfig, PrecisionConfig
from library.fp8 import fp8_bytes, store_fp8
from library.model_parts import SDModel, load_cached_tokenizer
from library.models import BUILTIN_MODELS, load_sd_model
from library.precision import PrecisionPolicy
from library.single_file import SUFFIXES

log = logging.getLogger(__name__)


def load_model(cfg: ModelConfig, precision: PrecisionConfig, policy: PrecisionPolicy,
               device: torch.device) -> SDModel:
    """Load, freeze and cast the SD model; set the tokenizer, attention backend and gradient checkpointing."""
    model = load_sd_model(cfg.pretrained_model_name_or_path, v2=cfg.v2, v_parameterization=cfg.v_parameterization,
                          vae=cfg.vae, file_device=str(device) if cfg.lowram else "cpu")
    if cfg.lowram:
        log.info(_lowram_note(cfg.pretrained_model_name_or_path, device))
    if cfg.tokenizer_cache_dir:
        model.tokenizer, how = load_cached_tokenizer(cfg.tokenizer_cache_dir, cfg.v2)
        log.info("--tokenizer_cache_dir: %s", how)
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
        for name in ("sdpa", "mem_eff_attn"):
            if getattr(precision, name):
                log.info("--%s: the UNet uses PyTorch's scaled-dot-product attention, which picks a "
                         "memory-efficient kernel by itself; nothing else to switch on", name)
    if precision.gradient_checkpointing:
        # diffusers and transformers only checkpoint modules in training mode (sd-scripts sets train() too).
        model.unet.enable_gradient_checkpointing(offloaded_checkpoint if precision.cpu_offload_checkpointing
                                                 else None)
        model.unet.train()
        model.text_encoder.gradient_checkpointing_enable()
        model.text_encoder.train()
        if precision.cpu_offload_checkpointing and device.type == "cpu":
            log.info("--cpu_offload_checkpointing: training on the CPU, so the checkpointed tensors already are in "
                     "CPU memory")
    return model


def _lowram_note(path: str, device: torch.device) -> str:
    if device.type == "cpu":
        return "--lowram: training on the CPU, so the model is loaded into CPU memory either way"
    if path not in BUILTIN_MODELS and path.lower().endswith(SUFFIXES):
        return f"--lowram: the checkpoint was read straight to {device}"
    return ("--lowram: diffusers folders and built-in models are built in CPU memory and then moved to "
            f"{device}, as in sd-scripts; only single-file checkpoints are read straight to the device")


def _pack_to_cpu(tensor: torch.Tensor) -> tuple[torch.device, torch.Tensor]:
    if tensor.device.type == "cpu":
        return tensor.device, tensor
    host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return tensor.device, host


def _unpack_from_cpu(packed: tuple[torch.device, torch.Tensor]) -> torch.Tensor:
    device, tensor = packed
    return tensor.to(device, non_blocking=True)


def offloaded_checkpoint(module: torch.nn.Module, *args):
    """``--cpu_offload_checkpointing``: diffusers' gradient-checkpointing call (non-reentrant
    ``torch.utils.checkpoint``) with the tensors it keeps for the backward pass (the inputs of each checkpointed
    block) held in pinned CPU memory and copied back when the block is recomputed; the copies are asynchronous.
    sd-scripts offers this for its DiT models; its SD1.x/2.x U-Net has no such mode."""
    with torch.autograd.graph.saved_tensors_hooks(_pack_to_cpu, _unpack_from_cpu):
        return torch.utils.checkpoint.checkpoint(module.__call__, *args, use_reentrant=False)


def store_frozen_fp8(model: SDModel, policy: PrecisionPolicy) -> None:
    """``--fp8_base`` / ``--fp8_base_unet`` (after ``--base_weights`` are merged, before the LoRA is attached)."""
    parts = [("UNet", model.unet)] if policy.unet_fp8 else []
    if policy.text_encoder_fp8:
        parts.append(("text encoder", model.text_encoder))
    for name, part in parts:
        layers = store_fp8(part, policy.frozen_dtype)
        stored, total = fp8_bytes(part)
        log.info("%s: %d layers store their weights in float8_e4m3fn (%.0f MiB in fp8, %.0f MiB of parameters "
                 "in all)", name, layers, stored / 2**20, total / 2**20)


def release_cached_memory(device: torch.device, highvram: bool) -> None:
    """After a latent-caching batch: empty the CUDA memory cache unless ``--highvram`` (sd-scripts'
    ``clean_memory_on_device`` unless ``HIGH_VRAM``); the CPU keeps no such cache."""
    if device.type == "cuda" and not highvram:
        torch.cuda.empty_cache()


def cache_latents(data, model: SDModel, policy: PrecisionPolicy, device: torch.device, cfg: DataConfig,
                  highvram: bool = False, share: Callable[[int], bool] | None = None,
                  wait: Callable[[], None] = lambda: None) -> None:
    """Encode every image once (``--cache_latents``), then move the VAE off the training device. As sd-scripts,
    the CUDA cache is emptied after each VAE batch unless ``--highvram``. ``share`` and ``wait`` split a disk cache
    between processes (``TrainData.cache_latents``)."""
    vae = model.vae

    @torch.no_grad()
    def encode(images: torch.Tensor) -> torch.Tensor:
        latents = vae.encode(images.to(device, policy.vae_dtype)).latent_dist.sample().float().cpu()
        release_cached_memory(device, highvram)
        return latents

    # Identify the VAE by its weights (the first tensors are enough to tell VAEs apart) and dtype, so that a cache
    # written with another VAE (--vae, another checkpoint, fp16 vs fp32) is rebuilt.
    digest = hashlib.sha1(str(vae.dtype).encode())
    for param in list(vae.parameters())[:4]:
        digest.update(param.detach().float().cpu().numpy().tobytes())
    vae_id = digest.hexdigest()[:16]
    data.cache_latents(encode, to_disk=cfg.cache_latents_to_disk, vae_id=vae_id, batch_size=cfg.vae_batch_size,
                       share=share, wait=wait)
    vae.to("cpu")


def compile_unet(model: SDModel, precision: PrecisionConfig) -> None:
    """``--torch_compile``: compile the UNet; a failure to compile raises at the first step, never runs eager."""
    if precision.torch_compile and precision.dynamo_backend == "no":
        log.info("--torch_compile with --dynamo_backend no: the UNet is not compiled (as in sd-scripts)")
    elif precision.torch_compile:
        model.unet = torch.compile(model.unet, backend=precision.dynamo_backend)
