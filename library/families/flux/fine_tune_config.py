"""The flags only ``flux_train.py`` (FLUX.1 full fine-tuning) has, what it does to them after parsing, and what it
refuses.

Upstream sd-scripts 48d368fa ``flux_train.setup_parser``: the FLUX.1 flags of ``flux_train_network.py``
(``FluxConfig``) plus ``--mem_eff_save``, ``--fused_optimizer_groups``, ``--blockwise_fused_optimizers``, the
deprecated ``--skip_latents_validity_check`` (sets ``--skip_cache_check``), ``--double_blocks_to_swap`` /
``--single_blocks_to_swap`` (converted to ``--blocks_to_swap`` when it is not given) and the checkpoint flags of the
full fine-tuning scripts. Its ``train``: the transformer is loaded in ``--mixed_precision``'s dtype and trained in it
(so ``--mixed_precision bf16`` alone trains bf16 weights, as ``--full_bf16``, which is set here so that the
optimizers round stochastically; under ``--mixed_precision fp16`` without ``--full_fp16`` upstream's gradient scaler
refuses the fp16 gradients at the first step, and here the weights train in fp32 with loss scaling); the
checkpoint is always one ``.safetensors`` file in BFL's layout, whatever ``--save_model_as`` / ``--use_safetensors``
say; the text encoders are never trained.

Where we differ: upstream accepts ``--fused_optimizer_groups`` and ignores it ("this option is not working"); here it
steps the weights inside backward in N groups of tensors, as ``sdxl_train.py``'s does.
``--blockwise_fused_optimizers`` is the fused backward pass (one optimizer, finer spans than a block). Saving streams
the tensors into the file one at a time, converted to ``--save_precision`` as they are written, with or without
``--mem_eff_save`` (upstream without it builds a converted copy of the whole model first).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from library.config.fields import flag
from library.config.optimizer import BlockwiseFusedOptimizers, FusedOptimizerGroups
from library.families.checkpoint_flags import CheckpointFormat, CheckpointSaving, swap_problems
from library.families.flux.config import FluxConfig, flux_script_problems

if TYPE_CHECKING:
    from library.config.sections import TrainConfig

log = logging.getLogger(__name__)

# flux_train.py's old name for --skip_cache_check (upstream: skip_cache_check = skip_cache_check or the old flag)
LEGACY_FLAGS = {"skip_latents_validity_check": "skip_cache_check"}


@dataclass
class FluxFineTuneConfig(FluxConfig, CheckpointSaving, FusedOptimizerGroups, BlockwiseFusedOptimizers):
    """flux_train.py only: how the checkpoint is saved, the fused backward variants and the deprecated swap
    counts."""

    ONLY_FORMAT: ClassVar[CheckpointFormat | None] = CheckpointFormat(single_file=True, safetensors=True)

    use_safetensors: bool = flag(False, "no effect: flux_train.py always writes .safetensors (as sd-scripts')")
    mem_eff_save: bool = flag(
        False, "write the checkpoint without a second copy of the model in host memory: here every save streams "
        "the tensors into the file one at a time, converted to --save_precision as they go, with or without it")
    double_blocks_to_swap: int | None = flag(
        None, "deprecated upstream: with --single_blocks_to_swap, the same as --blocks_to_swap "
        "(double + single // 2) when --blocks_to_swap is not given; use --blocks_to_swap instead")
    single_blocks_to_swap: int | None = flag(
        None, "deprecated upstream: see --double_blocks_to_swap; use --blocks_to_swap instead")


def flux_fine_tune_after_parse(values: dict[str, Any]) -> None:
    """What upstream's ``flux_train.py`` does to its arguments before training: the deprecated swap counts become
    ``--blocks_to_swap`` (double + single // 2, when that is not given and the sum is above 0), and under
    ``--mixed_precision bf16`` the transformer trains in bf16 (``--full_bf16``)."""
    if values.get("blocks_to_swap") is None:
        double, single = values.get("double_blocks_to_swap"), values.get("single_blocks_to_swap")
        converted = (double or 0) + (single // 2 if single is not None else 0)
        if converted > 0:
            log.warning("--double_blocks_to_swap / --single_blocks_to_swap are deprecated: converted to "
                        "--blocks_to_swap %d (as in sd-scripts); use --blocks_to_swap instead", converted)
            values["blocks_to_swap"] = converted
    if values.get("mixed_precision") == "bf16" and not values.get("full_bf16"):
        values["full_bf16"] = True


def flux_fine_tune_problems(cfg: TrainConfig) -> list[str]:
    """What ``flux_train.py`` refuses: the checks it shares with ``flux_train_network.py``, a negative
    ``--fused_optimizer_groups``, two ways of stepping inside backward at once (upstream silently prefers one),
    ``--save_model_as`` other than safetensors, and swapping the trained blocks without stepping inside backward or
    with gradient accumulation."""
    section, problems = cfg.family_config, flux_script_problems(cfg)
    problems += section.group_count_problems()
    chosen = [name for name, on in (("--fused_backward_pass", cfg.optimizer.fused_backward_pass),
                                    ("--fused_optimizer_groups", bool(section.fused_optimizer_groups)),
                                    ("--blockwise_fused_optimizers", section.blockwise_fused_optimizers)) if on]
    if len(chosen) > 1:
        problems.append(f"{' and '.join(chosen)}: each steps the weights inside backward; give one "
                        "(--fused_backward_pass: 32 tensors at a time; --fused_optimizer_groups N: N groups)")
    if section.save_model_as not in (None, "safetensors"):
        problems.append(f"--save_model_as {section.save_model_as}: flux_train.py writes one .safetensors file in "
                        "BFL's layout (sd-scripts' flux_train.py ignores the flag and writes the same); drop the "
                        "flag or give safetensors")
    problems += swap_problems(section.swapped_blocks, bool(chosen), cfg.schedule.gradient_accumulation_steps,
                              "--fused_backward_pass (or --fused_optimizer_groups N / --blockwise_fused_optimizers)")
    return problems
