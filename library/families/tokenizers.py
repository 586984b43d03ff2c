"""The bundled CLIP tokenizer every family loads (SD 1.x/2.x, both of SDXL's, FLUX.1's CLIP-L): nothing is downloaded.

The BPE vocabulary is ``openai/clip-vit-large-patch14``'s, which SD2's OpenCLIP-H and SDXL's OpenCLIP-bigG share.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import CLIPTokenizer

CLIP_TOKENIZER = Path(__file__).resolve().parents[1] / "assets" / "clip_tokenizer"


def load_tokenizer(v2: bool) -> CLIPTokenizer:
    """The bundled CLIP tokenizer; ``v2`` pads with "!" (id 0) like stabilityai/stable-diffusion-2's tokenizer (and
    SDXL's second one), else with ``<|endoftext|>``."""
    from transformers import CLIPTokenizer

    extra = {"pad_token": "!"} if v2 else {}
    return CLIPTokenizer.from_pretrained(str(CLIP_TOKENIZER), **extra)
