"""The model stage: load the model of the run's family offline, freeze and cast it by the precision policy, set
attention and gradient checkpointing, store the frozen weights in fp8 (``--fp8_base``), and compile the denoiser
(``model.unet``: a U-Net, or FLUX.1's transformer).
Caching latents and text encoder outputs with the loaded model is the data stage's (``library/data/encode_caches.py``).
"""

from __future__ import annotations

import importlib.util
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from library.config import ModelConfig, PrecisionConfig
from library.families.base import ModelFamily
from library.families.fp8 import fp8_bytes
from library.families.precision import PrecisionPolicy

log = logging.getLogger(__name__)


def load_model(cfg: ModelConfig, precision: PrecisionConfig, policy: PrecisionPolicy, device: torch.device,
               family: ModelFamily, section: Any = None) -> Any:
    """Load, freeze and cast the model of ``family`` (``section``: its own flag section, ``TrainConfig.
    family_config``); set the denoiser's attention backend and gradient checkpointing (``ModelFamily.
    prepare_denoiser``) and the text encoders' checkpointing."""
    model = family.load(cfg, section, policy.frozen_dtype, file_device=str(device) if cfg.lowram else "cpu")
    if cfg.lowram:
        log.info(_lowram_note(cfg.pretrained_model_name_or_path, device))
    text_encoders = family.text_encoders(model)
    for part in (model.unet, *text_encoders, model.vae):
        part.requires_grad_(False)
        part.eval()
    model.unet.to(family.denoiser_device(section, device), policy.frozen_dtype)
    fp8_next = fp8_text_encoders(model, policy, family, section)
    for text_encoder in text_encoders:
        family.place_text_encoder(text_encoder, device, policy.frozen_dtype,
                                  fp8_next=any(text_encoder is chosen for chosen in fp8_next))
    model.vae.to(device, policy.vae_dtype)
    family.prepare_denoiser(model, precision, device)
    if precision.gradient_checkpointing:
        # diffusers and transformers only checkpoint modules in training mode (sd-scripts sets train() too).
        model.unet.train()
        for text_encoder in text_encoders:
            family.checkpoint_text_encoder(text_encoder)
            text_encoder.train()
        if precision.cpu_offload_checkpointing and device.type == "cpu":
            log.info("--cpu_offload_checkpointing: training on the CPU, so the checkpointed tensors already are in "
                     "CPU memory")
    return model


def set_attention(model: Any, precision: PrecisionConfig, device: torch.device) -> None:
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
    if not path.startswith("builtin:") and Path(path).is_file():
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


def fp8_text_encoders(model: Any, policy: PrecisionPolicy, family: ModelFamily, section: Any) -> list[torch.nn.Module]:
    """The text encoders ``--fp8_base`` stores in fp8 (``ModelFamily.fp8_text_encoders``): none with
    ``--fp8_base_unet`` or without fp8; otherwise as the family decides for a run that does or does not cache
    their outputs (``section``: the family's flag section)."""
    if not policy.text_encoder_fp8:
        return []
    cached, _ = family.text_output_cache(section)
    return family.fp8_text_encoders(model, cached)


def store_frozen_fp8(model: Any, policy: PrecisionPolicy, family: ModelFamily, denoiser_name: str,
                     section: Any = None) -> PrecisionPolicy:
    """``--fp8_base`` / ``--fp8_base_unet`` (after ``--base_weights`` are merged, before the LoRA is attached), each
    part as its family stores it (``ModelFamily.store_fp8``), the text encoders ``fp8_text_encoders``' only; the
    log names the denoiser ``denoiser_name``. Returns the policy as applied (no text encoder in fp8 where none is)."""
    parts = [(denoiser_name, model.unet, True)] if policy.unet_fp8 else []
    encoders, chosen = family.text_encoders(model), fp8_text_encoders(model, policy, family, section)
    parts += [(f"text encoder {i + 1}" if len(encoders) > 1 else "text encoder", te, False)
              for i, te in enumerate(encoders) if any(te is c for c in chosen)]
    if policy.text_encoder_fp8 and len(chosen) < len(encoders):
        log.info("--fp8_base: %d of %d text encoders stay in %s: their outputs are cached with them, and like "
                 "sd-scripts only text encoders that run after caching are stored in fp8",
                 len(encoders) - len(chosen), len(encoders), str(policy.frozen_dtype).removeprefix("torch."))
    for name, part, denoiser in parts:
        layers = family.store_fp8(part, denoiser, policy.frozen_dtype)
        stored, total = fp8_bytes(part)
        log.info("%s: %d layers store their weights in float8_e4m3fn (%.0f MiB in fp8, %.0f MiB of parameters "
                 "in all)", name, layers, stored / 2**20, total / 2**20)
    return replace(policy, text_encoder_fp8=bool(chosen))


@dataclass
class CompileClock:
    """How long ``--torch_compile``'s compilation takes: dynamo compiles at the compiled denoiser's first call (a
    forward pre-hook, ``start``, says so in the log just before), and its backward at the first backward; the first
    update of the run, read by the loop (``first_update_done``), ends the measured stretch. Nothing is timed after it.
    """

    denoiser_name: str
    backend: str
    started: float | None = None

    def start(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if self.started is None:
            log.info("--torch_compile: compiling the %s (--dynamo_backend %s) at its first call; the first steps take "
                     "longer", self.denoiser_name, self.backend)
            self.started = time.perf_counter()

    def first_update_done(self) -> None:
        if self.started is not None:
            log.info("--torch_compile: the first step took %.1f s, compiling the %s included", time.perf_counter() -
                     self.started, self.denoiser_name)


def compile_unet(model: Any, precision: PrecisionConfig, denoiser_name: str, *,
                 bucket_shapes: int) -> CompileClock | None:
    """``--torch_compile``: compile the denoiser (named ``denoiser_name`` in the log) for the training forward; a
    failure to compile raises at the first step. Returns the clock of the compilation (``CompileClock``; None when
    nothing is compiled).

    With more than one bucket shape among the training batches (``bucket_shapes``), one graph serves every bucket:
    the latents' height and width are marked dynamic at each call (``mark_bucket_dims``), where dynamo would compile
    the first shape static and recompile at the second. With a single shape (no bucketing, or every image in one
    bucket) the graph stays static: dynamo traces it without symbolic sizes (the tiny SDXL U-Net: 35 s instead of
    58 s on this CPU) and the backend may specialise its kernels to the size. The batch size stays static (a smaller
    last batch of a bucket compiles once more, then dynamo makes it dynamic too). Validation and samples run the
    uncompiled UNet (``_orig_mod``): eval mode and ``no_grad`` would each recompile. Past dynamo's recompile limit a
    function silently runs eager; ``RecompileLimitWarning`` says so once.
    """
    if precision.torch_compile and precision.dynamo_backend == "no":
        log.info("--torch_compile with --dynamo_backend no: the %s is not compiled (as in sd-scripts)", denoiser_name)
    elif precision.torch_compile:
        compiled = torch.compile(model.unet, backend=precision.dynamo_backend)
        clock = CompileClock(denoiser_name, precision.dynamo_backend)
        compiled.register_forward_pre_hook(clock.start, with_kwargs=True)
        if bucket_shapes > 1:
            compiled.register_forward_pre_hook(mark_bucket_dims, with_kwargs=True)
        watch_recompile_limit().denoiser_name = denoiser_name
        model.unet = compiled
        return clock
    return None


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
        self.denoiser_name = "model"  # the compiled denoiser's name in the warning, set by ``compile_unet``

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if self.warned or "hit config." not in message:
            return
        self.warned = True
        limit = message.splitlines()[0].removeprefix("torch._dynamo hit ")
        log.warning("--torch_compile: dynamo hit torch._dynamo.%s, so the %s (or a part of it) runs uncompiled "
                    "from now on; run with TORCH_LOGS=recompiles to see what changes between steps, raise that "
                    "limit, or train without --torch_compile", limit, self.denoiser_name)


def watch_recompile_limit() -> RecompileLimitWarning:
    """Attach the one ``RecompileLimitWarning`` of this process to dynamo's logger (once) and return it."""
    dynamo_log = logging.getLogger("torch._dynamo")
    for handler in dynamo_log.handlers:
        if isinstance(handler, RecompileLimitWarning):
            return handler
    handler = RecompileLimitWarning()
    dynamo_log.addHandler(handler)
    return handler
