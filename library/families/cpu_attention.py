"""The UNet's attention when training on the CPU: PyTorch's scaled-dot-product attention for long key sequences,
diffusers' classic ``baddbmm`` + softmax attention (sd-scripts' default) for short ones.

On the CPU, SDPA's flash kernel wins where there are many keys (the 32x32-latent self-attention at 256 px: 35 ms
against 50 ms forward and backward in bf16, one thread) but loses where there are few (cross-attention over 77
tokens, the 16x16 and smaller self-attentions: 3.8 against 6.5 ms, 3.1 against 4.9 ms). Picking per call by the key
length took a SD1.5 UNet step (256 px, batch 1, bf16, forward and backward) from 2.24-2.29 s to 2.19-2.24 s here.
On CUDA every length goes to SDPA (``library/families/model_setup.set_attention``), and so do a compiled UNet and
fp16 (whose classic attention scores overflow where SDPA's, accumulated in fp32, do not).
"""

from __future__ import annotations

import torch
from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0

LONG_KEYS = 256  # more keys than this: SDPA (the 16x16 self-attention has 256 and is faster the classic way)


class CPUAttention:
    """A diffusers attention processor choosing per call: SDPA above ``LONG_KEYS`` keys, classic below."""

    def __init__(self, long_keys: int = LONG_KEYS) -> None:
        self.long_keys = long_keys
        self.short, self.long = AttnProcessor(), AttnProcessor2_0()

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, temb: torch.Tensor | None = None) -> torch.Tensor:
        keys = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        length = keys.shape[1] if keys.ndim == 3 else keys.shape[2] * keys.shape[3]
        # compiled (--torch_compile): always SDPA, since a choice by a dynamic bucket size would add a guard and a
        # recompile per side of the threshold; fp16 too
        compiling = torch.compiler.is_compiling()
        half = hidden_states.dtype == torch.float16  # the classic path's fp16 scores can overflow; SDPA's cannot
        chosen = self.long if compiling or half or length > self.long_keys else self.short
        return chosen(attn, hidden_states, encoder_hidden_states, attention_mask, temb)
