"""``--optimizer_type``, its options and the learning rates of the parameter groups."""

from __future__ import annotations

from dataclasses import dataclass

from library.config.fields import flag


@dataclass
class OptimizerConfig:
    """The optimizer and the learning rates of the parameter groups."""

    optimizer_type: str = flag("", "optimizer name (AdamW, AdamW8bit, Prodigy, SPARKLES, ...) or module.Class")
    optimizer_args: list[str] = flag([], 'optimizer options "key=value" (values are Python literals)')
    learning_rate: float = flag(2e-6, "base learning rate")
    unet_lr: float | None = flag(None, "learning rate of the UNet LoRA (default: --learning_rate)")
    text_encoder_lr: list[float] = flag(
        [], "learning rate of the text encoder LoRA (default: --learning_rate); as sd-scripts' networks.lora, one "
        "value trains every text encoder (SD1/2 use the first value); ours: two different values train SDXL's two "
        "encoders at one rate each")
    max_grad_norm: float = flag(1.0, "gradient clipping norm; 0 disables clipping")
    fused_backward_pass: bool = flag(False, "step each parameter inside backward and free its gradient")
