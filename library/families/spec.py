"""A model family's record: the facts about it that the shared stages read, and how to get its behaviour.

Each family package (``sd/``, ``sdxl/``, ``flux/``) exports one ``FamilySpec`` from its ``spec.py``, and
``library/families/registry.py`` lists them; nothing else keeps a table keyed by family name. A spec imports no
torch, so the entry scripts answer ``--help`` and configuration errors at once: the command line, the TOML checks
(``library/config/``), the dataset rules (bucket step, cache file names and latent channels) and the choice of LoRA
module read it. What needs the model (loading, text conditioning, prediction, sampling) is the behaviour object
``load()`` returns, a ``library.families.base.ModelFamily``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from library.config.dataset import UNET_BUCKET_STEP, BucketStep


def _no_problems(cfg: Any) -> list[str]:
    return []


def deferred(module: str, name: str) -> Callable[..., Any]:
    """``module.name`` called with the arguments given, imported only at the call: how a record names its
    behaviour class and its tiny-model writer without importing torch (``deferred("library.families.sd.family",
    "SDFamily")``)."""

    def call(*args: Any) -> Any:
        return getattr(importlib.import_module(module), name)(*args)

    call.__qualname__ = f"deferred({module}.{name})"
    return call


@dataclass(frozen=True)
class FamilySpec:
    """One model family, as one of its entry scripts presents it and as the shared stages ask about it: the family's
    LoRA script (its ``SPEC``) or one of its full fine-tuning scripts (the same facts with ``trained="model"``, their
    own script, help and flags: ``fine_tune.py``, ``train_db.py``, ``sdxl_train.py``)."""

    name: str  # its key in the registry and ``TrainConfig.family.name``
    display_name: str  # how messages name it: "SD 1.x/2.x", "SDXL", "FLUX.1"
    script: str  # its LoRA entry script, upstream's name: ``train_network.py``, ``flux_train_network.py``
    description: str  # the first line of the script's ``--help``
    trains: str  # what a configuration error says the script trains: "SDXL LoRAs"
    # what ``--pretrained_model_name_or_path`` takes, its built-in tiny model included: the flag's ``--help`` and the
    # error when it is missing
    model_help: str
    denoiser_name: str  # how log lines name the model that predicts the noise: "UNet", "transformer"
    load: Callable[[], Any]  # the behaviour object (``ModelFamily``); imports torch
    latent_suffix: str  # latent cache files ``<image>_<W>x<H><suffix>.npz``, its own as upstream keeps them apart
    section_name: str | None = None  # the ``--help`` group and snapshot name of its own flags
    section: type | None = None  # the dataclass of its own flags (``TrainConfig.family_config`` holds one)
    script_problems: Callable[[Any], list[str]] = _no_problems  # its own checks of a ``TrainConfig``
    bucket_step: BucketStep = UNET_BUCKET_STEP  # ``bucket_reso_steps``' multiple (verify_bucket_reso_steps), and why
    latent_channels: int = 4  # the channels of those latents
    text_cache_suffix: str = "_te_outputs.npz"  # ``--cache_text_encoder_outputs_to_disk`` files, as upstream's
    network_module: str = "networks.lora"  # its LoRA module (keys, block layout, ``--network_args``)
    # Shared flags it ignores: flag name -> why; a run that sets one (other than to its default) gets a warning.
    ignored_flags: Mapping[str, str] = field(default_factory=dict)
    # Shared flags it refuses: flag name -> the message (what to do instead); set, they stop the run with exit 2.
    refused_flags: Mapping[str, str] = field(default_factory=dict)
    sample_guidance: bool = False  # its sampler reads a prompt's guidance scale (``--g``) and distilled CFG
    sample_flow_shift: bool = False  # its sampler reads a prompt's flow shift (``--fs``)
    # ``caption_dropout_rate`` with ``--cache_text_encoder_outputs``: its ``ModelFamily.drop_cached_captions``
    # replaces the cached outputs of the captions the rate drops (sd-scripts' ``cache_supports_dropout``)
    cached_caption_dropout: bool = False
    # ``python -m library.tiny_model --<name> OUT_DIR``: writes its tiny model's files, says what it wrote
    write_tiny: Callable[[Path], str] | None = None
    # What the script trains: "network" (a LoRA, ``--network_module``) or "model" (full fine-tuning: the denoiser
    # and the text encoders its flags choose, saved as checkpoints by ``write_checkpoint``)
    trained: str = "network"
    # Shared flags the script does not have (upstream's parser lacks them): not in its ``--help``; given, they are
    # named as another script's option. Its own section may declare one of them anew (``save_model_as``).
    omitted_flags: frozenset[str] = frozenset()
    # A full fine-tuning script's checkpoint writer: ``write_checkpoint(model, path, CheckpointFormat, dtype,
    # metadata, epoch, step)`` (``library/families/checkpoint_flags.py``); imports torch at the call
    write_checkpoint: Callable[..., None] | None = None
    # A full fine-tuning script's choice of what trains: ``trained_parts(model, section, learning_rate)`` gives the
    # ``TrainedPart`` list (``library/families/checkpoint_flags.py``)
    trained_parts: Callable[..., list[Any]] | None = None
    # Old flag names the script still accepts (old name -> the flag it now sets), beside the shared ones of
    # ``library/config/cli.py`` ``LEGACY_FLAGS``
    legacy_flags: Mapping[str, str] = field(default_factory=dict)
    # What upstream's script does to the parsed values before training (deprecated flags converted, implied
    # flags set): ``after_parse(values)`` changes the dict of flag values in place
    after_parse: Callable[[dict[str, Any]], None] | None = None

    def family_config(self, values: Mapping[str, Any]) -> Any:
        """Its own section filled from parsed flag values (None for a family without flags of its own)."""
        if self.section is None:
            return None
        return self.section(**{f.name: values[f.name] for f in fields(self.section) if f.name in values})
