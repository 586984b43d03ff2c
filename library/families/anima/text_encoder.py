"""Anima's text encoder: Qwen3-0.6B as transformers' own ``Qwen3Model`` (the decoder without its LM head).

Upstream sd-scripts 48d368fa ``library/anima_utils.py`` ``load_qwen3_text_encoder``: a folder is a Hugging Face
checkpoint (``AutoModelForCausalLM.from_pretrained(...).model``); any other path is one weights file (safetensors,
else a ``torch.load`` pickle) for the bundled config (``configs/qwen3_06b/config.json``, here
``library/assets/configs/anima/qwen3_06b.json``: width 1024, 28 layers, 16 query and 8 key/value heads of 128,
MLP 3072, RMS eps 1e-6, RoPE theta 1e6, vocabulary 151,936, 596,049,920 parameters), a leading ``model.`` cut off
its keys and loaded non-strictly: ``lm_head.weight`` and whatever else the file holds beyond the decoder is
ignored, as upstream does; a weight the file lacks, which upstream only logs and leaves randomly initialised, is
refused here (``ValueError``). The model is frozen, without KV cache, in the run's weight dtype.

``tiny_qwen3`` is the same class at width 24 (``tiny_qwen3.json``: two layers, 2 query heads and 1 key/value head of
12, the real vocabulary so the real tokenizer feeds it), with seeded random weights, for tests; its width is
``params.TINY``'s ``text_dim``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import Qwen3Config, Qwen3Model

logger = logging.getLogger(__name__)

CONFIGS = Path(__file__).resolve().parents[2] / "assets" / "configs" / "anima"
QWEN3_CONFIG = CONFIGS / "qwen3_06b.json"
TINY_QWEN3_CONFIG = CONFIGS / "tiny_qwen3.json"
PREFIX = "model."


def qwen3_config(path: str | Path = QWEN3_CONFIG) -> Qwen3Config:
    """A Qwen3 config json (default: the bundled Qwen3-0.6B one)."""
    from transformers import Qwen3Config

    return Qwen3Config.from_json_file(str(path))


def _finish(model: Qwen3Model, dtype: torch.dtype | None, device: torch.device | str) -> Qwen3Model:
    """Upstream's last steps: no KV cache, frozen, on ``device`` in ``dtype``."""
    model.config.use_cache = False
    model.requires_grad_(False)
    return model.to(device=device, dtype=dtype)


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """A weights file's tensors (safetensors by suffix, else a weights-only pickle) with ``model.`` cut off the
    keys that start with it."""
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(path), device="cpu")
    else:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    return {key.removeprefix(PREFIX): value for key, value in state.items()}


def load_qwen3(path: str | Path, dtype: torch.dtype | None = torch.bfloat16, device: torch.device | str = "cpu",
               config: str | Path = QWEN3_CONFIG) -> Qwen3Model:
    """Qwen3 from a Hugging Face folder or from one weights file with ``config`` (upstream's
    ``load_qwen3_text_encoder``, see the module docstring)."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if path.is_dir():
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True).model
        return _finish(model, dtype, device)
    if not path.is_file():
        raise FileNotFoundError(f"Qwen3 text encoder {path} is neither a folder nor a file")
    model = _empty_qwen3(qwen3_config(config))
    state = read_state_dict(path)
    own = model.state_dict()
    # upstream loads non-strictly: extra keys (``lm_head.weight``) are skipped; keys of other shapes still fail
    ignored = sorted(set(state) - set(own))
    if ignored:
        logger.info("Qwen3 %s: ignored %d keys not in the model: %s", path.name, len(ignored), ignored[:8])
    missing = sorted(set(own) - set(state))
    if missing:  # upstream would keep random weights for these: refused here
        raise ValueError(f"Qwen3 file {path} lacks {len(missing)} weights of the model: {missing[:8]}")
    model.load_state_dict({k: state[k] for k in own}, strict=True, assign=True)
    return _finish(model, dtype, device)


def _empty_qwen3(config: Qwen3Config) -> Qwen3Model:
    """``Qwen3Model(config)`` without allocating or initialising its weights (they are all loaded next); the
    rotary frequencies, computed rather than loaded, are built on the CPU."""
    from transformers import Qwen3Model
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    with torch.device("meta"):
        model = Qwen3Model(config)
    model.rotary_emb = Qwen3RotaryEmbedding(config=config)
    return model


def tiny_qwen3(seed: int = 0, config: str | Path = TINY_QWEN3_CONFIG, layers: int | None = None) -> Qwen3Model:
    """A random Qwen3 of ``config`` (default the tiny one, see the module docstring; ``layers``: that many layers
    instead of the config's), fp32, frozen; the global RNG is left untouched."""
    from transformers import Qwen3Model

    settings = qwen3_config(config)
    if layers is not None:
        settings.num_hidden_layers = layers
        settings.layer_types = settings.layer_types[:layers] if settings.layer_types else None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3Model(settings)
    return _finish(model.eval(), torch.float32, "cpu")
