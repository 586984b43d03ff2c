"""CLIP encoding of captions as sd-scripts does it for SD 1.x / 2.x.

Reproduces ``library/strategy_sd.py`` ``SdTextEncodingStrategy.encode_tokens`` (kohya-ss/sd-scripts), on the ids
``library/text/tokens.py`` lays out in 77-token chunks (``TokenizeStrategy._get_input_ids``):

* Each 77-token chunk is encoded separately; the result keeps the first chunk's BOS state, the 75 middle states of
  every chunk and the very last state: ``75·n + 2`` positions (77, 152, 227). sd-scripts' SD2 branch means to copy
  a pad state over an empty chunk's EOS but never does (it compares a token id with the token *string*), so SD1 and
  SD2 are merged alike here too.
* ``--clip_skip n`` takes hidden state ``[-n]`` and applies the final layer norm, for SD1 and SD2 alike
  (``clip_skip`` 1 or None is the normal last-layer output).
* ``--weighted_captions`` (``SdTextEncodingStrategy.encode_tokens_with_weights``): the merged encoder states are
  multiplied by the merged weights of ``library/text/tokens.py``, position by position, with no renormalisation
  (``apply_token_weights``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from library.base.errors import UserError
from library.text.tokens import CHUNK, merge_chunks, num_chunks

if TYPE_CHECKING:
    import torch
    from transformers import CLIPTextModel


def encode_text(
    text_encoder: CLIPTextModel,
    input_ids: torch.Tensor,
    *,
    clip_skip: int | None,
    max_token_length: int | None,
    v2: bool,
) -> torch.Tensor:
    """Encoder hidden states ``[B, 75·n + 2, hidden]`` for the UNet from ``tokenize``'s ``[B, n·77]`` ids.

    ``v2`` is accepted for symmetry with sd-scripts' call; its merge and clip-skip rules are the same as SD1's.
    """
    del v2
    n = num_chunks(max_token_length)
    if input_ids.shape[-1] != n * CHUNK:
        raise ValueError(f"input_ids has {input_ids.shape[-1]} tokens per caption, expected {n * CHUNK}")
    layers = text_encoder.config.num_hidden_layers
    if clip_skip is not None and not 1 <= clip_skip <= layers:
        raise UserError(f"--clip_skip {clip_skip}: the text encoder has {layers} layers; use 1 to {layers} (SD1.5: 2)")
    batch = input_ids.shape[0]
    flat = input_ids.reshape(batch * n, CHUNK).to(text_encoder.device)
    if clip_skip is None or clip_skip <= 1:
        states = text_encoder(flat)[0]
    else:
        hidden = text_encoder(flat, output_hidden_states=True, return_dict=True).hidden_states[-clip_skip]
        states = getattr(text_encoder, "text_model", text_encoder).final_layer_norm(hidden)
    return merge_chunks(states.reshape(batch, n * CHUNK, states.shape[-1]), n)
