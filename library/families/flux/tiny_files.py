"""``builtin:tiny-flux`` (``builtin.py``) as the four files FLUX.1 users have: ``python -m library.tiny_model --flux
OUT_DIR`` writes ``flux1-dev.safetensors`` (BFL names), ``clip_l.safetensors``, ``t5xxl.safetensors`` and
``ae.safetensors`` (BFL names), the files ``flux_train_network.py`` takes.
"""

from __future__ import annotations

from pathlib import Path

from library.families.model_files import force_offline

FLUX_FILES = ("flux1-dev.safetensors", "clip_l.safetensors", "t5xxl.safetensors", "ae.safetensors")


def write_tiny_flux(out_dir: Path, seed: int = 0):
    """Write ``builtin:tiny-flux`` as the four files FLUX users have (``FLUX_FILES``: BFL transformer, CLIP-L,
    T5-XXL, BFL AE), for ``--pretrained_model_name_or_path``, ``--clip_l``, ``--t5xxl`` and ``--ae``."""
    from library.families.flux.builtin import BUILTIN_TINY_FLUX, build_builtin_flux
    from library.families.flux.checkpoints import save_transformer
    from library.families.flux.part_files import save_ae, save_clip_l, save_t5xxl

    force_offline()
    model = build_builtin_flux(BUILTIN_TINY_FLUX, seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    transformer, clip_l, t5xxl, ae = (out_dir / name for name in FLUX_FILES)
    save_transformer(model.unet, transformer)
    save_clip_l(model.clip_l, clip_l)
    save_t5xxl(model.t5xxl, t5xxl)
    save_ae(model.vae, ae)
    return model


def write_tiny_files(out_dir: Path) -> str:
    """``python -m library.tiny_model --flux OUT_DIR``: what ``write_tiny_flux`` wrote."""
    write_tiny_flux(out_dir)
    return ", ".join(str(out_dir / name) for name in FLUX_FILES)
