"""Regenerate the bundled CLIP BPE tokenizer files from the open-clip-torch wheel (MIT licence).

The wheel ships ``open_clip/bpe_simple_vocab_16e6.txt.gz``: a header line, then BPE merges. CLIP's vocabulary is the
256 byte-level characters (GPT-2's byte-to-unicode table), the same characters followed by ``</w>``, the first
49152 - 256 - 2 merges joined, then ``<|startoftext|>`` and ``<|endoftext|>``: 49,408 tokens, the ids of
openai/clip-vit-large-patch14 (SD1.x) and of SD2's OpenCLIP-H tokenizer (which pads with "!", id 0).

Run from the repository root::

    pip download --no-deps open-clip-torch==3.3.0 -d oc
    python -m library.assets.make_clip_tokenizer oc/open_clip_torch-3.3.0-py3-none-any.whl

It rewrites ``library/assets/clip_tokenizer/`` (SD1.x, pad = ``<|endoftext|>``); SD2.x uses the same files with
``pad_token="!"`` passed at load time (``library.families.tokenizers.load_tokenizer``).
"""

from __future__ import annotations

import gzip
import json
import sys
import zipfile
from pathlib import Path

ASSETS = Path(__file__).resolve().parent
BPE_MEMBER = "open_clip/bpe_simple_vocab_16e6.txt.gz"
VOCAB_SIZE = 49408
BOS = "<|startoftext|>"
EOS = "<|endoftext|>"


def byte_to_unicode() -> dict[int, str]:
    """GPT-2 / CLIP table mapping every byte to a printable unicode character, printable bytes first.

    The insertion order (printable bytes, then the rest) is the order of the first 256 vocabulary ids.
    """
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def build_vocab(merge_lines: list[str]) -> tuple[dict[str, int], list[str]]:
    """Return (token -> id, merges used) following open_clip's SimpleTokenizer construction."""
    merges = merge_lines[: VOCAB_SIZE - 256 * 2 - 2]
    chars = list(byte_to_unicode().values())
    tokens = chars + [c + "</w>" for c in chars] + ["".join(m.split()) for m in merges] + [BOS, EOS]
    if len(tokens) != VOCAB_SIZE:
        raise ValueError(f"expected {VOCAB_SIZE} tokens, built {len(tokens)}")
    return {t: i for i, t in enumerate(tokens)}, merges


def write_tokenizer(out_dir: Path, vocab: dict[str, int], merges: list[str], pad_token: str) -> None:
    """Write vocab.json, merges.txt and the configs that transformers' CLIPTokenizer reads."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (out_dir / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    special = {"bos_token": BOS, "eos_token": EOS, "unk_token": EOS, "pad_token": pad_token}
    config = {**special, "tokenizer_class": "CLIPTokenizer", "model_max_length": 77, "do_lower_case": True,
              "errors": "replace", "clean_up_tokenization_spaces": True}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n", encoding="utf-8")
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def main(wheel: str) -> None:
    with zipfile.ZipFile(wheel) as zf:
        text = gzip.decompress(zf.read(BPE_MEMBER)).decode("utf-8")
    vocab, merges = build_vocab(text.split("\n")[1:])
    write_tokenizer(ASSETS / "clip_tokenizer", vocab, merges, pad_token=EOS)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    main(sys.argv[1])
