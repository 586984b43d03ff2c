"""Token ids of captions and prompts, laid out in CLIP's 77-token chunks: the one chunking implementation.

Captions (``tokenize``, ``tokenize_with_weights``) reproduce sd-scripts' ``library/strategy_base.py``
``TokenizeStrategy._get_input_ids`` and ``SdTokenizeStrategy.tokenize_with_weights``: ``--max_token_length`` None
keeps CLIP's 77 tokens (BOS + 75 + EOS/pad); 150 or 225 tokenise the caption to ``max_token_length + 2`` tokens and
cut it into 2 or 3 chunks of 75, each wrapped as BOS + 75 + the last token of the long sequence (EOS, or SD2's pad
when the caption is short). For SD2 (pad "!" ≠ EOS) a chunk whose last text token is text gets EOS as its closing
token, and a chunk that starts ``<BOS> <pad>`` gets EOS in position 1.

Sample prompts (``library/families/sd/sample_conditioning.py``) are chunked by sd-scripts' lpw pipeline
(``lpw_stable_diffusion.get_unweighted_text_embeddings``) with the same windows over an EOS-padded sequence; for SD2
its closing token is the token after the window, made EOS unless it is EOS or pad (``closing="next"``). For SD1
(pad = EOS) both close every chunk with the sequence's last token.

``merge_chunks`` is the inverse used on encoder states: the first chunk's BOS, every chunk's 75 middle positions and
the very last position (``75·n + 2``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

from library.base.errors import UserError
from library.text.weights import weighted_token_ids

if TYPE_CHECKING:
    import torch
    from transformers import CLIPTokenizer

CHUNK = 77
TEXT = CHUNK - 2  # the text tokens of one chunk
ALLOWED_MAX_TOKEN_LENGTH = (None, 75, 150, 225)


def num_chunks(max_token_length: int | None) -> int:
    """How many 77-token chunks a caption becomes: 1 for None/75, 2 for 150, 3 for 225."""
    if max_token_length not in ALLOWED_MAX_TOKEN_LENGTH:
        raise UserError(f"--max_token_length {max_token_length}: use 75, 150 or 225 (or leave it unset for 75)")
    return 1 if max_token_length is None else max_token_length // 75


def caption_length(max_token_length: int | None) -> int:
    """Tokens per caption before chunking: 77 for None/75, ``max_token_length + 2`` for 150 and 225."""
    n = num_chunks(max_token_length)
    return CHUNK if n == 1 else 75 * n + 2


def chunk_rows(ids: Sequence[int], n: int, eos: int, pad: int,
               closing: Literal["last", "next"] = "last") -> list[list[int]]:
    """A sequence of ``75·n + 2`` ids (BOS first) as ``n`` rows of 77: BOS, the row's 75 tokens, a closing token.

    ``closing`` "last" (captions): the sequence's last id; for SD2 (pad ≠ EOS) EOS when the row's last text token
    is neither EOS nor pad. "next" (lpw sample prompts): for SD2 the id after the row, EOS unless it is EOS or pad;
    for SD1 the sequence's last id. For SD2 a row that starts with pad starts with EOS. One row: the ids as given.
    """
    if n == 1:
        return [list(ids)]
    rows = []
    for start in range(1, TEXT * n + 1, TEXT):
        after = ids[-1] if closing == "last" or pad == eos else ids[start + TEXT]
        row = [ids[0], *ids[start:start + TEXT], after]
        if pad != eos:
            probe = row[-2] if closing == "last" else row[-1]
            if probe not in (eos, pad):
                row[-1] = eos
            if row[1] == pad:
                row[1] = eos
        rows.append(row)
    return rows


def chunk_weights(weights: Sequence[float], n: int) -> list[float]:
    """Weights of a ``75·n + 2`` sequence laid out like ``chunk_rows``: each row's BOS and closing position 1.0."""
    out: list[float] = []
    for start in range(1, TEXT * n + 1, TEXT):
        out += [1.0, *weights[start:start + TEXT], 1.0]
    return out


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
    return torch.tensor([sum(chunk_rows(row, n, eos, pad), []) for row in ids.tolist()], dtype=ids.dtype)


def tokenize_with_weights(tokenizer: CLIPTokenizer, captions: list[str],
                          max_token_length: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``--weighted_captions``: ids ``[B, n·77]`` laid out as ``tokenize`` does, and float32 weights alike."""
    import torch

    n = num_chunks(max_token_length)
    rows = [weighted_token_ids(tokenizer, caption, caption_length(max_token_length)) for caption in captions]
    if n > 1:
        eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
        rows = [(sum(chunk_rows(ids, n, eos, pad), []), chunk_weights(weights, n)) for ids, weights in rows]
    return (torch.tensor([ids for ids, _ in rows], dtype=torch.long),
            torch.tensor([weights for _, weights in rows], dtype=torch.float32))


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
