"""Anima's text conditioning: Qwen3-0.6B's last hidden states with their mask, and the T5 token ids (with their mask)
that the DiT's LLM adapter embeds itself (no T5 model runs).

Upstream sd-scripts 48d368fa ``library/strategy_anima.py``:

- ``AnimaTokenizeStrategy.tokenize``: each caption tokenized twice, by Qwen3's tokenizer and by T5's, both padded
  to and cut at their own length (``--qwen3_max_token_length`` / ``--t5_max_token_length``, 512 each), on the
  right. Plain text: no chat template, no prefix, no weighted captions (``(word:1.2)`` is tokenized as written), no
  caption clean-up. Qwen3 adds no BOS/EOS and pads with ``<|endoftext|>`` (151643, mask 0); T5 ends every caption
  with ``</s>`` (1, kept when cutting) and pads with ``<pad>`` (0). So an empty caption (what caption dropout makes
  of one) has an all-zero Qwen3 mask, and T5 ids ``[1, 0, ...]`` with mask ``[1, 0, ...]``.
  Upstream calls ``batch_encode_plus``, which transformers 5 removed; calling the tokenizer on the list with the
  same arguments is the same encoding (checked against upstream's ids on ``tests/data/upstream_anima_text.py``'s
  captions).
- ``AnimaTextEncodingStrategy.encode_tokens``: ``Qwen3Model(input_ids, attention_mask).last_hidden_state`` (after
  the final norm) with the rows of padded tokens set to zero; masks and T5 ids pass through.
- ``drop_cached_text_encoder_outputs``: with cached outputs, a dropped caption's row becomes what encoding ``""``
  gives (zero states, zero Qwen3 mask, T5 ``[1, 0, ...]`` / ``[1, 0, ...]``): ``drop_rows``. Which rows: upstream
  draws ``random.random() < rate`` per row at each step from Python's global generator (once any rate is non-zero);
  here the data stage draws it for each image with the generator of its batch slot, the draw that drops the caption
  without caching (``library/data/batches.py`` ``captions_dropped``), so a seeded run drops the same images with
  and without cached outputs and a resumed one drops what the uninterrupted run drops.

Tokenizers (``anima_utils.load_qwen3_tokenizer`` / ``load_t5_tokenizer``): Qwen3's from a Qwen3 checkpoint folder,
else the bundled one (``library/assets/qwen3_tokenizer``, upstream's ``configs/qwen3_06b``); T5's from
``--t5_tokenizer_path``, else the bundled google/t5-v1_1-xxl one (``library/assets/t5_tokenizer``, byte for byte
upstream's ``configs/t5_old/tokenizer.json``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, Qwen3Model

ASSETS = Path(__file__).resolve().parents[2] / "assets"
QWEN3_TOKENIZER = ASSETS / "qwen3_tokenizer"
T5_TOKENIZER_FILE = ASSETS / "t5_tokenizer" / "tokenizer.json"
QWEN3_MAX_LENGTH = 512  # --qwen3_max_token_length
T5_MAX_LENGTH = 512  # --t5_max_token_length
T5_EOS_ID = 1


def load_qwen3_tokenizer(path: str | Path | None = None) -> PreTrainedTokenizerBase:
    """Qwen3's tokenizer: from ``path`` when it is a checkpoint folder, else the bundled one; its EOS pads when it
    names no pad token."""
    from transformers import AutoTokenizer

    folder = Path(path) if path is not None and Path(path).is_dir() else QWEN3_TOKENIZER
    if not (folder / "vocab.json").is_file() and not (folder / "tokenizer.json").is_file():
        raise FileNotFoundError(f"no Qwen3 tokenizer in {folder}")
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_t5_tokenizer(path: str | Path | None = None) -> PreTrainedTokenizerBase:
    """T5's tokenizer for the adapter's ids: ``--t5_tokenizer_path`` (a tokenizer folder) or the bundled one."""
    from transformers import T5TokenizerFast

    if path is not None:
        return T5TokenizerFast.from_pretrained(str(path), local_files_only=True)
    if not T5_TOKENIZER_FILE.is_file():
        raise FileNotFoundError(f"bundled T5 tokenizer {T5_TOKENIZER_FILE} is missing; the checkout is incomplete")
    return T5TokenizerFast(tokenizer_file=str(T5_TOKENIZER_FILE))


class AnimaTokens(NamedTuple):
    """``tokenize``'s output, upstream's order: Qwen3 ids and mask [B, Lq], T5 ids and mask [B, Lt] (int64)."""

    qwen3_ids: torch.Tensor
    qwen3_mask: torch.Tensor
    t5_ids: torch.Tensor
    t5_mask: torch.Tensor


def tokenize(qwen3_tokenizer, t5_tokenizer, captions: str | Sequence[str], qwen3_max_length: int = QWEN3_MAX_LENGTH,
             t5_max_length: int = T5_MAX_LENGTH) -> AnimaTokens:
    """Both tokenizations of ``captions``, each padded to and cut at its length (see the module docstring)."""
    captions = [captions] if isinstance(captions, str) else list(captions)
    qwen3 = qwen3_tokenizer(captions, padding="max_length", truncation=True, max_length=qwen3_max_length,
                            return_tensors="pt")
    t5 = t5_tokenizer(captions, padding="max_length", truncation=True, max_length=t5_max_length, return_tensors="pt")
    return AnimaTokens(qwen3["input_ids"], qwen3["attention_mask"], t5["input_ids"], t5["attention_mask"])


@dataclass
class AnimaCond:
    """One batch's conditioning, what the DiT's forward takes: ``prompt_embeds`` [B, Lq, 1024] (its ``context``),
    ``attn_mask`` [B, Lq] (``source_attention_mask``), ``t5_input_ids`` [B, Lt] (``target_input_ids``) and
    ``t5_attn_mask`` [B, Lt] (``target_attention_mask``). The names are upstream's cache keys (``_anima_te.npz``)."""

    prompt_embeds: torch.Tensor
    attn_mask: torch.Tensor
    t5_input_ids: torch.Tensor
    t5_attn_mask: torch.Tensor

    def to_cache(self) -> dict[str, torch.Tensor]:
        return {field.name: getattr(self, field.name) for field in fields(self)}

    @classmethod
    def from_cache(cls, tensors: dict[str, torch.Tensor], device: torch.device | str) -> AnimaCond:
        return cls(*(tensors[field.name].to(device) for field in fields(cls)))

    def dit_inputs(self) -> dict[str, torch.Tensor]:
        """The DiT's keyword arguments for this text (``AnimaTransformer.forward``)."""
        return {"context": self.prompt_embeds, "source_attention_mask": self.attn_mask,
                "target_input_ids": self.t5_input_ids, "target_attention_mask": self.t5_attn_mask}


def encode_tokens(qwen3: Qwen3Model, tokens: AnimaTokens, device: torch.device | str | None = None) -> AnimaCond:
    """Qwen3's last hidden states of ``tokens`` with padded rows zeroed (upstream's ``encode_tokens``); everything on
    ``device`` (default: Qwen3's), gradients as the caller's mode."""
    device = qwen3.device if device is None else device
    ids, mask, t5_ids, t5_mask = (t.to(device) for t in tokens)
    hidden = qwen3(input_ids=ids, attention_mask=mask).last_hidden_state
    hidden = hidden.masked_fill(~mask.bool()[..., None], 0)
    return AnimaCond(hidden, mask, t5_ids, t5_mask)


def encode_prompts(qwen3: Qwen3Model, qwen3_tokenizer, t5_tokenizer, captions: str | Sequence[str],
                   device: torch.device | str | None = None, qwen3_max_length: int = QWEN3_MAX_LENGTH,
                   t5_max_length: int = T5_MAX_LENGTH) -> AnimaCond:
    """``tokenize`` then ``encode_tokens``."""
    tokens = tokenize(qwen3_tokenizer, t5_tokenizer, captions, qwen3_max_length, t5_max_length)
    return encode_tokens(qwen3, tokens, device)


def drop_rows(cond: AnimaCond, dropped: Sequence[bool] | torch.Tensor) -> AnimaCond:
    """``cond`` with the ``dropped`` rows (a [B] bool tensor on ``cond``'s device, or a list) replaced by an empty
    caption's encoding (see the module docstring); new tensors, ``cond``'s untouched. No host sync: the caller
    decides on the host whether any row is dropped."""
    rows = torch.as_tensor(dropped, dtype=torch.bool, device=cond.prompt_embeds.device)
    empty_t5 = torch.zeros_like(cond.t5_input_ids[0])
    empty_t5[0] = T5_EOS_ID
    empty_t5_mask = torch.zeros_like(cond.t5_attn_mask[0])
    empty_t5_mask[0] = 1
    return AnimaCond(
        cond.prompt_embeds.masked_fill(rows[:, None, None], 0),
        cond.attn_mask.masked_fill(rows[:, None], 0),
        torch.where(rows[:, None], empty_t5, cond.t5_input_ids),
        torch.where(rows[:, None], empty_t5_mask, cond.t5_attn_mask),
    )
