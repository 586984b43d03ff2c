"""SDXL text conditioning as sd-scripts' ``library/strategy_sdxl.py`` computes it.

* Tokenising: each caption is tokenised by both tokenizers exactly as for SD 1.x/2.x (``library/text/tokens.tokenize``,
  with ``--max_token_length`` 150/225 chunking); the second tokenizer pads with id 0, so its chunks get SD2's EOS
  fix-ups, as upstream's ``SdxlTokenizeStrategy``.
* Encoding (``SdxlTextEncodingStrategy._get_hidden_states_sdxl``): every 77-token chunk is encoded separately;
  CLIP ViT-L gives its penultimate hidden state (``hidden_states[11]`` of 12 layers) and OpenCLIP ViT-bigG its
  penultimate hidden state (``hidden_states[-2]``), neither through the final layer norm; chunks are merged as for
  SD1 (first chunk's BOS state, the 75 middle states of each chunk, the very last state).
* Pooled output: encoder 2's final-layer-norm output at the first EOS of each chunk (upstream's pooling
  "workaround", which does not depend on the EOS being the largest id), through ``text_projection``; of several
  chunks the first chunk's is used.

* ``--weighted_captions`` (``SdxlTokenizeStrategy.tokenize_with_weights``,
  ``SdxlTextEncodingStrategy.encode_tokens_with_weights``): each tokenizer weights its own tokens as for SD 1.x/2.x
  (``library/text/tokens.tokenize_with_weights``), each hidden state is multiplied by its encoder's weights
  (``library/text/tokens.apply_token_weights``: every position with one chunk, the 75 text positions of each chunk with
  several), and the pooled output is left as encoded.

The UNet's text input is the two hidden states concatenated on the feature axis (768 + 1280 = 2048 for SDXL).
``--clip_skip`` does not apply (upstream warns that it "will be unexpected" and uses the penultimate layers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from library.base.devices import to_device
from library.text.tokens import CHUNK, apply_token_weights, num_chunks, tokenize, tokenize_with_weights

if TYPE_CHECKING:
    import torch
    from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    from library.families.sdxl.parts import SDXLModel


@dataclass
class SDXLTextConditioning:
    """The text outputs the SDXL UNet needs for one batch."""

    hidden_states_1: torch.Tensor  # [B, 75n+2, 768]
    hidden_states_2: torch.Tensor  # [B, 75n+2, 1280]
    pool_2: torch.Tensor  # [B, 1280]

    def encoder_hidden_states(self) -> torch.Tensor:
        """The UNet's cross-attention input: both hidden states side by side [B, 75n+2, 768 + 1280]."""
        import torch

        return torch.cat([self.hidden_states_1, self.hidden_states_2], dim=2)


def tokenize_sdxl(tokenizers: tuple[CLIPTokenizer, CLIPTokenizer], captions: list[str],
                  max_token_length: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids ``[B, n·77]`` for each encoder (``library/text/tokens.tokenize`` with each tokenizer)."""
    first, second = tokenizers
    return tokenize(first, captions, max_token_length), tokenize(second, captions, max_token_length)


def _merge_chunks(states: torch.Tensor, batch: int, n: int) -> torch.Tensor:
    """``[B·n, 77, C]`` chunk states -> ``[B, 75·n + 2, C]``: BOS of the first chunk, 75 middle states of each, the
    last state of the last chunk."""
    import torch

    states = states.reshape(batch, n * CHUNK, states.shape[-1])
    if n == 1:
        return states
    parts = [states[:, :1]] + [states[:, start:start + 75] for start in range(1, n * CHUNK, CHUNK)] + [states[:, -1:]]
    return torch.cat(parts, dim=1)


def pool_at_first_eos(text_encoder_2: CLIPTextModelWithProjection, last_hidden_state: torch.Tensor,
                      input_ids: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """Projected final state at each row's first EOS (position 0 when a row has none), as upstream."""
    import torch

    index = (input_ids == eos_token_id).int().argmax(dim=1).to(last_hidden_state.device)
    pooled = last_hidden_state[torch.arange(last_hidden_state.shape[0], device=last_hidden_state.device), index]
    projection = text_encoder_2.text_projection
    return projection(pooled.to(projection.weight.dtype)).to(last_hidden_state.dtype)


def encode_sdxl(text_encoders: tuple[CLIPTextModel, CLIPTextModelWithProjection],
                input_ids: tuple[torch.Tensor, torch.Tensor], *, max_token_length: int | None,
                eos_token_id: int) -> SDXLTextConditioning:
    """Both encoders' penultimate hidden states and encoder 2's pooled output from ``tokenize_sdxl``'s ids."""
    te1, te2 = text_encoders
    ids1, ids2 = input_ids
    n = num_chunks(max_token_length)
    for ids in input_ids:
        if ids.shape[-1] != n * CHUNK:
            raise ValueError(f"input_ids has {ids.shape[-1]} tokens per caption, expected {n * CHUNK}")
    batch = ids1.shape[0]
    flat1 = ids1.reshape(batch * n, CHUNK).to(te1.device)
    flat2 = ids2.reshape(batch * n, CHUNK).to(te2.device)
    hidden1 = te1(flat1, output_hidden_states=True, return_dict=True).hidden_states[-2]
    out2 = te2(flat2, output_hidden_states=True, return_dict=True)
    pool = pool_at_first_eos(te2, out2.last_hidden_state, flat2, eos_token_id)
    return SDXLTextConditioning(
        hidden_states_1=_merge_chunks(hidden1, batch, n),
        hidden_states_2=_merge_chunks(out2.hidden_states[-2], batch, n),
        pool_2=pool[::n],
    )


def encode_sdxl_weighted(model: SDXLModel, captions: list[str], device: torch.device,
                         max_token_length: int | None) -> SDXLTextConditioning:
    """``--weighted_captions``: the conditioning of ``encode_sdxl`` with each hidden state scaled by its own
    tokenizer's token weights; the pooled output unchanged (see the module docstring)."""
    (ids1, weights1), (ids2, weights2) = (tokenize_with_weights(tokenizer, captions, max_token_length)
                                          for tokenizer in (model.tokenizer, model.tokenizer_2))
    cond = encode_sdxl(model.text_encoders, (to_device(ids1, device), to_device(ids2, device)),
                       max_token_length=max_token_length, eos_token_id=model.tokenizer_2.eos_token_id)
    return SDXLTextConditioning(
        hidden_states_1=apply_token_weights(cond.hidden_states_1, to_device(weights1, device), max_token_length),
        hidden_states_2=apply_token_weights(cond.hidden_states_2, to_device(weights2, device), max_token_length),
        pool_2=cond.pool_2,
    )
