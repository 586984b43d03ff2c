"""Cross-field checks of a ``TrainConfig``, run before anything is loaded; every problem is reported at once."""

from __future__ import annotations

import dataclasses
import importlib.util
import logging

from library.base.errors import UserError
from library.config.data import DataConfig
from library.config.log import LogConfig, read_tracker_config
from library.config.model import model_problems
from library.config.network import network_module_problems
from library.config.precision import precision_problems
from library.config.ranges import range_problems
from library.config.sections import TrainConfig, all_fields, field_default
from library.config.unavailable import unavailable_problems

log = logging.getLogger(__name__)


def _installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except ValueError:
        return False


# The DataConfig fields that still apply when --dataset_class makes the batches.
_CUSTOM_DATASET_FIELDS = ("dataset_class", "debug_dataset", "resolution", "max_data_loader_n_workers",
                          "persistent_data_loader_workers")


def _dataset_class_problems(data: DataConfig) -> list[str]:
    """--dataset_class: latent caching cannot apply (an error); the other dataset flags have no effect (a warning)."""
    if not data.dataset_class:
        return []
    problems = []
    caching = [n for n in ("cache_latents", "cache_latents_to_disk") if getattr(data, n)]
    if caching:
        problems.append(f"--{caching[0]} with --dataset_class {data.dataset_class}: the trainer cannot cache the "
                        "latents of a custom dataset; drop it and return \"latents\" from the class instead")
    unused = [f"--{f.name}" for f in dataclasses.fields(DataConfig)
              if f.name not in _CUSTOM_DATASET_FIELDS + ("cache_latents", "cache_latents_to_disk")
              and getattr(data, f.name) != field_default(f)]
    if unused:
        log.warning("%s: no effect with --dataset_class (the class makes the batches; sd-scripts ignores them too)",
                    ", ".join(unused))
    return problems


def _log_problems(cfg: LogConfig) -> list[str]:
    """Tracker settings that would fail only once the models are loaded; tracker flags without a tracker warn."""
    problems = []
    wanted = cfg.log_with or ("tensorboard" if cfg.logging_dir else None)
    if wanted in ("tensorboard", "all") and not cfg.logging_dir:
        problems.append(f"--log_with {wanted} needs --logging_dir (the folder for the TensorBoard event files)")
    if wanted in ("wandb", "all") and not _installed("wandb"):
        problems.append(f"--log_with {wanted}: the wandb package is not installed; pip install wandb, or use "
                        "--log_with tensorboard")
    if cfg.log_tracker_config:
        try:
            read_tracker_config(cfg.log_tracker_config)
        except UserError as exc:
            problems += exc.messages
    unused = [name for name, on in (("--log_config", cfg.log_config and wanted is None),
                                    ("--log_tracker_config", cfg.log_tracker_config and wanted is None),
                                    ("--wandb_run_name", cfg.wandb_run_name and wanted not in ("wandb", "all")),
                                    ("--wandb_api_key", cfg.wandb_api_key and wanted not in ("wandb", "all")))
              if on]
    if unused:
        log.warning("%s: no effect without a tracker that uses it; add --log_with wandb (or --logging_dir DIR for "
                    "TensorBoard)", ", ".join(unused))
    return problems


def _dataset_problems(cfg: TrainConfig) -> list[str]:
    """The problems of the datasets' folders and settings (``--dataset_config``, ``bucket_reso_steps``, ...), to be
    reported with the other problems of the config. Called only when there are others: otherwise the run reads the
    datasets next anyway (``build_train_data``), and reports these then, before any model loads."""
    from library.config.dataset import load_dataset_specs  # imports library.config itself

    d = cfg.data
    if d.dataset_class or not (d.train_data_dir or d.dataset_config or d.in_json):
        return []
    try:
        load_dataset_specs(d, cfg.loss.masked_loss, cfg.family.bucket_step)
    except UserError as exc:
        return list(exc.messages)
    return []


def _is_set(cfg: TrainConfig, name: str, fields: dict[str, tuple[str, dataclasses.Field]]) -> bool:
    """Whether a shared flag asks for something: not its default, nor a value that means "off" (None, False, 0, or
    the field's own ``off`` values: ``--clip_skip 1``, ``--max_timestep 1000``)."""
    section, f = fields[name]
    value = getattr(getattr(cfg, section), name)
    return value not in (None, False, 0, "", field_default(f), *f.metadata.get("off", ()))


def _family_flag_problems(cfg: TrainConfig) -> list[str]:
    """The shared flags the run's family refuses (each its message), and one warning per reason naming the shared
    flags it ignores (``FamilySpec.refused_flags`` / ``ignored_flags``)."""
    family, fields = cfg.family, all_fields()
    reasons: dict[str, list[str]] = {}
    for name, why in family.ignored_flags.items():
        if _is_set(cfg, name, fields):
            reasons.setdefault(why, []).append(f"--{name}")
    for why, names in reasons.items():
        log.warning("%s: no effect on %s training (%s)", ", ".join(names), family.display_name, why)
    return [message for name, message in family.refused_flags.items() if _is_set(cfg, name, fields)]


def _fused_ggpo_problems(cfg: TrainConfig) -> list[str]:
    """LoRA-GGPO (``networks.ggpo``) reads an update's gradients before the optimizer steps; the fused backward pass
    steps and frees them inside backward."""
    keys = sorted({item.split("=", 1)[0].strip() for item in cfg.network.network_args} & {"ggpo_beta", "ggpo_sigma"})
    if not (cfg.optimizer.fused_backward_pass and keys):
        return []
    return [f"--network_args {'/'.join(keys)} (LoRA-GGPO) takes every gradient of an update before the optimizer "
            "steps, which --fused_backward_pass frees inside backward; drop one of them"]


def validate(cfg: TrainConfig) -> None:
    """Cross-field checks, run before anything is loaded; every problem is reported at once."""
    problems = (range_problems(cfg) + unavailable_problems(cfg.unavailable) + network_module_problems(cfg.network)
                + model_problems(cfg.model) + precision_problems(cfg.precision) + _log_problems(cfg.log)
                + _dataset_class_problems(cfg.data))
    if not cfg.model.pretrained_model_name_or_path and not cfg.data.debug_dataset:
        problems.append(f"--pretrained_model_name_or_path is required; {cfg.family.script} "
                        f"takes: {cfg.family.model_help}")
    if not cfg.save.output_dir and not cfg.data.debug_dataset:
        written = "the checkpoints are" if cfg.family.trained == "model" else "the LoRA is"
        problems.append(f"--output_dir is required: the folder where {written} written")
    name = cfg.save.output_name
    if name is not None and (name in ("", ".", "..") or any(c in name for c in ("/", "\\", "\0"))):
        problems.append(f"--output_name {name!r}: must be a plain file name (no folders, no \"..\"), since the files "
                        "are written into --output_dir; put any folder into --output_dir instead")
    if not (cfg.data.train_data_dir or cfg.data.dataset_config or cfg.data.in_json or cfg.data.dataset_class):
        problems.append("no training data: give --train_data_dir (parent of <repeats>_<name> folders), "
                        "--dataset_config, --in_json or --dataset_class")
    p = cfg.precision
    if p.full_bf16 and p.full_fp16:
        problems.append("--full_bf16 and --full_fp16 exclude each other; choose one")
    if p.full_bf16 and p.mixed_precision != "bf16":
        problems.append("--full_bf16 needs --mixed_precision bf16 (as in sd-scripts)")
    if p.full_fp16 and p.mixed_precision != "fp16":
        problems.append("--full_fp16 needs --mixed_precision fp16 (as in sd-scripts)")
    if cfg.network.network_train_unet_only and cfg.network.network_train_text_encoder_only:
        problems.append("--network_train_unet_only and --network_train_text_encoder_only exclude each other")
    problems += _fused_ggpo_problems(cfg) + _family_flag_problems(cfg) + cfg.family.script_problems(cfg)
    nz, lo, m = cfg.noise, cfg.loss, cfg.model
    if nz.adaptive_noise_scale is not None and nz.noise_offset is None:
        problems.append("--adaptive_noise_scale adds to the noise offset, so it needs --noise_offset (as in "
                        "sd-scripts)")
    if lo.scale_v_pred_loss_like_noise_pred and not m.v_parameterization:
        problems.append("--scale_v_pred_loss_like_noise_pred applies only with --v_parameterization (as in "
                        "sd-scripts)")
    if lo.v_pred_like_loss and m.v_parameterization:
        problems.append("--v_pred_like_loss adds a v-prediction-like loss to a noise-prediction model; it cannot be "
                        "used with --v_parameterization (as in sd-scripts)")
    if nz.zero_terminal_snr and not m.v_parameterization:
        log.warning("--zero_terminal_snr is meant for --v_parameterization; without it training is unexpected "
                    "(sd-scripts warns the same)")
    if (cfg.data.cache_latents or cfg.data.cache_latents_to_disk) and not cfg.data.dataset_class:
        for name, on in (("--color_aug", cfg.data.color_aug), ("--random_crop", cfg.data.random_crop)):
            if on:
                problems.append(f"{name} changes every image each epoch, so latents cannot be cached; "
                                f"drop {name} or --cache_latents")
    if cfg.data.skip_cache_check and not cfg.data.cache_latents_to_disk:
        log.warning("--skip_cache_check has no effect without --cache_latents_to_disk (it trusts existing cache "
                    "files; latents cached in RAM are made fresh each run)")
    # --xformers without the package (the kohya_ss GUI's default attention) runs on PyTorch's scaled-dot-product
    # attention, with an info line when the model is set up (library/families/model_setup.py): not a problem.
    if problems:
        raise UserError(*problems, *_dataset_problems(cfg))
