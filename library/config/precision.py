"""Dtypes of every part, and the memory/speed switches that change how a step runs."""

from __future__ import annotations

from dataclasses import dataclass

from library.config.fields import flag

# Every --dynamo_backend value sd-scripts lists, plus "no" (the kohya_ss GUI's "off"): torch.compile is skipped.
DYNAMO_BACKENDS = ("no", "eager", "aot_eager", "inductor", "aot_ts_nvfuser", "nvprims_nvfuser", "cudagraphs", "ofi",
                   "fx2trt", "onnxrt", "tensort", "ipex", "tvm")


@dataclass
class PrecisionConfig:
    """Dtypes of every part, and the memory/speed switches that change how the step runs."""

    mixed_precision: str = flag("no", "autocast dtype and dtype of the frozen models",
                                choices=("no", "fp16", "bf16"))
    full_bf16: bool = flag(False, "LoRA weights, gradients and optimizer state in bf16 (needs --mixed_precision bf16)")
    full_fp16: bool = flag(False, "LoRA weights and gradients in fp16, loss scaling (needs --mixed_precision fp16)")
    full_bf16_grad_accumulation: str = flag(
        "stochastic", "how bf16 gradients are summed over --gradient_accumulation_steps: a bf16 sum with "
        "stochastic rounding (2 bytes/param) or an fp32 buffer (4 bytes/param)", choices=("stochastic", "fp32"))
    fp8_base: bool = flag(False, "store the frozen UNet and text encoder weights as float8_e4m3fn, computed in the "
                          "--mixed_precision dtype")
    fp8_base_unet: bool = flag(False, "like --fp8_base for the UNet only; the text encoder stays in the "
                               "--mixed_precision dtype")
    no_half_vae: bool = flag(False, "keep the VAE in fp32 under mixed precision")
    gradient_checkpointing: bool = flag(False, "recompute activations in backward to save memory")
    cpu_offload_checkpointing: bool = flag(False, "with --gradient_checkpointing, keep the checkpointed activations "
                                           "in CPU memory")
    sdpa: bool = flag(False, "PyTorch scaled-dot-product attention; accepted for compatibility: it is always the "
                      "attention here unless --xformers is given")
    xformers: bool = flag(False, "use xformers memory-efficient attention (needs the xformers package)")
    mem_eff_attn: bool = flag(False, "memory-efficient attention; accepted for compatibility: PyTorch's "
                              "scaled-dot-product attention (always on here) already is memory-efficient")
    torch_compile: bool = flag(False, "compile the UNet with torch.compile")
    dynamo_backend: str = flag("inductor", "torch.compile backend (no: do not compile)", choices=DYNAMO_BACKENDS)
    max_nan_steps: int = flag(3, "non-finite losses/gradients in a row before the run stops (last good LoRA saved)")
