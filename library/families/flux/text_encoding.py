"""FLUX.1's text conditioning: CLIP-L's pooled output and T5-XXL's hidden states, with T5's attention mask.

Upstream sd-scripts' ``strategy_flux.FluxTokenizeStrategy`` / ``FluxTextEncodingStrategy``: CLIP-L tokens padded or
cut to 77, its ``pooler_output`` (the vector input ``y``); T5 tokens padded or cut to ``--t5xxl_max_token_length``
(512 for dev, 256 for schnell by default), its last hidden state (the text tokens ``txt``), their position ids
(zeros) and the attention mask, which masks T5's padding in its own attention and in the transformer's only with
``--apply_t5_attn_mask``. The model bundle (``parts.FluxModel``) carries the run's two settings (``t5_max_length``,
``apply_t5_attn_mask``), so that the family object stays stateless.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from library.base.devices import to_device
from library.families.flux.flow import text_ids

CLIP_LENGTH = 77
DEV_T5_LENGTH, SCHNELL_T5_LENGTH = 512, 256


@dataclass
class FluxCond:
    """One batch's conditioning: ``l_pooled`` [B, 768], ``t5_out`` [B, L, 4096], ``txt_ids`` [B, L, 3] and the
    T5 attention mask [B, L] (1 for tokens, 0 for padding)."""

    l_pooled: torch.Tensor
    t5_out: torch.Tensor
    txt_ids: torch.Tensor
    t5_attn_mask: torch.Tensor

    def to_cache(self) -> dict[str, torch.Tensor]:
        """The arrays a text-encoder cache keeps (upstream's ``_flux_te.npz`` names)."""
        return {"l_pooled": self.l_pooled, "t5_out": self.t5_out, "txt_ids": self.txt_ids,
                "t5_attn_mask": self.t5_attn_mask}

    @classmethod
    def from_cache(cls, tensors: dict[str, torch.Tensor], device: torch.device) -> FluxCond:
        return cls(*(to_device(tensors[name], device) for name in ("l_pooled", "t5_out", "txt_ids",
                                                                   "t5_attn_mask")))


def t5_max_length(model) -> int:
    """``--t5xxl_max_token_length``, or upstream's default for the checkpoint (dev 512, schnell 256)."""
    return model.t5_max_length or (SCHNELL_T5_LENGTH if model.is_schnell else DEV_T5_LENGTH)


def tokenize(model, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CLIP-L ids [B, 77], T5 ids [B, L] and T5's attention mask [B, L] (host tensors)."""
    clip = model.clip_tokenizer(captions, max_length=CLIP_LENGTH, padding="max_length", truncation=True,
                                return_tensors="pt")
    t5 = model.t5_tokenizer(captions, max_length=t5_max_length(model), padding="max_length", truncation=True,
                            return_tensors="pt")
    return clip["input_ids"], t5["input_ids"], t5["attention_mask"]


def encode_prompts(model, captions: list[str], device: torch.device) -> FluxCond:
    """The conditioning of ``captions`` with the bundle's encoders, on ``device`` (gradients as the caller's mode)."""
    clip_ids, t5_ids, mask = (to_device(t, device) for t in tokenize(model, captions))
    pooled = model.clip_l(clip_ids)["pooler_output"]
    masked = mask if model.apply_t5_attn_mask else None
    hidden = model.t5xxl(t5_ids, attention_mask=masked).last_hidden_state
    return FluxCond(pooled, hidden, text_ids(hidden.shape[0], hidden.shape[1], device=device), mask)
