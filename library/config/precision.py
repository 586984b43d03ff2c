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
        "stochastic rounding (4 bytes/param: the sum and a scratch) or an exact fp32 sum (6 bytes/param)",
        choices=("stochastic", "fp32"))
    fp8_base: bool = flag(False, "store the frozen UNet and text encoder weights (not the embeddings) as "
                          "float8_e4m3fn, half the memory of bf16, computed in the --mixed_precision dtype "
                          "(needs --mixed_precision fp16 or bf16)")
    fp8_base_unet: bool = flag(False, "like --fp8_base for the UNet only; the text encoder stays in the "
                               "--mixed_precision dtype (also with --fp8_base)")
    no_half_vae: bool = flag(False, "keep the VAE in fp32 under mixed precision")
    gradient_checkpointing: bool = flag(False, "recompute activations in backward to save memory")
    cpu_offload_checkpointing: bool = flag(
        False, "with --gradient_checkpointing, keep the tensors saved at the UNet's checkpoints (each block's "
        "inputs) in pinned CPU memory until backward needs them; the text encoder is not offloaded; nothing "
        "moves when training on the CPU")
    sdpa: bool = flag(False, "PyTorch scaled-dot-product attention; accepted for compatibility: it is always the "
                      "UNet's attention here unless --xformers is given")
    xformers: bool = flag(False, "use xformers memory-efficient attention; without the xformers package or a CUDA "
                          "device the UNet uses PyTorch's scaled-dot-product attention instead (an info line says so)")
    mem_eff_attn: bool = flag(False, "memory-efficient attention; accepted for compatibility: PyTorch's "
                              "scaled-dot-product attention (always on here unless --xformers) picks a "
                              "memory-efficient kernel itself")
    torch_compile: bool = flag(False, "compile the UNet with torch.compile for the training steps: one graph for "
                               "every bucket (the latents' height and width are marked dynamic); validation and "
                               "samples run it uncompiled; a warning says if dynamo's recompile limit is hit")
    dynamo_backend: str = flag("inductor", "torch.compile backend (no: do not compile)", choices=DYNAMO_BACKENDS)
    max_nan_steps: int = flag(3, "non-finite losses/gradients in a row before the run stops (last good LoRA saved)")


def precision_problems(cfg: PrecisionConfig) -> list[str]:
    """Checks of this section alone (sd-scripts' rules where it has one)."""
    problems = []
    for name in ("fp8_base", "fp8_base_unet"):
        if getattr(cfg, name) and cfg.mixed_precision == "no":
            problems.append(f"--{name} needs --mixed_precision bf16 or fp16 (as in sd-scripts): the fp8 weights are "
                            "computed in that dtype")
    if cfg.cpu_offload_checkpointing and not cfg.gradient_checkpointing:
        problems.append("--cpu_offload_checkpointing offloads the tensors of gradient checkpointing; add "
                        "--gradient_checkpointing or drop it")
    return problems
