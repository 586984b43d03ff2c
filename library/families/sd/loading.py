"""Loading Stable Diffusion 1.x / 2.x models, always offline.

``load_sd_model`` accepts what sd-scripts' ``--pretrained_model_name_or_path`` accepts locally (a diffusers folder or a
single ``.safetensors`` / ``.ckpt`` file, as ``library/model_util.py`` ``load_models_from_stable_diffusion_checkpoint``
does) plus ``builtin:tiny-sd15``, the tiny model of ``library.tiny_model``. Hub ids are refused: nothing is
downloaded. The configs a single file needs are bundled in ``library/assets/configs/``, the CLIP tokenizer in
``library/assets/clip_tokenizer`` (pad ``<|endoftext|>`` for SD1.x; SD2.x overrides pad with ``!``).
"""

from __future__ import annotations

import json
from pathlib import Path

from library.base.errors import UserError
from library.families.ddpm_scheduler import build_noise_scheduler
from library.families.model_files import SUFFIXES, force_offline
from library.families.model_parts import config_dir, seeded
from library.families.sd import single_file
from library.families.sd.parts import SDModel, assemble, build_from_config, check_v2_flag
from library.families.vae_files import replace_vae

BUILTIN_TINY = "builtin:tiny-sd15"
# Built-in models: name -> bundled config. ``sd15-random`` is the real SD1.5 architecture with random weights,
# for memory and speed measurements at real scale without a download.
BUILTIN_MODELS = {BUILTIN_TINY: "tiny-sd15", "builtin:sd15-random": "sd15"}
ACCEPTED_FORMS = (
    f'{" or ".join(BUILTIN_MODELS)}, a diffusers folder (with model_index.json, unet/, vae/, text_encoder/, '
    "tokenizer/), "
    "or a single-file SD 1.x/2.x checkpoint (.safetensors, .ckpt, .pt)"
)


def build_builtin(name: str, seed: int = 0) -> SDModel:
    """A built-in model (``BUILTIN_MODELS``) with weights drawn from ``seed``; the caller's RNG is left untouched."""
    with seeded(seed):
        unet, vae, text_encoder = build_from_config(config_dir(BUILTIN_MODELS[name]), empty=False)
    return assemble(unet, vae, text_encoder, v2=False, v_parameterization=False, name=name)


def _from_pretrained(cls, path: Path, subfolder: str):
    """One part of a diffusers folder; a part whose config or weights cannot be read (damaged, truncated, missing)
    is a UserError naming which of the two it is."""
    def refused(exc: Exception, part: str) -> UserError:
        reason = str(exc).splitlines()[0]
        return UserError(f"--pretrained_model_name_or_path {path}: {subfolder}/ cannot be loaded ({reason}); its "
                         f"{part} damaged, truncated or missing (an interrupted download or copy?): copy the folder "
                         "again")

    try:
        json.loads((path / subfolder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise refused(exc, "config.json is") from None
    try:
        return cls.from_pretrained(str(path), subfolder=subfolder, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise refused(exc, "weights are") from None


def _load_diffusers_folder(path: Path, *, v2: bool, v_parameterization: bool) -> SDModel:
    """A diffusers pipeline folder, read like ``StableDiffusionPipeline.from_pretrained`` reads its parts."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextModel

    from library.families.tokenizers import CleanCLIPTokenizer

    missing = [sub for sub in ("unet", "vae", "text_encoder") if not (path / sub).is_dir()]
    if missing:
        raise UserError(
            f"--pretrained_model_name_or_path {path}: diffusers folder lacks {', '.join(missing)}/; "
            f"point it at a complete pipeline folder, or use {ACCEPTED_FORMS}"
        )
    unet = _from_pretrained(UNet2DConditionModel, path, "unet")
    vae = _from_pretrained(AutoencoderKL, path, "vae")
    text_encoder = _from_pretrained(CLIPTextModel, path, "text_encoder")
    folder_is_v2 = text_encoder.config.hidden_size == 1024
    check_v2_flag(path, file_is_v2=folder_is_v2, v2=v2)
    tokenizer = None
    if (path / "tokenizer").is_dir():
        tokenizer = CleanCLIPTokenizer.from_pretrained(str(path), subfolder="tokenizer", local_files_only=True)
    return assemble(
        unet, vae, text_encoder, v2=v2, v_parameterization=v_parameterization, name=str(path), tokenizer=tokenizer
    )


def load_sd_model(
    path: str, *, v2: bool = False, v_parameterization: bool = False, vae: str | None = None,
    file_device: str = "cpu",
) -> SDModel:
    """Load an SD 1.x / 2.x model for LoRA training, offline.

    ``path`` is ``builtin:tiny-sd15``, a diffusers folder, or a single-file checkpoint. ``v2`` must match the
    model (sd-scripts' ``--v2``); ``vae`` replaces the VAE (sd-scripts' ``--vae``). A single-file checkpoint is
    read onto ``file_device`` (``--lowram``); the other forms load in CPU memory. Raises ``UserError`` for a
    missing path, an unknown file type, or an SD2 model without ``--v2``.
    """
    force_offline()
    if path in BUILTIN_MODELS:
        if v2:
            raise UserError(f"{path} is an SD 1.x-shaped model; remove --v2")
        model = build_builtin(path)
        model.v_parameterization = v_parameterization
        model.noise_scheduler = build_noise_scheduler(v_parameterization)
    else:
        model = _load_path(Path(path), v2=v2, v_parameterization=v_parameterization, file_device=file_device)
    if vae is not None:
        replace_vae(model, vae)
    return model


def _load_path(path: Path, *, v2: bool, v_parameterization: bool, file_device: str) -> SDModel:
    if path.is_dir():
        if not (path / "model_index.json").is_file():
            raise UserError(
                f"--pretrained_model_name_or_path {path}: folder has no model_index.json, so it is not a diffusers "
                f"pipeline; accepted: {ACCEPTED_FORMS}"
            )
        return _load_diffusers_folder(path, v2=v2, v_parameterization=v_parameterization)
    if path.is_file():
        if path.suffix.lower() not in SUFFIXES:
            raise UserError(
                f"--pretrained_model_name_or_path {path}: unknown file type {path.suffix!r}; "
                f"accepted: {ACCEPTED_FORMS}"
            )
        return single_file.load_checkpoint(path, v2=v2, v_parameterization=v_parameterization, device=file_device)
    hint = " (hub ids are not downloaded: give a local copy)" if "/" in str(path) and not path.parent.exists() else ""
    raise UserError(
        f"--pretrained_model_name_or_path {path}: no such file or folder{hint}; accepted: {ACCEPTED_FORMS}"
    )


