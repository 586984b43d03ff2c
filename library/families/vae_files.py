"""``--vae``: replacing a loaded model's VAE, as sd-scripts' ``train_network.py`` and ``sdxl_train_network.py`` do
(``model_util.load_vae``): a diffusers VAE folder, or a single file in LDM names (bare or under
``first_stage_model.``) or diffusers names. SD 1.x/2.x and SDXL share the VAE layout; the architecture is taken from
the model's own VAE.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from library.base.errors import UserError
from library.families.ldm_layout import VAE_PREFIX
from library.families.model_files import SUFFIXES, fill_module, read_state_dict, under_prefix
from library.families.model_parts import freeze
from library.families.vae_keys import vae_from_ldm

if TYPE_CHECKING:
    from diffusers import AutoencoderKL


def load_vae_file(path: Path, like: AutoencoderKL) -> AutoencoderKL:
    """``--vae FILE``: a single-file VAE in LDM names (bare or under ``first_stage_model.``) or diffusers names,
    with the architecture of ``like`` (the model's own VAE)."""
    import torch
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKL

    if path.suffix.lower() not in SUFFIXES:
        raise UserError(f"--vae {path}: unknown file type {path.suffix!r}; give a .safetensors/.ckpt VAE or folder")
    state, _ = read_state_dict(path)
    if any(k.startswith(VAE_PREFIX) for k in state):
        state = under_prefix(state, VAE_PREFIX)
    with init_empty_weights():
        vae = AutoencoderKL.from_config(like.config)
    if not any(k.startswith("encoder.down_blocks.") for k in state):
        state = vae_from_ldm(state, vae)
    fill_module(vae, state, path, "VAE", torch.float32, model="an SD 1.x/2.x model",
                shape_hint="check --v2 / the model type")
    return vae


def replace_vae(model: Any, vae_path: str) -> None:
    """``--vae``: a diffusers VAE folder (config.json, or a pipeline folder with vae/) or a single-file VAE, frozen,
    in place of ``model.vae``."""
    from diffusers import AutoencoderKL

    path = Path(vae_path)
    if path.is_dir():
        subfolder = "vae" if (path / "vae" / "config.json").is_file() else None
        if subfolder is None and not (path / "config.json").is_file():
            raise UserError(f"--vae {path}: folder has neither config.json nor vae/config.json; give a diffusers VAE")
        vae = AutoencoderKL.from_pretrained(str(path), subfolder=subfolder, local_files_only=True)
    elif path.is_file():
        vae = load_vae_file(path, model.vae)
    else:
        raise UserError(f"--vae {path}: no such file or folder; give a diffusers VAE folder or a .safetensors VAE")
    freeze(vae)
    model.vae = vae

