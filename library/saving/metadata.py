"""The ``ss_*`` training metadata and the SAI ModelSpec entries written into every LoRA file.

Key names and value formats follow sd-scripts' ``train_network.py`` and ``library/sai_model_spec.py``:
every value is a string, booleans as "True"/"False", missing values as "None". Keys of our own (``ss_full_bf16``,
``ss_stochastic_rounding``) are additive. The ``ss_validation_*`` keys are the command-line values, as sd-scripts
writes ``args.validation_*`` (a dataset config's own ``validation_split`` is not among them);
``ss_num_validation_images`` comes with the dataset keys.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import mimetypes
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from library.base.errors import UserError
from library.config import TrainConfig
from library.families.base import ModelIds
from library.train.steps import StepPlan

# sd-scripts keeps only these under --no_metadata.
MINIMAL_KEYS = ("ss_v2", "ss_base_model_version", "ss_network_module", "ss_network_dim", "ss_network_alpha",
                "ss_network_args")
# ss_sd_scripts_commit_hash and modelspec.implementation_version. sd-scripts writes its git commit (40 hex digits,
# or "(unknown)" outside a checkout) and "sd-scripts/<commit>"; the readers (A1111's and ComfyUI's metadata views,
# civitai) only display them. Both carry this value, in upstream's "<implementation>/<version>" form, which cannot be
# taken for an sd-scripts commit (this checkout's own commit, 40 hex digits too, would be).
PROJECT_VERSION = "sd-scripts-bf16/0.1"
# modelspec.implementation of the SD and SDXL full checkpoints (sai_model_spec.IMPL_STABILITY_AI for
# is_stable_diffusion_ckpt; FLUX.1's keep BFL's, as its LoRAs do)
STABILITY_AI_IMPLEMENTATION = "https://github.com/Stability-AI/generative-models"
# The --metadata_* flags that become modelspec.<name> entries (sd-scripts' add_model_spec_arguments; title apart).
SPEC_FLAGS = ("author", "description", "license", "tags", "usage_hint", "thumbnail", "merged_from", "trigger_phrase",
              "preprocessor", "is_negative_embedding")


def _s(value: Any) -> str:
    return str(value)


@dataclass(frozen=True)
class Metadata:
    """The metadata of a run: the ``ss_*`` entries fixed at the start and the ModelSpec entries.

    ``at_save`` completes them for one file, as sd-scripts' ``save_model`` does: when, at which step and epoch,
    and the ModelSpec date (and default title) of that moment (``train_util.get_sai_model_spec`` is called per save).
    """

    training: dict[str, str]
    spec: dict[str, str]
    title: str | None
    no_metadata: bool
    kind: str = "LoRA"  # the default title's word: "LoRA@<time>", "Checkpoint@<time>"

    def at_save(self, *, steps: int, epoch: int, now: float | None = None) -> dict[str, str]:
        now = time.time() if now is None else now
        meta = dict(self.training)
        if not self.no_metadata:
            meta.update({"ss_training_finished_at": _s(now), "ss_steps": _s(steps), "ss_epoch": _s(epoch)})
        spec = {**self.spec, "modelspec.title": self.title or f"{self.kind}@{now}",
                "modelspec.date": datetime.datetime.fromtimestamp(int(now)).isoformat()}
        return {**meta, **spec}


def modelspec(cfg: TrainConfig, ids: ModelIds, resolution: tuple[int, int], thumbnail: str | None) -> dict[str, str]:
    """SAI ModelSpec 1.0.1 entries of a LoRA except title and date (sd-scripts' ``sai_model_spec.build_metadata``
    via ``train_util.get_sai_model_spec``).

    ``modelspec.timestep_range`` is "min,max" when ``--min_timestep`` or ``--max_timestep`` is given (the other
    end 0 or 1000), ``modelspec.encoder_layer`` the ``--clip_skip``; every ``--metadata_*`` flag that is given
    becomes ``modelspec.<name>``, with ``thumbnail`` the data URL (``thumbnail_data_url``). The architecture,
    implementation and prediction type (none for a family whose ``ids`` has none) are the model family's.
    """
    m, s, nz = cfg.model, cfg.save, cfg.noise
    spec = {
        "modelspec.sai_model_spec": "1.0.1",
        "modelspec.architecture": ids.architecture,
        "modelspec.implementation": ids.implementation,
        "modelspec.resolution": f"{resolution[0]}x{resolution[1]}",
        "modelspec.implementation_version": PROJECT_VERSION,
    }
    if ids.prediction_type is not None:
        spec["modelspec.prediction_type"] = ids.prediction_type
    if nz.min_timestep is not None or nz.max_timestep is not None:
        low = nz.min_timestep if nz.min_timestep is not None else 0
        high = nz.max_timestep if nz.max_timestep is not None else 1000
        spec["modelspec.timestep_range"] = f"{low},{high}"
    if m.clip_skip is not None:
        spec["modelspec.encoder_layer"] = _s(m.clip_skip)
    for key in SPEC_FLAGS:
        value = thumbnail if key == "thumbnail" else getattr(s, f"metadata_{key}")
        if value is not None:
            spec[f"modelspec.{key}"] = value
    return spec


def checkpoint_metadata(cfg: TrainConfig, ids: ModelIds, resolution: tuple[int, int],
                        thumbnail: str | None) -> Metadata:
    """The metadata of a full fine-tuning checkpoint, as sd-scripts' ``get_sai_model_spec(..., lora=False,
    is_stable_diffusion_ckpt=True)`` makes it: the ModelSpec entries of ``modelspec`` with the model's own
    architecture (no "/lora"), Stability AI's implementation in place of diffusers' (FLUX.1 keeps BFL's, as
    ``flux_train.py``'s ``flux="dev"`` gives; the architecture here is the model's variant, where upstream writes
    flux-1-dev for schnell too) and the default title "Checkpoint@<time>"; no ``ss_*`` entries are written (the
    saver takes the step and epoch from them)."""
    implementation = STABILITY_AI_IMPLEMENTATION if ids.implementation == "diffusers" else ids.implementation
    spec = {**modelspec(cfg, ids, resolution, thumbnail),
            "modelspec.architecture": ids.architecture.removesuffix("/lora"),
            "modelspec.implementation": implementation}
    return Metadata({}, spec, cfg.save.metadata_title or cfg.save.output_name, False, kind="Checkpoint")


def thumbnail_data_url(value: str | None) -> str | None:
    """``--metadata_thumbnail``: a ``data:`` URL as given, else an image file read and converted to one.

    sd-scripts (``sai_model_spec.file_to_data_url``) guesses the MIME type from the file name (``mimetypes``,
    ``application/octet-stream`` when unknown) and base64-encodes the bytes. It skips a missing file with a
    warning; here that is an error before anything loads, so a typo does not silently lose the thumbnail.
    """
    if value is None or value.startswith("data:"):
        return value
    path = Path(value)
    if not path.is_file():
        raise UserError(f"--metadata_thumbnail {value}: no such file; give an image file or a data: URL")
    mime = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
    return f"data:{mime};base64,{base64.b64encode(path.read_bytes()).decode('ascii')}"


def legacy_file_hash(path: Path) -> str:
    """sd-scripts' ``train_util.model_hash`` (the old webui hash): the first 8 hex digits of the sha256 of the
    64 KiB at offset 1 MiB of the file (of fewer or no bytes when the file is shorter)."""
    with path.open("rb") as f:
        f.seek(0x100000)
        return hashlib.sha256(f.read(0x10000)).hexdigest()[:8]


def file_sha256(path: Path) -> str:
    """sd-scripts' ``train_util.calculate_sha256``: the sha256 of the whole file."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def model_identity(value: str, kind: str) -> dict[str, str]:
    """``ss_<kind>_name`` and, for a file, ``ss_<kind>_hash`` / ``ss_new_<kind>_hash`` (kind "sd_model" or "vae").

    As sd-scripts: an existing path is named by its last component and a file is hashed; anything else (here
    ``builtin:tiny-sd15``) is named as given. A folder gets no hashes: sd-scripts writes its error sentinel
    "IsADirectory" there, which says nothing about the model.
    """
    path = Path(value)
    if not path.exists():
        return {f"ss_{kind}_name": value}
    out = {f"ss_{kind}_name": path.name}
    if path.is_file():
        out[f"ss_{kind}_hash"] = legacy_file_hash(path)
        out[f"ss_new_{kind}_hash"] = file_sha256(path)
    return out


def _run_entries(cfg: TrainConfig, plan: StepPlan, ids: ModelIds, *, seed: int, stochastic_rounding: bool,
                 num_train_images: int, num_reg_images: int, started: float,
                 text_encoder_lr: float | list[float] | None) -> dict[str, str]:
    """The first half of sd-scripts' ``ss_*`` entries, in its order: the run, its schedule, precision and model."""
    m, d, o, sc, p = cfg.model, cfg.data, cfg.optimizer, cfg.schedule, cfg.precision
    return {
        "ss_session_id": _s(uuid.uuid4().int % 2**31),
        "ss_training_started_at": _s(started),
        "ss_output_name": _s(cfg.save.output_name),
        "ss_learning_rate": _s(o.learning_rate),
        "ss_text_encoder_lr": _s(text_encoder_lr),
        "ss_unet_lr": _s(o.unet_lr),
        "ss_num_train_images": _s(num_train_images),
        "ss_num_reg_images": _s(num_reg_images),
        "ss_num_batches_per_epoch": _s(plan.batches_per_process),  # sd-scripts: len() of the sharded loader
        "ss_num_epochs": _s(plan.num_epochs),
        "ss_gradient_checkpointing": _s(p.gradient_checkpointing),
        "ss_gradient_accumulation_steps": _s(sc.gradient_accumulation_steps),
        "ss_max_train_steps": _s(plan.max_train_steps),
        "ss_lr_warmup_steps": _s(sc.lr_warmup_steps),
        "ss_lr_scheduler": _s(sc.lr_scheduler),
        "ss_mixed_precision": _s(p.mixed_precision),
        "ss_full_fp16": _s(p.full_fp16),
        "ss_full_bf16": _s(p.full_bf16),
        "ss_stochastic_rounding": _s(stochastic_rounding),
        "ss_v2": _s(m.v2),
        "ss_base_model_version": ids.base_model_version,
        "ss_clip_skip": _s(m.clip_skip),
        "ss_max_token_length": _s(m.max_token_length),
        "ss_cache_latents": _s(d.cache_latents or d.cache_latents_to_disk),
        "ss_seed": _s(seed),
        "ss_lowram": _s(m.lowram),
    }


def _method_entries(cfg: TrainConfig, optimizer_name: str) -> dict[str, str]:
    """The second half of sd-scripts' ``ss_*`` entries, in its order: noise, optimizer, captions, loss, validation."""
    d, n, o, p, nz, lo = cfg.data, cfg.network, cfg.optimizer, cfg.precision, cfg.noise, cfg.loss
    return {
        "ss_noise_offset": _s(nz.noise_offset),
        "ss_multires_noise_iterations": _s(nz.multires_noise_iterations),
        "ss_multires_noise_discount": _s(nz.multires_noise_discount),
        "ss_adaptive_noise_scale": _s(nz.adaptive_noise_scale),
        "ss_zero_terminal_snr": _s(nz.zero_terminal_snr),
        "ss_training_comment": _s(cfg.save.training_comment),
        "ss_sd_scripts_commit_hash": PROJECT_VERSION,
        "ss_optimizer": optimizer_name,
        "ss_max_grad_norm": _s(o.max_grad_norm),
        "ss_caption_dropout_rate": _s(d.caption_dropout_rate),
        "ss_caption_dropout_every_n_epochs": _s(d.caption_dropout_every_n_epochs),
        "ss_caption_tag_dropout_rate": _s(d.caption_tag_dropout_rate),
        "ss_face_crop_aug_range": _s(d.face_crop_aug_range),
        "ss_prior_loss_weight": _s(d.prior_loss_weight),
        "ss_min_snr_gamma": _s(lo.min_snr_gamma),
        "ss_scale_weight_norms": _s(n.scale_weight_norms),
        "ss_ip_noise_gamma": _s(nz.ip_noise_gamma),
        "ss_debiased_estimation": _s(lo.debiased_estimation_loss),
        "ss_noise_offset_random_strength": _s(nz.noise_offset_random_strength),
        "ss_ip_noise_gamma_random_strength": _s(nz.ip_noise_gamma_random_strength),
        "ss_loss_type": _s(lo.loss_type),
        "ss_huber_schedule": _s(lo.huber_schedule),
        "ss_huber_scale": _s(lo.huber_scale),
        "ss_huber_c": _s(lo.huber_c),
        "ss_fp8_base": _s(p.fp8_base),
        "ss_fp8_base_unet": _s(p.fp8_base_unet),
        "ss_validation_seed": _s(d.validation_seed),
        "ss_validation_split": _s(d.validation_split),
        "ss_max_validation_steps": _s(cfg.validation.max_validation_steps),
        "ss_validate_every_n_epochs": _s(cfg.validation.validate_every_n_epochs),
        "ss_validate_every_n_steps": _s(cfg.validation.validate_every_n_steps),
        "ss_resize_interpolation": _s(d.resize_interpolation),
    }


def training_metadata(cfg: TrainConfig, plan: StepPlan, ids: ModelIds, *, seed: int, thumbnail: str | None,
                      dataset_meta: dict[str, str],
                      network_meta: dict[str, str], optimizer_name: str, stochastic_rounding: bool,
                      num_train_images: int, num_reg_images: int, resolution: tuple[int, int],
                      started: float, text_encoder_lr: float | list[float] | None = None,
                      family_meta: dict[str, str] | None = None) -> Metadata:
    """Everything sd-scripts writes at the start of training (``ss_steps``/``ss_epoch`` come at save time).

    ``ids`` are the model family's names of the base model (``ModelFamily.model_ids``). ``seed`` is the run's seed,
    also when it was drawn because ``--seed`` was not given (sd-scripts draws one and records it); ``thumbnail`` the
    ``--metadata_thumbnail`` data URL (``thumbnail_data_url``). Without ``--dataset_config``, ``ss_total_batch_size``
    = batch x processes x accumulation follows the flat dataset keys, as in sd-scripts. With several processes
    ``ss_num_batches_per_epoch`` is each process's share (sd-scripts writes the length of its accelerate-sharded
    loader), ``ss_num_epochs`` and ``ss_max_train_steps`` count updates, which every process makes together. The
    model (and ``--vae``) name and hashes: ``model_identity``.

    ``text_encoder_lr`` is the value the network was given (``network_setup.text_encoder_lr``), written as
    sd-scripts writes its ``text_encoder_lr``: ``str()`` of a number, of a list for a network given one value per
    text encoder, "None" when no ``--text_encoder_lr`` was given. Left out, it is the first ``--text_encoder_lr``
    value, what sd-scripts hands a network without ``prepare_optimizer_params_with_multiple_te_lrs``.
    ``family_meta``: the family's own keys (``ModelFamily.metadata``; FLUX.1's flow-matching settings).
    """
    m = cfg.model
    if text_encoder_lr is None and cfg.optimizer.text_encoder_lr:
        text_encoder_lr = cfg.optimizer.text_encoder_lr[0]
    meta = {
        **_run_entries(cfg, plan, ids, seed=seed, stochastic_rounding=stochastic_rounding,
                       num_train_images=num_train_images, num_reg_images=num_reg_images, started=started,
                       text_encoder_lr=text_encoder_lr),
        **_method_entries(cfg, optimizer_name),
        **dataset_meta,
        **network_meta,
        **(family_meta or {}),
    }
    if "ss_batch_size_per_device" in dataset_meta:
        meta["ss_total_batch_size"] = _s(plan.effective_batch_size)
    if m.pretrained_model_name_or_path is not None:
        meta.update(model_identity(m.pretrained_model_name_or_path, "sd_model"))
    if m.vae is not None:
        meta.update(model_identity(m.vae, "vae"))
    if cfg.save.no_metadata:
        meta = {k: v for k, v in meta.items() if k in MINIMAL_KEYS}
    spec = modelspec(cfg, ids, resolution, thumbnail)
    return Metadata(meta, spec, cfg.save.metadata_title or cfg.save.output_name, cfg.save.no_metadata)


def optimizer_description(optimizer: Any, options: dict[str, Any]) -> str:
    """``ss_optimizer``: "<module>.<Class>(k=v,...)" as sd-scripts writes it."""
    cls = type(optimizer)
    args = ",".join(f"{k}={v}" for k, v in options.items())
    return f"{cls.__module__}.{cls.__name__}" + (f"({args})" if args else "")
