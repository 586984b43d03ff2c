"""The bundled CLIP tokenizer every family loads (SD 1.x/2.x, both of SDXL's, FLUX.1's CLIP-L): nothing is downloaded.

The BPE vocabulary is ``openai/clip-vit-large-patch14``'s, which SD2's OpenCLIP-H and SDXL's OpenCLIP-bigG share.

Captions are cleaned before they are split, as sd-scripts' tokenizer does: sd-scripts loads transformers 4's slow
``CLIPTokenizer``, whose ``_tokenize`` runs ``ftfy.fix_text`` (curly quotes straightened, HTML entities such as
``&amp;`` unescaped, ligatures such as "ﬁ" and full-width letters replaced, mojibake repaired), then collapses
whitespace and lower-cases. transformers 5's ``CLIPTokenizer`` keeps only the last two (its normalizer), so
``CleanCLIPTokenizer`` adds the ``ftfy`` step in front of every encoding call.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import ftfy
from transformers import CLIPTokenizer

CLIP_TOKENIZER = Path(__file__).resolve().parents[1] / "assets" / "clip_tokenizer"


def clean_text(text: Any) -> Any:
    """``ftfy.fix_text`` on a caption or on each caption of a list (pre-split word lists are left as they are)."""
    if isinstance(text, str):
        return ftfy.fix_text(text)
    if isinstance(text, (list, tuple)) and all(isinstance(item, str) for item in text):
        return [ftfy.fix_text(item) for item in text]
    return text


class CleanCLIPTokenizer(CLIPTokenizer):
    """transformers' CLIP tokenizer with sd-scripts' caption clean-up in front (``__call__``, ``encode`` and
    ``tokenize`` all go through ``_encode_plus``)."""

    def _encode_plus(self, text: Any, text_pair: Any = None, *args: Any, **kwargs: Any) -> Any:
        if not kwargs.get("is_split_into_words"):
            text, text_pair = clean_text(text), clean_text(text_pair)
        return super()._encode_plus(text, text_pair, *args, **kwargs)


def load_tokenizer(v2: bool) -> CleanCLIPTokenizer:
    """The bundled CLIP tokenizer; ``v2`` pads with "!" (id 0) like stabilityai/stable-diffusion-2's tokenizer (and
    SDXL's second one), else with ``<|endoftext|>``."""
    extra = {"pad_token": "!"} if v2 else {}
    return CleanCLIPTokenizer.from_pretrained(str(CLIP_TOKENIZER), **extra)


def as_transformers_tokenizer(tokenizer: CLIPTokenizer) -> CLIPTokenizer:
    """The same tokenizer (shared vocabulary and settings) as transformers' own class, for files that other programs
    read: diffusers' ``model_index.json`` and ``tokenizer_config.json`` name the class that saved them."""
    plain = copy.copy(tokenizer)
    plain.__class__ = CLIPTokenizer
    return plain
