"""Caption tokenisation and CLIP encoding as sd-scripts does it for SD 1.x / 2.x.

Reproduces ``library/strategy_base.py`` ``TokenizeStrategy._get_input_ids`` and ``library/strategy_sd.py``
``SdTextEncodingStrategy.encode_tokens`` (kohya-ss/sd-scripts):

* ``--max_token_length`` None keeps CLIP's 77 tokens (BOS + 75 + EOS/pad). 150 or 225 tokenise the caption to
  ``max_token_length + 2`` tokens and cut it into 2 or 3 chunks of 75, each wrapped as BOS + 75 + the last token of
  the long sequence (EOS, or SD2's pad when the caption is short). For SD2 (pad "!" ≠ EOS) a chunk that ends in
  ``x <pad>`` gets EOS as its last token, and a chunk that starts ``<BOS> <pad>`` gets EOS in position 1.
* Each 77-token chunk is encoded separately; the result keeps the first chunk's BOS state, the 75 middle states of
  every chunk and the very last state: ``75·n + 2`` positions (77, 152, 227). sd-scripts' SD2 branch means to copy
  a pad state over an empty chunk's EOS but never does (it compares a token id with the token *string*), so SD1 and
  SD2 are merged alike here too.
* ``--clip_skip n`` takes hidden state ``[-n]`` and applies the final layer norm, for SD1 and SD2 alike
  (``clip_skip`` 1 or None is the normal last-layer output).
* ``--weighted_captions`` (``SdTokenizeStrategy.tokenize_with_weights`` and
  ``SdTextEncodingStrategy.encode_tokens_with_weights``): the ids come from ``library/text/weights.py``, chunked
  as above with one weight per token (1.0 for each chunk's BOS and last token), and the merged encoder states are
  multiplied by the merged weights, position by position, with no renormalisation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from library.base.errors import UserError
from library.text.weights import weighted_token_ids

if TYPE_CHECKING:
    import torch
    from transformers import CLIPTextModel, CLIPTokenizer

CHUNK = 77
ALLOWED_MAX_TOKEN_LENGTH = (None, 75, 150, 225)


def num_chunks(max_token_length: int | None) -> int:
    """How many 77-token chunks a caption becomes: 1 for None/75, 2 for 150, 3 for 225."""
    if max_token_length not in ALLOWED_MAX_TOKEN_LENGTH:
        raise UserError(f"--max_token_length {max_token_length}: use 75, 150 or 225 (or leave it unset for 75)")
    return 1 if max_token_length is None else max_token_length // 75


def _chunk_ids(ids: torch.Tensor, n: int, eos: int, pad: int) -> torch.Tensor:
    """One caption's ``75·n + 2`` ids -> ``n`` chunks of 77, each BOS + 75 + last id, SD2 fix-ups applied."""
    import torch

    chunks = []
    for start in range(1, 75 * n + 1, 75):
        chunk = torch.cat([ids[:1], ids[start:start + 75], ids[-1:]])
        if pad != eos:
            if chunk[-2] != eos and chunk[-2] != pad:
                chunk[-1] = eos
            if chunk[1] == pad:
                chunk[1] = eos
        chunks.append(chunk)
    return torch.cat(chunks)


def _chunk_weights(weights: torch.Tensor, n: int) -> torch.Tensor:
    """One caption's ``75·n + 2`` token weights -> ``n`` chunks of 77 laid out like ``_chunk_ids`` (BOS and last 1)."""
    import torch

    one = weights.new_ones(1)
    return torch.cat([torch.cat([one, weights[start:start + 75], one]) for start in range(1, 75 * n + 1, 75)])


def caption_length(max_token_length: int | None) -> int:
    """Tokens per caption before chunking: 77 for None/75, ``max_token_length + 2`` for 150 and 225."""
    n = num_chunks(max_token_length)
    return CHUNK if n == 1 else 75 * n + 2


def tokenize(tokenizer: CLIPTokenizer, captions: list[str], max_token_length: int | None) -> torch.Tensor:
    """Token ids ``[B, n·77]`` (n = 1, 2, 3): the ``n`` 77-token chunks of each caption, concatenated."""
    import torch

    n = num_chunks(max_token_length)
    length = caption_length(max_token_length)
    ids = tokenizer(
        captions, padding="max_length", truncation=True, max_length=length, return_tensors="pt"
    ).input_ids
    if n == 1:
        return ids
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    return torch.stack([_chunk_ids(row, n, eos, pad) for row in ids])


def tokenize_with_weights(tokenizer: CLIPTokenizer, captions: list[str],
                          max_token_length: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``--weighted_captions``: ids ``[B, n·77]`` laid out as ``tokenize`` does, and float32 weights alike."""
    import torch

    n = num_chunks(max_token_length)
    rows = [weighted_token_ids(tokenizer, caption, caption_length(max_token_length)) for caption in captions]
    ids = torch.tensor([row_ids for row_ids, _ in rows], dtype=torch.long)
    weights = torch.tensor([row_weights for _, row_weights in rows], dtype=torch.float32)
    if n == 1:
        return ids, weights
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    return (torch.stack([_chunk_ids(row, n, eos, pad) for row in ids]),
            torch.stack([_chunk_weights(row, n) for row in weights]))


def merge_chunks(x: torch.Tensor, n: int) -> torch.Tensor:
    """``[B, n·77, ...]`` per-chunk values -> ``[B, 75·n + 2, ...]``: first BOS, each chunk's middle 75, last token."""
    import torch

    if n == 1:
        return x
    parts = [x[:, :1]] + [x[:, start:start + 75] for start in range(1, n * CHUNK, CHUNK)] + [x[:, -1:]]
    return torch.cat(parts, dim=1)


def apply_token_weights(states: torch.Tensor, weights: torch.Tensor, max_token_length: int | None) -> torch.Tensor:
    """Encoder states ``[B, 75·n + 2, H]`` times the weights ``[B, n·77]`` of their tokens (float32 product).

    With one chunk every position is weighted; with several, as in sd-scripts, only each chunk's 75 text
    positions, so the merged BOS and last states are kept as encoded.
    """
    n = num_chunks(max_token_length)
    merged = merge_chunks(weights.to(states.device), n)
    if n > 1:
        merged = merged.clone()
        merged[:, 0] = 1.0
        merged[:, -1] = 1.0
    return states * merged.unsqueeze(-1)


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
