"""``builtin:tiny-anima`` (``builtin.py``) as the files Anima users have: ``python -m library.tiny_model --anima
OUT_DIR`` writes ``anima.safetensors`` (the DiT with upstream's ``net.`` keys, its config in the metadata),
``qwen3/`` (a Hugging Face Qwen3 folder, what ``--qwen3`` takes) and ``qwen_image_vae.safetensors`` (the VAE in
the file's names), the files ``anima_train_network.py`` takes.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from library.families.model_files import CONFIG_METADATA_KEY, force_offline

ANIMA_FILES = ("anima.safetensors", "qwen3", "qwen_image_vae.safetensors")


def write_tiny_anima(out_dir: Path) -> None:
    """Write ``builtin:tiny-anima`` as ``ANIMA_FILES`` in ``out_dir``."""
    from safetensors.torch import save_file

    from library.families.anima.builtin import build_tiny_parts
    from library.families.anima.vae import save_vae

    force_offline()
    dit, qwen3, vae = build_tiny_parts()
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {f"net.{key}": value.detach().contiguous() for key, value in dit.state_dict().items()}
    save_file(state, str(out_dir / ANIMA_FILES[0]), metadata={CONFIG_METADATA_KEY: json.dumps(asdict(dit.params))})
    qwen3.save_pretrained(str(out_dir / ANIMA_FILES[1]))
    save_vae(vae, out_dir / ANIMA_FILES[2])


def write_tiny_files(out_dir: Path) -> str:
    """``python -m library.tiny_model --anima OUT_DIR``: what ``write_tiny_anima`` wrote."""
    write_tiny_anima(out_dir)
    return ", ".join(str(out_dir / name) for name in ANIMA_FILES)
