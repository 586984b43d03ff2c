"""What the full fine-tuning scripts share: the flags that choose how a checkpoint is saved (sd-scripts'
``train_util.add_sd_saving_arguments``), the format they choose, and the record of one trained part.

sd-scripts 48d368fa (``fine_tune.py``, ``train_db.py``, ``sdxl_train.py``): without ``--save_model_as`` the model is
saved in the layout it was read from, a single file when ``--pretrained_model_name_or_path`` is a file, else a
diffusers folder; ``--use_safetensors`` then picks ``.safetensors`` over ``.ckpt`` (and safetensors weights in a
diffusers folder). With ``--save_model_as`` that format is written, in safetensors when the flag is given or the
format's name contains "safetensors" (so ``--save_model_as ckpt --use_safetensors`` writes a ``.safetensors`` file,
as upstream does).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from library.config.fields import flag

CHECKPOINT_FORMATS = ("ckpt", "safetensors", "diffusers", "diffusers_safetensors")

# The shared flags of the LoRA scripts that upstream's full fine-tuning scripts lack: the network's, the LoRA's
# learning rates, merging LoRAs into the base, the LoRA's training metadata, and the LoRA's file format
# (``save_model_as``, declared anew by ``CheckpointSaving``). A full fine-tuning record omits them.
LORA_ONLY_FLAGS = frozenset({
    "network_module", "network_dim", "network_alpha", "network_dropout", "network_args", "network_weights",
    "dim_from_weights", "network_train_unet_only", "network_train_text_encoder_only", "scale_weight_norms",
    "unet_lr", "text_encoder_lr", "fp8_base_unet", "base_weights", "base_weights_multiplier", "no_metadata",
    "training_comment", "save_model_as",
})

# Shared flags a full fine-tuning script refuses when set: the trained weights cannot be stored in fp8.
FINE_TUNE_REFUSED_FLAGS = {
    "fp8_base": "--fp8_base stores frozen weights in fp8, but full fine-tuning trains the denoiser's weights; use "
                "--full_bf16 (bf16 weights with stochastically rounded updates) to halve their memory",
}


def fine_tuning_record(lora: Any, **fields: Any) -> Any:
    """The record of a full fine-tuning script of ``lora``'s family (``lora``: its LoRA script's ``FamilySpec``):
    the family's facts with ``trained="model"``, without the LoRA-only flags, refusing what the LoRA script refuses
    and ``FINE_TUNE_REFUSED_FLAGS``, and the script's own ``fields`` (script name, help, section, what it trains, its
    checkpoint writer)."""
    return replace(lora, trained="model", omitted_flags=LORA_ONLY_FLAGS,
                   refused_flags={**lora.refused_flags, **FINE_TUNE_REFUSED_FLAGS}, **fields)


@dataclass(frozen=True)
class CheckpointFormat:
    """How a checkpoint is written: one file (``.ckpt`` or ``.safetensors``) or a diffusers folder."""

    single_file: bool
    safetensors: bool

    @property
    def extension(self) -> str:
        """The file extension without its dot; "" for a diffusers folder (named by its stem alone)."""
        if not self.single_file:
            return ""
        return "safetensors" if self.safetensors else "ckpt"

    def describe(self) -> str:
        if self.single_file:
            return f"one .{self.extension} file in the original layout"
        return "a diffusers folder with " + ("safetensors" if self.safetensors else ".bin") + " weights"


@dataclass
class CheckpointSaving:
    """The checkpoint flags of the full fine-tuning scripts (a mixin of their sections)."""

    # The one format a script writes whatever the flags say (``flux_train.py``: one .safetensors file); None: chosen
    # by the flags and the model's source (``checkpoint_format``).
    ONLY_FORMAT: ClassVar[CheckpointFormat | None] = None

    save_model_as: str | None = flag(
        None, "format of the saved model: ckpt / safetensors (one file in the original layout) or diffusers / "
        "diffusers_safetensors (a diffusers folder); default: the layout the model was read from",
        choices=CHECKPOINT_FORMATS)
    use_safetensors: bool = flag(
        False, "save in safetensors (a .safetensors file, or safetensors weights in a diffusers folder) where "
        "--save_model_as does not say")


def checkpoint_format(section: CheckpointSaving, source: str | None) -> CheckpointFormat:
    """The format sd-scripts writes for these flags and ``--pretrained_model_name_or_path`` ``source`` (a section
    whose script writes one format only says which, ``CheckpointSaving.ONLY_FORMAT``)."""
    if section.ONLY_FORMAT is not None:
        return section.ONLY_FORMAT
    chosen = section.save_model_as
    if chosen is None:
        return CheckpointFormat(single_file=source is not None and os.path.isfile(source),
                                safetensors=section.use_safetensors)
    return CheckpointFormat(single_file=chosen in ("ckpt", "safetensors"),
                            safetensors=section.use_safetensors or "safetensors" in chosen)


@dataclass(frozen=True)
class ParamGroup:
    """Some of a trained part's parameters at a learning rate of their own, named in the logs (``lr/<name>``)."""

    name: str
    params: tuple[Any, ...]
    learning_rate: float


@dataclass(frozen=True)
class TrainedPart:
    """One module a full fine-tuning run trains, with its name in the logs (``lr/<name>``), its learning rate, what
    stays frozen in it (submodules the forward pass never reads, which would get no gradient, or parameters at a
    learning rate of 0), ``groups``: where given, the optimizer's groups of the part in its place (SDXL's
    ``--block_lr``, one group per U-Net block), and ``updates``: where given, the part trains for that many updates
    only (``train_db.py --stop_text_encoder_training``)."""

    name: str
    module: Any
    learning_rate: float
    frozen: tuple[Any, ...] = ()
    groups: tuple[ParamGroup, ...] = ()
    updates: int | None = None


def swap_problems(swapped: int, fused: bool, accumulation: int,
                  fused_flags: str = "--fused_backward_pass") -> list[str]:
    """What a full fine-tuning script refuses about ``--blocks_to_swap swapped`` (``flux_train.py``,
    ``anima_train.py``): a swapped block's own weights are stepped inside backward while it is on the device, so a
    fused mode is needed (``fused``: one is on; ``fused_flags``: how to turn one on), and the window's gradient sums
    of swapped blocks do not move with them, so accumulation must be 1."""
    problems = []
    if swapped > 0 and not fused:
        problems.append(f"--blocks_to_swap {swapped}: a swapped block's weights are stepped inside backward while "
                        f"the block is on the device; add {fused_flags}")
    if swapped > 0 and accumulation > 1:
        problems.append(f"--blocks_to_swap {swapped} with --gradient_accumulation_steps {accumulation}: the "
                        "window's gradient sums of swapped blocks are not moved with them yet; use "
                        "--gradient_accumulation_steps 1 (a larger --train_batch_size), or drop --blocks_to_swap")
    return problems
