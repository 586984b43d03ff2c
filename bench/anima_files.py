"""Anima at reduced depth as the three parts Anima users have, for the benchmarks that run our trainers and
upstream sd-scripts' on the same files (``bench/anima_vs_upstream.py``, ``bench/gpu_anima.py``).

``write_anima_files(folder, blocks, qwen3_layers)`` writes, with random weights from fixed seeds:

- ``anima.safetensors``: the DiT at the real widths (``params.ANIMA``: 2048 wide, 16 heads of 128, MLP 8192,
  adaLN-LoRA 256, the real LLM adapter of 6 blocks over 1024-wide text with T5's 32,128-id vocabulary) with
  ``blocks`` blocks instead of 28, bf16, keys with upstream's ``net.`` prefix (upstream 48d368fa
  ``anima_utils.save_anima_model``'s layout); the config in our metadata key, which our loader reads and upstream's
  ignores (it builds 28 blocks whatever the file holds: ``patches/harness/upstream_anima_env.fit_dit_blocks``
  makes it build the file's count in its bench children).
- ``qwen3/``: a Hugging Face Qwen3 folder (``config.json``, ``model.safetensors``, the bundled Qwen3 tokenizer) at
  Qwen3-0.6B's widths (the bundled ``qwen3_06b.json``: 1024 wide, 16/8 heads of 128, MLP 3072, the real 151,936
  vocabulary) with ``qwen3_layers`` layers; the config in the transformers 4.51 format of the real checkpoint, so
  upstream's transformers 4 and our transformers 5 read the same model (both load a folder with
  ``AutoModelForCausalLM.from_pretrained(...).model``, upstream's ``anima_utils.load_qwen3_text_encoder``).
- ``qwen_image_vae.safetensors``: the Qwen-Image VAE at its real config (``vae.REAL_CONFIG``, 126.9 M parameters,
  what upstream's ``qwen_image_autoencoder_kl.load_vae`` builds) in the ComfyUI names (``vae.save_vae``), bf16.

``tiny=True`` (the GPU script's dry run): the same files at ``builtin:tiny-anima``'s widths (``builtin.TINY_BUILTIN``
with ``blocks`` blocks, the tiny Qwen3 config with ``qwen3_layers`` layers, ``vae.TINY_CONFIG``).

Files already in ``folder`` are kept when its ``bench-spec.json`` records the same arguments.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path

FILES = {"dit": "anima.safetensors", "qwen3": "qwen3", "vae": "qwen_image_vae.safetensors"}
SPEC = "bench-spec.json"


def model_label(blocks: int, qwen3_layers: int, tiny: bool = False) -> str:
    """How the results name the model: its widths and depths."""
    widths = "tiny-anima widths" if tiny else "Anima widths (2048, 16 heads, real LLM adapter), Qwen3-0.6B widths"
    return f"{widths}, {blocks} DiT block(s), {qwen3_layers} Qwen3 layer(s), random weights"


def write_anima_files(folder: Path, blocks: int, qwen3_layers: int, tiny: bool = False) -> dict[str, Path]:
    """Write (or keep) the three parts in ``folder``; their paths by ``FILES``' keys. The modules are the built-in
    ``builtin:anima-random`` / ``builtin:tiny-anima`` at that depth (``library/families/anima/builtin.py``)."""
    from library.families.anima.builtin import build_builtin_parts

    paths = {part: folder / name for part, name in FILES.items()}
    spec = {"blocks": blocks, "qwen3_layers": qwen3_layers, "tiny": tiny}
    marker = folder / SPEC
    if marker.is_file() and json.loads(marker.read_text()) == spec and all(p.exists() for p in paths.values()):
        return paths
    folder.mkdir(parents=True, exist_ok=True)
    name = "builtin:tiny-anima" if tiny else "builtin:anima-random"
    dit, qwen3, vae = build_builtin_parts(f"{name}:blocks={blocks},qwen3_layers={qwen3_layers}")
    _write_dit(paths["dit"], dit)
    _write_qwen3(paths["qwen3"], qwen3, qwen3_layers, tiny)
    _write_vae(paths["vae"], vae)
    marker.write_text(json.dumps(spec))
    return paths


def _write_dit(path: Path, dit) -> None:
    import torch
    from safetensors.torch import save_file

    from library.families.model_files import CONFIG_METADATA_KEY

    state = {f"net.{key}": value.detach().to(torch.bfloat16).contiguous() for key, value in dit.state_dict().items()}
    save_file(state, str(path), metadata={CONFIG_METADATA_KEY: json.dumps(asdict(dit.params))})


def _write_qwen3(folder: Path, model, layers: int, tiny: bool) -> None:
    """A Hugging Face folder: the bundled config (transformers 4.51's format, which upstream's transformers 4 and our
    5 both read) at ``layers`` layers, the weights under ``model.``, the bundled tokenizer."""
    import torch
    from safetensors.torch import save_file

    from library.families.anima.text_encoder import QWEN3_CONFIG, TINY_QWEN3_CONFIG
    from library.families.anima.text_encoding import QWEN3_TOKENIZER

    config = json.loads((TINY_QWEN3_CONFIG if tiny else QWEN3_CONFIG).read_text())
    config.update(num_hidden_layers=layers, max_window_layers=layers)
    if folder.exists():
        shutil.rmtree(folder)
    shutil.copytree(QWEN3_TOKENIZER, folder, ignore=shutil.ignore_patterns("README.md"))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    state = {f"model.{key}": value.detach().to(torch.bfloat16).contiguous()
             for key, value in model.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _write_vae(path: Path, vae) -> None:
    import torch

    from library.families.anima.vae import save_vae

    save_vae(vae.to(torch.bfloat16), path)
