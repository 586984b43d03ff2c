"""The model stage: load the model of the run's family offline, freeze and cast it by the precision policy, set
attention and gradient checkpointing, store the frozen weights in fp8 (``--fp8_base``), cache latents with the VAE
(and, for SDXL, the text encoders' outputs), and compile the UNet.

What is cached is checked on the host as it is made (the encoders' outputs are on the CPU then anyway): NaN or Inf
from the VAE or the text encoders stops the run (``UserError``) before any cache file holds it, as sd-scripts'
``cache_batch_latents`` refuses NaN latents. Disk cache files are checked when they are validated
(``library/data/latent_cache``, ``text_cache``; the text encoders' output shapes are measured here for that).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
from collections.abc import Callable
from typing import Any

import torch

from library.base.errors import UserError
from library.config import DataConfig, ModelConfig, PrecisionConfig
from library.data.text_cache import ArrayNames
from library.families.base import ModelFamily
from library.families.fp8 import fp8_bytes
from library.families.precision import PrecisionPolicy
from library.families.sd.family import SDFamily
from library.families.sd.loading import BUILTIN_MODELS
from library.families.sd.parts import SDModel, load_cached_tokenizer
from library.families.sd.single_file import SUFFIXES

log = logging.getLogger(__name__)


def load_model(cfg: ModelConfig, precision: PrecisionConfig, policy: PrecisionPolicy, device: torch.device,
               family: ModelFamily = SDFamily(), section: Any = None) -> SDModel:
    """Load, freeze and cast the model of ``family`` (``section``: its own flag section, ``TrainConfig.
    family_section``); set the tokenizer, attention backend and gradient checkpointing."""
    if family.name == "sdxl" and cfg.clip_skip is not None:
        log.warning("--clip_skip %s has no effect on SDXL: both text encoders give their penultimate layer "
                    "(sd-scripts warns the same)", cfg.clip_skip)
    model = family.load(cfg, section, policy.frozen_dtype, file_device=str(device) if cfg.lowram else "cpu")
    if cfg.lowram:
        log.info(_lowram_note(cfg.pretrained_model_name_or_path, device))
    if cfg.tokenizer_cache_dir and family.name != "sd":
        log.info("--tokenizer_cache_dir: %s uses the bundled tokenizers (the same vocabularies as upstream's); the "
                 "folder is not read", family.name.upper())
    elif cfg.tokenizer_cache_dir:
        model.tokenizer, how = load_cached_tokenizer(cfg.tokenizer_cache_dir, cfg.v2)
        log.info("--tokenizer_cache_dir: %s", how)
    text_encoders = family.text_encoders(model)
    for part in (model.unet, *text_encoders, model.vae):
        part.requires_grad_(False)
        part.eval()
    model.unet.to(family.denoiser_device(section, device), policy.frozen_dtype)
    for text_encoder in text_encoders:
        text_encoder.to(device, policy.frozen_dtype)
    model.vae.to(device, policy.vae_dtype)
    if family.diffusers_denoiser:
        set_attention(model, precision, device)
    if precision.gradient_checkpointing:
        # diffusers and transformers only checkpoint modules in training mode (sd-scripts sets train() too).
        if family.diffusers_denoiser:
            model.unet.enable_gradient_checkpointing(offloaded_checkpoint if precision.cpu_offload_checkpointing
                                                     else None)
        else:
            model.unet.enable_gradient_checkpointing(cpu_offload=precision.cpu_offload_checkpointing)
        model.unet.train()
        for text_encoder in text_encoders:
            text_encoder.gradient_checkpointing_enable()
            text_encoder.train()
        if precision.cpu_offload_checkpointing and device.type == "cpu":
            log.info("--cpu_offload_checkpointing: training on the CPU, so the checkpointed tensors already are in "
                     "CPU memory")
    return model


def set_attention(model: SDModel, precision: PrecisionConfig, device: torch.device) -> None:
    """xformers with ``--xformers`` where it can run (the package installed, a CUDA device); otherwise PyTorch's
    scaled-dot-product attention, the same attention, with memory-efficient kernels on CUDA (on the CPU for long key
    sequences only: ``library/families/cpu_attention.py``): ``--xformers``
    without the package (the kohya_ss GUI's default attention) or off CUDA says so in one info line."""
    xformers_runs = importlib.util.find_spec("xformers") is not None and device.type == "cuda"
    if precision.xformers and xformers_runs:
        model.unet.enable_xformers_memory_efficient_attention()
        return
    from diffusers.models.attention_processor import AttnProcessor2_0

    from library.families.cpu_attention import CPUAttention

    model.unet.set_attn_processor(CPUAttention() if device.type == "cpu" else AttnProcessor2_0())
    if precision.xformers:
        why = "needs a CUDA device" if importlib.util.find_spec("xformers") else "package is not installed"
        log.info("--xformers: the xformers %s; the UNet uses PyTorch's scaled-dot-product attention instead (the "
                 "same attention, with memory-efficient kernels on CUDA), as with --sdpa", why)
        return
    for name in ("sdpa", "mem_eff_attn"):
        if getattr(precision, name):
            log.info("--%s: the UNet uses PyTorch's scaled-dot-product attention, which picks a "
                     "memory-efficient kernel by itself; nothing else to switch on", name)


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


def store_frozen_fp8(model: SDModel, policy: PrecisionPolicy, family: ModelFamily = SDFamily()) -> None:
    """``--fp8_base`` / ``--fp8_base_unet`` (after ``--base_weights`` are merged, before the LoRA is attached), each
    part as its family stores it (``ModelFamily.store_fp8``)."""
    parts = [("UNet", model.unet, True)] if policy.unet_fp8 else []
    if policy.text_encoder_fp8:
        encoders = family.text_encoders(model)
        parts += [(f"text encoder {i + 1}" if len(encoders) > 1 else "text encoder", te, False)
                  for i, te in enumerate(encoders)]
    for name, part, denoiser in parts:
        layers = family.store_fp8(part, denoiser, policy.frozen_dtype)
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
        if not torch.isfinite(latents).all():  # on the CPU already: no extra wait for the device
            fix = ("SDXL's VAE overflows in fp16: add --no_half_vae (or use a VAE fixed for fp16)"
                   if policy.vae_dtype == torch.float16 else "check the VAE's weights (--vae)")
            raise UserError(f"the VAE ({str(policy.vae_dtype).removeprefix('torch.')}) turned images into NaN/Inf "
                            f"latents, which cannot be cached; {fix}")
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


def module_id(*modules: torch.nn.Module) -> str:
    """Identify frozen models by their weights (the first tensors are enough to tell checkpoints apart) and dtype,
    so that a cache written with other text encoders (another checkpoint, fp16 vs fp32) is rebuilt."""
    digest = hashlib.sha1()
    for module in modules:
        digest.update(str(next(module.parameters()).dtype).encode())
        for param in list(module.parameters())[:4]:
            digest.update(param.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def cache_text_encoder_outputs(data, model, family: ModelFamily, policy: PrecisionPolicy, device: torch.device,
                               to_disk: bool, max_token_length: int | None, batch_size: int,
                               weighted: bool = False, share: Callable[[int], bool] | None = None,
                               wait: Callable[[], None] = lambda: None) -> None:
    """``--cache_text_encoder_outputs``: encode every caption once with the frozen text encoders (in RAM, or in
    ``<image>_te_outputs.npz`` with ``--cache_text_encoder_outputs_to_disk``), the held-out validation images' too,
    then move the encoders to the CPU, as sd-scripts does; the network must train the UNet only (checked before
    loading). With ``weighted`` (``--weighted_captions``) the weighted outputs are cached, as sd-scripts'
    ``is_weighted`` caching strategy. ``share`` and ``wait`` split a disk cache between processes
    (``TrainData.cache_text_encoder_outputs``)."""
    text_encoders = family.text_encoders(model)

    @torch.no_grad()
    def encode(captions: list[str]) -> dict[str, torch.Tensor]:
        with policy.autocast(device):
            cond = family.encode(model, captions, device, clip_skip=None, max_token_length=max_token_length,
                                 weighted=weighted)
        outputs = family.to_cache(cond)  # float32 on the CPU
        bad = [name for name, t in outputs.items() if not torch.isfinite(t).all()]
        if bad:
            raise UserError(f"the text encoders gave NaN/Inf ({', '.join(bad)}) for a batch of captions (the first: "
                            f"{captions[0]!r}), which cannot be cached; fp16 can overflow: try --mixed_precision bf16 "
                            "or no, or check the text encoders' weights")
        return outputs

    names = ArrayNames(family.cache_names, output_shapes(encode, device) if to_disk else None,
                       family.text_cache_suffix)
    data.cache_text_encoder_outputs(encode, to_disk=to_disk, encoder_id=module_id(*text_encoders),
                                    max_token_length=max_token_length, names=names, batch_size=batch_size,
                                    weighted=weighted, share=share, wait=wait)
    for text_encoder in text_encoders:
        text_encoder.to("cpu")


def output_shapes(encode: Callable[[list[str]], dict[str, torch.Tensor]],
                  device: torch.device) -> dict[str, tuple[int, ...]]:
    """The shape of each cached text encoder output for one caption, from encoding an empty one: every caption gives
    the same, as the tokens are padded to ``--max_token_length`` (sd-scripts pads alike). Torch's random streams are
    left as they were, so that the run trains the same as without the measurement."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        sample = encode([""])
    return {name: tuple(t.shape[1:]) for name, t in sample.items()}


def compile_unet(model: SDModel, precision: PrecisionConfig) -> None:
    """``--torch_compile``: compile the UNet for the training forward; a failure to compile raises at the first step.

    One graph serves every bucket: the latents' height and width are marked dynamic at each call
    (``mark_bucket_dims``), where dynamo would compile the first shape static and recompile at the second. The batch
    size stays static (a smaller last batch of a bucket compiles once more, then dynamo makes it dynamic too).
    Validation and samples run the uncompiled UNet (``_orig_mod``): eval mode and ``no_grad`` would each recompile.
    Past dynamo's recompile limit a function silently runs eager; ``RecompileLimitWarning`` says so once.
    """
    if precision.torch_compile and precision.dynamo_backend == "no":
        log.info("--torch_compile with --dynamo_backend no: the UNet is not compiled (as in sd-scripts)")
    elif precision.torch_compile:
        compiled = torch.compile(model.unet, backend=precision.dynamo_backend)
        compiled.register_forward_pre_hook(mark_bucket_dims, with_kwargs=True)
        watch_recompile_limit()
        model.unet = compiled


def mark_bucket_dims(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook of the compiled UNet (runs outside dynamo): mark the height and width of the noisy latents,
    ``[B, C, H, W]``, dynamic, so that a new bucket shape reuses the graph. ``maybe_mark_dynamic``: should the UNet
    ever need a fixed size there, dynamo specializes it (and recompiles) instead of raising."""
    sample = args[0] if args else kwargs.get("sample", kwargs.get("img"))
    if sample.ndim == 3:  # FLUX.1's packed latents [B, tokens, C]: the token count follows the bucket
        torch._dynamo.maybe_mark_dynamic(sample, 1)
        return
    torch._dynamo.maybe_mark_dynamic(sample, 2)
    torch._dynamo.maybe_mark_dynamic(sample, 3)


class RecompileLimitWarning(logging.Handler):
    """Sees dynamo's log records; at the first "hit config.recompile_limit" (``cache_size_limit`` in older torch)
    it logs one warning naming ``--torch_compile``: from there the function runs uncompiled, which dynamo itself
    reports only in a multi-line record that reads as noise."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.warned = False

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if self.warned or "hit config." not in message:
            return
        self.warned = True
        limit = message.splitlines()[0].removeprefix("torch._dynamo hit ")
        log.warning("--torch_compile: dynamo hit torch._dynamo.%s, so the UNet (or a part of it) runs uncompiled "
                    "from now on; run with TORCH_LOGS=recompiles to see what changes between steps, raise that "
                    "limit, or train without --torch_compile", limit)


def watch_recompile_limit() -> RecompileLimitWarning:
    """Attach the one ``RecompileLimitWarning`` of this process to dynamo's logger (once) and return it."""
    dynamo_log = logging.getLogger("torch._dynamo")
    for handler in dynamo_log.handlers:
        if isinstance(handler, RecompileLimitWarning):
            return handler
    handler = RecompileLimitWarning()
    dynamo_log.addHandler(handler)
    return handler
