"""Text conditioning of sample images as sd-scripts computes it: prompt weighting and long prompts.

sd-scripts draws its SD 1.x/2.x samples with ``library/lpw_stable_diffusion.py`` (the "long prompt weighting"
pipeline, itself after AUTOMATIC1111's prompt syntax). This module reproduces its text path:

* **Weights**: the attention syntax ``(text)``, ``[text]``, ``(text:1.5)`` as ``--weighted_captions`` parses it
  (``library/text/weights.py``; lpw's parser and sd-scripts' caption parser read it alike).
* **Length**: up to 3 chunks of 75 tokens (225 tokens; the rest is cut with a warning), whatever
  ``--max_token_length`` says (the pipeline's ``max_embeddings_multiples=3``). The prompt and the negative prompt
  get the same number of chunks, enough for the longer one. Tokens are padded with EOS. Each chunk is encoded as
  BOS + 75 tokens + the last token, and every chunk keeps its BOS and EOS states (``no_boseos_middle=False``), so
  the UNet sees ``77·n`` positions (training captions give ``75·n + 2``, ``library/text/tokens.py``).
* **clip_skip**: hidden state ``[-clip_skip]`` through the final layer norm, as in training.
* **Rescale**: after the states are multiplied by their tokens' weights, the whole tensor is rescaled so that its
  mean is what it was before weighting. Without weights this is skipped: it would multiply by exactly 1, or give
  0/0 = NaN for states of mean zero (a text encoder whose final layer norm has no learned shift, e.g. the tiny
  test model), where sd-scripts' images come out black.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from library.text import tokens
from library.text.tokens import TEXT, chunk_rows
from library.text.weights import parse_prompt_attention

if TYPE_CHECKING:
    import torch
    from transformers import CLIPTextModel, CLIPTokenizer

log = logging.getLogger(__name__)

MAX_CHUNKS = 3


def weighted_tokens(tokenizer: CLIPTokenizer, text: str) -> tuple[list[int], list[float]]:
    """Token ids of ``text`` without BOS/EOS and one weight per token; each weighted fragment is tokenised on its
    own. More than 225 tokens are cut (with a warning)."""
    limit = TEXT * MAX_CHUNKS
    ids: list[int] = []
    weights: list[float] = []
    for fragment, weight in parse_prompt_attention(text):
        tokens = tokenizer(fragment).input_ids[1:-1]
        ids += tokens
        weights += [weight] * len(tokens)
        if len(ids) > limit:
            break
    if len(ids) > limit:
        log.warning("sample prompt longer than %d tokens, cut: %s", limit, text[:80])
    return ids[:limit], weights[:limit]


def chunk_count(*lengths: int) -> int:
    """Number of 75-token chunks for token sequences of these lengths: 1 to 3."""
    longest = max(lengths)
    return max(1, min(MAX_CHUNKS, (longest - 1) // TEXT + 1))


def chunk_ids(ids: list[int], chunks: int, bos: int, eos: int, pad: int) -> list[list[int]]:
    """``chunks`` rows of 77 token ids for the text encoder: the sequence BOS + ids + EOS padding to
    ``75·chunks + 2``, cut by ``library/text/tokens.chunk_rows`` as the lpw pipeline cuts it (``closing="next"``)."""
    full = [bos] + ids + [eos] * (TEXT * chunks + 1 - len(ids))
    return chunk_rows(full, chunks, eos, pad, closing="next")


def chunk_weights(weights: list[float], chunks: int) -> list[float]:
    """Weights of the ``77·chunks`` encoder positions: 1.0 for BOS/EOS/padding, each token's weight at its place."""
    return tokens.chunk_weights([1.0, *weights, *[1.0] * (TEXT * chunks + 1 - len(weights))], chunks)


def _encode(text_encoder: CLIPTextModel, rows: torch.Tensor, clip_skip: int | None) -> torch.Tensor:
    if clip_skip is None or clip_skip == 1:
        return text_encoder(rows)[0]
    hidden = text_encoder(rows, output_hidden_states=True, return_dict=True).hidden_states[-clip_skip]
    return getattr(text_encoder, "text_model", text_encoder).final_layer_norm(hidden)


def prompt_embeddings(text_encoder: CLIPTextModel, tokenizer: CLIPTokenizer, texts: list[str],
                      clip_skip: int | None) -> list[torch.Tensor]:
    """Encoder hidden states ``[1, 77·n, hidden]`` for each text, all with the same ``n`` (see the module doc)."""
    import torch

    tokenized = [weighted_tokens(tokenizer, text) for text in texts]
    chunks = chunk_count(*(len(ids) for ids, _ in tokenized))
    device = text_encoder.device
    out = []
    for ids, weights in tokenized:
        rows = chunk_ids(ids, chunks, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
        states = torch.cat([_encode(text_encoder, torch.tensor([row], device=device), clip_skip) for row in rows],
                           dim=1)
        if any(weight != 1.0 for weight in weights):
            scale = torch.tensor(chunk_weights(weights, chunks), dtype=states.dtype, device=device)
            before = states.float().mean(dim=[-2, -1]).to(states.dtype)
            states = states * scale[None, :, None]
            after = states.float().mean(dim=[-2, -1]).to(states.dtype)
            states = states * (before / after)[:, None, None]
        out.append(states)
    return out
