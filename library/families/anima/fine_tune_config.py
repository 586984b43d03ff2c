"""The flags only ``anima_train.py`` (Anima full fine-tuning) has, and what it refuses.

Upstream sd-scripts 48d368fa ``anima_train.setup_parser``: the Anima flags of ``anima_train_network.py``
(``AnimaConfig``) plus the checkpoint flags of the full fine-tuning scripts and the deprecated
``--skip_latents_validity_check`` (sets ``--skip_cache_check``); the component learning rates (``--llm_adapter_lr``,
``--self_attn_lr``, ``--cross_attn_lr``, ``--mlp_lr``, ``--mod_lr``), which the LoRA script refuses, are read here
(``fine_tuning.py``). Its ``train``: the DiT trains in fp32 unless ``--full_bf16`` / ``--full_fp16`` (no implied
``--full_bf16``, unlike ``flux_train.py``: the shared precision policy already does this); the checkpoint is always
one ``.safetensors`` file (``save_sd_model_on_train_end_common(args, True, True, ...)``), whatever
``--save_model_as`` / ``--use_safetensors`` say; Qwen3 is never trained, so caching its outputs needs no LoRA flag.

Where we differ: upstream turns ``--gradient_checkpointing`` on for ``--cpu_offload_checkpointing``; here, as for
every script, the missing flag is an error that says to add it. ``--blocks_to_swap`` (the LoRA script's block
swapping, ``swap.py``) needs ``--fused_backward_pass`` and ``--gradient_accumulation_steps 1`` here, as in
``flux_train.py``: a swapped block's weights are stepped while it is on the device (upstream steps after backward).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from library.config.fields import flag
from library.families.anima.config import COMPONENT_LRS, AnimaConfig, anima_script_problems
from library.families.checkpoint_flags import CheckpointFormat, CheckpointSaving, swap_problems

if TYPE_CHECKING:
    from library.config.sections import TrainConfig

# anima_train.py's old name for --skip_cache_check (upstream: skip_cache_check = skip_cache_check or the old flag)
LEGACY_FLAGS = {"skip_latents_validity_check": "skip_cache_check"}


def _lr_help(what: str) -> str:
    return f"learning rate of the {what} (default: --learning_rate; 0: frozen, left out of the optimizer)"


@dataclass
class AnimaFineTuneConfig(AnimaConfig, CheckpointSaving):
    """anima_train.py only: how the checkpoint is saved, and the component learning rates put to use."""

    ONLY_FORMAT: ClassVar[CheckpointFormat | None] = CheckpointFormat(single_file=True, safetensors=True)

    use_safetensors: bool = flag(False, "no effect: anima_train.py always writes .safetensors (as sd-scripts')")
    llm_adapter_lr: float | None = flag(None, _lr_help("LLM adapter (llm_adapter.*)"))
    self_attn_lr: float | None = flag(None, _lr_help("blocks' self-attention layers (*.self_attn.*)"))
    cross_attn_lr: float | None = flag(None, _lr_help("blocks' cross-attention layers (*.cross_attn.*)"))
    mlp_lr: float | None = flag(None, _lr_help("blocks' MLP layers (*.mlp.*)"))
    mod_lr: float | None = flag(
        None, _lr_help("AdaLN modulation layers (*.adaln_modulation*, the final layer's included)"))


def anima_fine_tune_problems(cfg: TrainConfig) -> list[str]:
    """What ``anima_train.py`` refuses: the checks it shares with ``anima_train_network.py`` (but the LoRA's),
    negative component learning rates, ``--save_model_as`` other than safetensors, and swapping blocks without
    stepping inside backward or with gradient accumulation (as ``flux_train.py``)."""
    section, problems = cfg.family_config, anima_script_problems(cfg)
    for name in COMPONENT_LRS:
        value = getattr(section, name)
        if value is not None and value < 0:
            problems.append(f"--{name} {value}: must not be negative (0 freezes that part; none: --learning_rate)")
    if section.save_model_as not in (None, "safetensors"):
        problems.append(f"--save_model_as {section.save_model_as}: anima_train.py writes one .safetensors file "
                        "with the DiT's 'net.' keys (sd-scripts' anima_train.py ignores the flag and writes the "
                        "same); drop the flag or give safetensors")
    problems += swap_problems(section.blocks_to_swap or 0, cfg.optimizer.fused_backward_pass,
                              cfg.schedule.gradient_accumulation_steps)
    return problems
