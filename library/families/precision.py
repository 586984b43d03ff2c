"""The precision policy: which part of the model is in which dtype, decided once before the loop.

sd-scripts (``train_network.py``): ``--mixed_precision`` sets the dtype of the frozen denoiser (the U-Net, or
FLUX.1's transformer) and text encoders and the autocast dtype; the VAE follows it unless ``--no_half_vae``; LoRA
weights stay fp32 unless ``--full_fp16`` / ``--full_bf16`` cast the network. The loss is always computed in fp32.
Where we do better: under ``--full_bf16`` every optimizer write-back is stochastically rounded (see
``optimizers/``), so small updates are not lost to round-to-nearest. ``--fp8_base`` stores the frozen denoiser and
text encoder weights (``--fp8_base_unet``: the denoiser's only) in float8_e4m3fn, computed in the mixed dtype
(``library/families/fp8.py``); sd-scripts requires ``--mixed_precision`` fp16 or bf16 for it, and so does
``library/config/precision.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from library.config import PrecisionConfig

DTYPES = {"no": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dtype, str(dtype))


@dataclass(frozen=True)
class PrecisionPolicy:
    """Dtypes of every part of a training run."""

    frozen_dtype: torch.dtype
    vae_dtype: torch.dtype
    network_dtype: torch.dtype
    autocast_dtype: torch.dtype | None
    loss_scaling: bool
    unet_fp8: bool = False
    text_encoder_fp8: bool = False

    def autocast(self, device: torch.device):
        """The autocast context for the forward pass (a no-op context in fp32)."""
        if self.autocast_dtype is None:
            return torch.autocast(device.type, enabled=False)
        return torch.autocast(device.type, dtype=self.autocast_dtype)

    def describe(self, optimizer_state: str, denoiser: str, full_model: bool = False) -> str:
        """One line naming the dtype of every part, printed at the start of a run; ``denoiser``: the family's name
        for its denoiser (``FamilySpec.denoiser_name``); ``full_model``: a full fine-tuning run, whose trained
        weights are the model's own."""
        frozen = dtype_name(self.frozen_dtype)
        unet = f"fp8 e4m3fn computed in {frozen}" if self.unet_fp8 else frozen
        text_encoder = f"fp8 e4m3fn computed in {frozen}" if self.text_encoder_fp8 else frozen
        parts = (f"trained weights ({denoiser}, trained text encoders) {dtype_name(self.network_dtype)}, other "
                 f"weights {frozen}" if full_model else f"{denoiser} {unet}, text encoder {text_encoder}")
        return (f"precision: {parts}, "
                f"VAE {dtype_name(self.vae_dtype)}, "
                + ("" if full_model else f"LoRA weights {dtype_name(self.network_dtype)}, ") +
                f"gradients {dtype_name(self.network_dtype)}, optimizer state {optimizer_state}, "
                f"autocast {dtype_name(self.autocast_dtype) if self.autocast_dtype else 'off'}, loss fp32"
                + (", dynamic loss scaling" if self.loss_scaling else ""))


def precision_policy(cfg: PrecisionConfig) -> PrecisionPolicy:
    """The policy for a validated ``PrecisionConfig``."""
    weight = DTYPES[cfg.mixed_precision]
    network = weight if (cfg.full_bf16 or cfg.full_fp16) else torch.float32
    return PrecisionPolicy(
        frozen_dtype=weight,
        vae_dtype=torch.float32 if cfg.no_half_vae else weight,
        network_dtype=network,
        autocast_dtype=None if cfg.mixed_precision == "no" else weight,
        loss_scaling=cfg.mixed_precision == "fp16",
        unet_fp8=cfg.fp8_base or cfg.fp8_base_unet,
        text_encoder_fp8=cfg.fp8_base and not cfg.fp8_base_unet,
    )


def optimizer_state_dtype(optimizer: torch.optim.Optimizer) -> str:
    """The dtypes of the optimizer's floating-point state tensors (after its first step), e.g. "bf16"."""
    found = {dtype_name(v.dtype) for state in optimizer.state.values() for v in state.values()
             if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() > 0}
    return "/".join(sorted(found)) if found else "none"
