"""``--fp8_base`` / ``--fp8_base_unet`` for FLUX.1: which parts are stored in ``float8_e4m3fn`` and how, as upstream
sd-scripts 48d368fa ``flux_train_network.py`` (``load_target_model``, ``prepare_text_encoder_fp8``) with
``train_network.py`` (the fp8 cast of the U-Net/DiT and the text encoders).

Upstream: ``--fp8_base_unet`` implies ``--fp8_base`` and keeps the text encoders in the mixed-precision dtype;
``--fp8_base`` alone also stores the text encoders in fp8. The transformer is cast whole (``model.to(e4m3fn)``):
every Linear weight and bias and the RMSNorm scales of the QK norms; its LayerNorms have no parameters, and there
are no embeddings or buffers to keep. CLIP-L is cast whole but its embeddings, which stay in the mixed dtype. T5-XXL
is cast but ``T5LayerNorm`` and ``Embedding`` (token and relative-position tables), and its gated MLP gets a forward
without transformers' cast of the hidden states to ``wo``'s dtype (which would round activations to fp8).

Compute: each Linear (and CLIP-L's LayerNorm) computes in the mixed dtype through ``library.families.fp8.store_fp8``
(the same values autocast gives upstream, since every e4m3fn number is exact in bf16, and the fp8 weight is what
backward keeps); RMSNorm already computes in float32 (``layers.RMSNorm``), so its fp8 scale needs nothing more. A
LoRA attached afterwards wraps the upcasting forward and keeps its own weights and math in its own dtype (bf16).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from library.families.fp8 import FP8, store_fp8


def fp8_parts(fp8_base: bool, fp8_base_unet: bool) -> tuple[bool, bool]:
    """(transformer in fp8, text encoders in fp8) for the two flags (upstream ``assert_extra_args`` and
    ``train_network.py``)."""
    return fp8_base or fp8_base_unet, fp8_base and not fp8_base_unet


def store_transformer_fp8(model: nn.Module, compute_dtype: torch.dtype) -> int:
    """Every floating parameter of the FLUX transformer in fp8, Linear layers computing in ``compute_dtype``;
    returns the number of Linear layers converted. Call it before the LoRA is attached and before block swap."""
    layers = store_fp8(model, compute_dtype)
    for param in model.parameters():
        if param.is_floating_point() and param.dtype != FP8:
            param.data = param.data.to(FP8)
    return layers


def store_clip_l_fp8(clip_l: nn.Module, compute_dtype: torch.dtype) -> int:
    """CLIP-L in fp8 but its embeddings (upstream ``prepare_text_encoder_fp8`` index 0)."""
    return store_fp8(clip_l, compute_dtype)


def _gated_forward(module: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """``T5DenseGatedActDense`` without the cast to ``wo``'s dtype (upstream's replacement forward)."""
    gated = module.act(module.wi_0(hidden_states)) * module.wi_1(hidden_states)
    return module.wo(module.dropout(gated))


def store_t5_fp8(t5xxl: nn.Module, compute_dtype: torch.dtype) -> int:
    """T5-XXL's Linear layers in fp8 (``T5LayerNorm`` and embeddings stay), the gated MLPs re-wired (upstream
    ``prepare_text_encoder_fp8`` index 1); returns the number of Linear layers converted."""
    layers = store_fp8(t5xxl, compute_dtype)
    for module in t5xxl.modules():
        if type(module).__name__ == "T5DenseGatedActDense":
            module.forward = partial(_gated_forward, module)
    return layers
