"""Loading a whole Anima offline, as upstream sd-scripts 48d368fa ``AnimaNetworkTrainer.load_target_model`` /
``load_unet_lazily`` take the files: the DiT (``--pretrained_model_name_or_path``, one file with ``net.`` keys and the
LLM adapter inside; ``anima_utils.load_anima_model``), Qwen3 (``--qwen3``), the VAE (``--vae``, with
``--vae_chunk_size`` / ``--vae_disable_cache``), the T5 tokenizer (``--t5_tokenizer_path``, else the bundled one).
``builtin:tiny-anima`` and ``builtin:anima-random`` (``builtin.py``) supply all three parts; a file given for
Qwen3 or the VAE replaces that part.

The DiT's config is upstream's fixed one (``params.ANIMA``) unless the file is ours and records another in its
metadata (``tiny_files.py``). As upstream: the RoPE buffers may be absent from the file, any other missing or
unexpected key is an error (``UserError`` here, ``RuntimeError`` upstream).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from library.base.errors import UserError
from library.families.anima.builtin import BUILTIN_TINY_ANIMA, AnimaModel, AnimaVAE, build_builtin_parts
from library.families.anima.layers import VideoRopePosition3DEmb
from library.families.anima.model import AnimaTransformer
from library.families.anima.params import ANIMA, AnimaParams
from library.families.model_files import CONFIG_METADATA_KEY, fill_module, force_offline, read_state_dict

PREFIX = "net."


def _params(metadata: dict[str, str]) -> AnimaParams:
    stored = metadata.get(CONFIG_METADATA_KEY)
    if stored is None:
        return ANIMA
    known = set(asdict(ANIMA))
    return AnimaParams(**{k: v for k, v in json.loads(stored).items() if k in known})


def _computed_buffers(params: AnimaParams) -> dict[str, torch.Tensor]:
    """The RoPE buffers upstream's loader tolerates missing (``pos_embedder.*``), computed as the model does."""
    ratios = (params.rope_h_extrapolation_ratio, params.rope_w_extrapolation_ratio, params.rope_t_extrapolation_ratio)
    rope = VideoRopePosition3DEmb(params.head_dim, params.rope_lengths, ratios)
    return {f"pos_embedder.{name}": value for name, value in rope.state_dict().items()}


def load_dit(path: str | Path, dtype: torch.dtype | None, device: str = "cpu", mmap: bool = True) -> AnimaTransformer:
    """The DiT of an Anima file (see the module docstring), frozen, in ``dtype`` (None: as stored)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"--pretrained_model_name_or_path {path}: no such file (give the Anima DiT .safetensors, "
                        f"or {BUILTIN_TINY_ANIMA})")
    state, metadata = read_state_dict(path, "cpu", mmap=mmap)
    state = {key.removeprefix(PREFIX): value for key, value in state.items()}
    params = _params(metadata)
    with torch.device("meta"):
        dit = AnimaTransformer(params)
    for key, value in _computed_buffers(params).items():
        state.setdefault(key, value)
    unexpected = sorted(set(state) - set(dit.state_dict()))
    if unexpected:
        raise UserError(f"{path}: {len(unexpected)} tensors that are not Anima DiT weights (e.g. {unexpected[0]}); "
                        "the file is not an Anima DiT (upstream refuses it too)")
    fill_module(dit, state, path, "DiT", dtype, model="an Anima DiT with its LLM adapter (anima-preview)",
                shape_hint="the file is another DiT than Anima's 28-block, 2048-wide one")
    adapter = dit.llm_adapter
    head_dim = params.crossattn_emb_channels // params.adapter_heads
    adapter.rotary_emb.inv_freq = 1.0 / (10000 ** ((2 * torch.arange(head_dim // 2)).float() / head_dim))
    return dit.to(device).requires_grad_(False)


def _vae_options(vae: Any, section: Any) -> Any:
    from library.families.anima.vae import disable_feature_cache, set_spatial_chunking

    size = section.vae_chunk_size
    if size is not None and size > 0:
        set_spatial_chunking(vae, size + size % 2)
    if section.vae_disable_cache:
        disable_feature_cache(vae)
    return vae


def _has_tokenizer(path: Path) -> bool:
    """A Qwen3 folder with its tokenizer (else the bundled one is used, as upstream for a weights file)."""
    return path.is_dir() and any((path / name).is_file() for name in ("tokenizer.json", "vocab.json"))


def load_anima_model(path: str, vae_path: str | None, section: Any, dtype: torch.dtype | None,
                     device: str = "cpu") -> AnimaModel:
    """The DiT, Qwen3 and VAE with both tokenizers (``section``: the run's ``AnimaConfig``)."""
    from library.families.anima.text_encoder import load_qwen3
    from library.families.anima.text_encoding import load_qwen3_tokenizer, load_t5_tokenizer
    from library.families.anima.vae import load_vae

    force_offline()
    mmap = not section.disable_mmap_load_safetensors
    if path.startswith("builtin:"):
        dit, qwen3, vae = build_builtin_parts(path)
    else:
        dit, qwen3, vae = load_dit(path, dtype, device, mmap), None, None
    if section.qwen3:
        qwen3 = load_qwen3(section.qwen3, dtype=dtype, device=device)
    if vae_path:
        vae = load_vae(vae_path, dtype=dtype, device=device, mmap=mmap)
    if qwen3 is None or vae is None:
        raise UserError(f"{path}: give the Qwen3 text encoder (--qwen3) and the VAE (--vae)")
    _vae_options(vae, section)
    folder = section.qwen3 if section.qwen3 and _has_tokenizer(Path(section.qwen3)) else None
    return AnimaModel(unet=dit, qwen3=qwen3, vae=AnimaVAE(vae), qwen3_tokenizer=load_qwen3_tokenizer(folder),
                      t5_tokenizer=load_t5_tokenizer(section.t5_tokenizer_path), name=path,
                      qwen3_max_length=section.qwen3_max_token_length, t5_max_length=section.t5_max_token_length)
