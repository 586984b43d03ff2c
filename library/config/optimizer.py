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
    offload_optimizer_state: bool = flag(
        False, "ours: keep the optimizer state in host memory (pinned) and copy each span's state to the device for "
        "its step and back, without host waits; StochasticAdamW, Compass and SPARKLES (same results as without)")


@dataclass
class FusedOptimizerGroups:
    """``--fused_optimizer_groups`` of the full fine-tuning scripts that have it (``sdxl_train.py``,
    ``flux_train.py``): a mixin of their sections."""

    fused_optimizer_groups: int | None = flag(
        None, "step the weights inside backward in N groups of consecutive tensors (a new group where the learning "
        "rate changes), each as soon as its gradients are complete, freeing them (0: off); an optimizer that steps "
        "each tensor on its own (AdamW, Adafactor, Lion, SGD, StochasticAdamW, ...)")

    def group_count_problems(self) -> list[str]:
        """A negative ``--fused_optimizer_groups`` (sd-scripts takes 0 or none as off)."""
        groups = self.fused_optimizer_groups
        if groups is not None and groups < 0:
            return [f"--fused_optimizer_groups {groups}: give a number of groups > 0 (0 or none: off)"]
        return []


@dataclass
class BlockwiseFusedOptimizers:
    """``--blockwise_fused_optimizers`` of the full fine-tuning scripts that have it (``flux_train.py``): a mixin of
    their sections."""

    blockwise_fused_optimizers: bool = flag(
        False, "step the weights inside backward block by block, each as soon as its gradients are complete, "
        "freeing them: here the fused backward pass of --fused_backward_pass, whose spans of at most 32 tensors (and "
        "32 M elements) are finer than a block (sd-scripts makes one optimizer per block instead); an optimizer that "
        "steps each tensor on its own (AdamW, Adafactor, Lion, SGD, StochasticAdamW, ...)")


@dataclass(frozen=True)
class FusedBackward:
    """How a run steps its weights inside backward: the flag that asked for it, and the number of groups of tensors
    (``--fused_optimizer_groups``; None: ``--fused_backward_pass``'s spans of a fixed number of tensors)."""

    flag: str
    groups: int | None = None


def fused_backward(optimizer: OptimizerConfig, family_config: object = None) -> FusedBackward | None:
    """The run's fused backward pass, None without one: ``--fused_optimizer_groups N`` (N > 0; sd-scripts takes 0
    as off), ``--blockwise_fused_optimizers`` or ``--fused_backward_pass`` (the script's checks refuse two of them
    together)."""
    if isinstance(family_config, FusedOptimizerGroups) and family_config.fused_optimizer_groups:
        return FusedBackward("--fused_optimizer_groups", family_config.fused_optimizer_groups)
    if isinstance(family_config, BlockwiseFusedOptimizers) and family_config.blockwise_fused_optimizers:
        return FusedBackward("--blockwise_fused_optimizers")
    return FusedBackward("--fused_backward_pass") if optimizer.fused_backward_pass else None
