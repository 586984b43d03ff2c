"""``--fp8_base`` / ``--fp8_base_unet`` for FLUX.1: which parts are stored in ``float8_e4m3fn`` and how, as upstream
sd-scripts 48d368fa ``flux_train_network.py`` (``load_target_model``, ``prepare_text_encoder_fp8``) with
``train_network.py`` (the fp8 cast of the U-Net/DiT and the text encoders).

Upstream: ``--fp8_base_unet`` implies ``--fp8_base`` and keeps the text encoders in the mixed-precision dtype;
``--fp8_base`` alone also stores the text encoders in fp8. The transformer is cast whole (``model.to(e4m3fn)``):
every Linear weight and bias and the RMSNorm scales of the QK norms; its LayerNorms have no parameters, and there
are no embeddings or buffers to keep. CLIP-L is cast whole, then its embeddings back to the mixed dtype. T5-XXL is
cast whole (from the dtype of its file), then ``T5LayerNorm`` and ``Embedding`` (token and relative-position tables)
back to the mixed dtype, and its gated MLP gets a forward without transformers' cast of the hidden states to ``wo``'s
dtype (which would round activations to fp8). What goes back holds fp8 values, as upstream's.

Which text encoders: without ``--cache_text_encoder_outputs`` both; with it upstream caches with CLIP-L in the mixed
dtype and T5-XXL as its file stores it, then moves both to the CPU, where the fp8 cast skips them
(``FluxFamily.fp8_text_encoders``): only a T5-XXL file in fp8 gives an fp8 encoder there.

Compute: each Linear (and CLIP-L's LayerNorm) computes in the mixed dtype through ``library.families.fp8.store_fp8``
(the same values autocast gives upstream, since every e4m3fn number is exact in bf16, and the fp8 weight is what
backward keeps); RMSNorm already computes in float32 (``layers.RMSNorm``), so its fp8 scale needs nothing more. A
LoRA attached afterwards wraps the upcasting forward and keeps its own weights and math in its own dtype (bf16).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from library.families.fp8 import FP8, UPCAST_FORWARDS, store_fp8


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


def text_encoder_kind(text_encoder: nn.Module) -> str:
    """"t5" for T5-XXL (transformers' ``T5EncoderModel``), "clip" otherwise."""
    return "t5" if type(text_encoder).__name__ == "T5EncoderModel" else "clip"


def t5_weight_dtype(t5xxl: nn.Module) -> torch.dtype:
    """The dtype of T5-XXL's Linear weights: its first attention query's (upstream ``flux_utils.
    get_t5xxl_actual_dtype``; embeddings may be stored otherwise)."""
    return t5xxl.encoder.block[0].layer[0].SelfAttention.q.weight.dtype


def _rest_through_fp8(root: nn.Module, compute_dtype: torch.dtype) -> None:
    """The floating parameters ``store_fp8`` left (embeddings, ``T5LayerNorm``) rounded to fp8 and kept in
    ``compute_dtype``: upstream casts the whole encoder to fp8 first and only then these back to the mixed dtype."""
    for module in root.modules():
        if type(module) in UPCAST_FORWARDS:
            continue
        for param in module.parameters(recurse=False):
            if param.is_floating_point():
                param.data = param.data.to(FP8).to(compute_dtype)


def store_clip_l_fp8(clip_l: nn.Module, compute_dtype: torch.dtype) -> int:
    """CLIP-L in fp8 but its embeddings, which hold fp8 values in ``compute_dtype`` (upstream
    ``prepare_text_encoder_fp8`` index 0 after ``train_network.py``'s ``t_enc.to(float8_e4m3fn)``)."""
    layers = store_fp8(clip_l, compute_dtype)
    _rest_through_fp8(clip_l, compute_dtype)
    return layers


def _gated_forward(module: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """``T5DenseGatedActDense`` without the cast to ``wo``'s dtype (upstream's replacement forward)."""
    gated = module.act(module.wi_0(hidden_states)) * module.wi_1(hidden_states)
    return module.wo(module.dropout(gated))


def store_t5_fp8(t5xxl: nn.Module, compute_dtype: torch.dtype) -> int:
    """T5-XXL's Linear layers in fp8 (``T5LayerNorm`` and embeddings hold fp8 values in ``compute_dtype``), the
    gated MLPs re-wired (upstream ``prepare_text_encoder_fp8`` index 1); returns the number of Linear layers
    converted. The weights are rounded to fp8 from the dtype they have (``FluxFamily.place_text_encoder`` keeps its
    file's)."""
    layers = store_fp8(t5xxl, compute_dtype)
    _rest_through_fp8(t5xxl, compute_dtype)
    for module in t5xxl.modules():
        if type(module).__name__ == "T5DenseGatedActDense":
            module.forward = partial(_gated_forward, module)
    return layers
