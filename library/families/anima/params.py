"""The Anima DiT's configuration (``AnimaParams``): the fixed one upstream sd-scripts 48d368fa loads every checkpoint
with (``library/anima_utils.py`` ``load_anima_model``'s ``dit_config``, the DiT ``anima_models.Anima`` and the
``LLMAdapter`` it builds inside, ``ANIMA``), and a tiny one with every module kind (``TINY``).

What upstream's config fixes and this dataclass therefore does not carry: ``concat_padding_mask`` (the padding mask
is a 17th input channel), ``pos_emb_cls="rope3d"`` without fps modulation, ``use_adaln_lora``,
``extra_per_block_abs_pos_emb=False`` and ``use_llm_adapter`` (the adapter's self-attention on, RMSNorm variant,
in/out width equal to the cross-attention width, so its ``in_proj`` is the identity).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AnimaParams:
    """Widths and depths of the DiT and of its LLM adapter. Defaults are upstream's real model (``ANIMA``): 28
    blocks of width 2048 (16 heads of 128, MLP 8192), adaLN-LoRA rank 256, 16 latent channels in 2x2x1 patches,
    cross-attention over 1024-wide adapter outputs; the adapter maps Qwen3-0.6B states (1024) with T5 token ids
    (vocabulary 32128) through 6 blocks of 16 heads of 64."""

    in_channels: int = 16
    out_channels: int = 16
    patch_spatial: int = 2
    patch_temporal: int = 1
    model_channels: int = 2048
    num_blocks: int = 28
    num_heads: int = 16
    mlp_ratio: float = 4.0
    crossattn_emb_channels: int = 1024
    adaln_lora_dim: int = 256
    max_img_h: int = 512
    max_img_w: int = 512
    max_frames: int = 128
    rope_h_extrapolation_ratio: float = 4.0
    rope_w_extrapolation_ratio: float = 4.0
    rope_t_extrapolation_ratio: float = 1.0
    text_dim: int = 1024
    adapter_layers: int = 6
    adapter_heads: int = 16
    adapter_vocab: int = 32128
    adapter_mlp_ratio: float = 4.0

    @property
    def head_dim(self) -> int:
        return self.model_channels // self.num_heads

    @property
    def mlp_hidden_dim(self) -> int:
        return int(self.model_channels * self.mlp_ratio)

    @property
    def patch_dim(self) -> int:
        """Inputs of ``x_embedder``: the latent channels plus the padding mask's, times the patch volume."""
        return (self.in_channels + 1) * self.patch_spatial**2 * self.patch_temporal

    @property
    def rope_lengths(self) -> tuple[int, int, int]:
        """Largest token grid (height, width, frames) the position embedding covers."""
        return (self.max_img_h // self.patch_spatial, self.max_img_w // self.patch_spatial,
                self.max_frames // self.patch_temporal)

    def check(self) -> None:
        """Raise ``ValueError`` for widths the model cannot be built with."""
        if self.model_channels % self.num_heads:
            raise ValueError(f"model_channels {self.model_channels} is not divisible by num_heads {self.num_heads}")
        if self.head_dim // 6 * 2 <= 2:
            raise ValueError(f"head dim {self.head_dim} leaves the spatial RoPE axes no room (at least 12)")
        if self.crossattn_emb_channels % self.adapter_heads:
            raise ValueError(f"adapter width {self.crossattn_emb_channels} is not divisible by {self.adapter_heads}")


ANIMA = AnimaParams()
# every module kind at tiny widths: head dim 16 (RoPE t/h/w 8/4/4), two blocks, a two-block adapter of two heads
# over 24-wide text states, a 64-token vocabulary
TINY = AnimaParams(model_channels=32, num_blocks=2, num_heads=2, crossattn_emb_channels=32, adaln_lora_dim=8,
                   max_img_h=32, max_img_w=32, max_frames=8, text_dim=24, adapter_layers=2, adapter_heads=2,
                   adapter_vocab=64)
