"""Generator of ``upstream_clip_cleanup.json``: the token ids upstream sd-scripts gives captions that its tokenizer
cleans up (run with upstream's Python, not ours).

Upstream 48d368fa tokenizes SD captions with ``library.strategy_sd.SdTokenizeStrategy`` (v1, ``max_length`` None
and 225), which loads transformers 4's slow ``CLIPTokenizer`` through ``--tokenizer_cache_dir``; with ``ftfy``
installed (upstream's requirements pin ftfy 6.3.1) that tokenizer runs ``ftfy.fix_text`` on each caption before the
BPE. The ids of each caption are recorded as upstream's ``tokenize`` returns them (one row of 77 for None, 227 for
225), with the ``--weighted_captions`` ids of ``tokenize_with_weights`` and the versions of transformers and ftfy.

    cd "$PEER_DIR/sd-scripts" && PYTHONPATH="$PEER_DIR/shim:." "$PEER_DIR/venv/bin/python" \
        <this repository>/tests/data/upstream_clip_cleanup.py [--tokenizer_cache_dir DIR] [--out FILE]

``--tokenizer_cache_dir`` defaults to ``$PEER_DIR/model/tokenizer_cache`` (a folder holding
``openai_clip-vit-large-patch14``); ``--out`` to ``upstream_clip_cleanup.json`` beside this script.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

CAPTIONS = {
    "plain": "a photo of a cat, sitting on a red chair",
    "curly quotes": "\u201cthe cat\u201d and \u2018the dog\u2019",
    "html entity": "salt &amp; pepper &lt;3 &quot;quoted&quot;",
    "ligature": "\ufb01eld of \ufb02owers, e\ufb00ect",
    "full-width letters": "\uff21\uff22\uff23 \uff43\uff41\uff54 \uff11\uff12\uff13",
    "mojibake": "caf\u00c3\u00a9 cr\u00c3\u00a8me br\u00c3\u00bbl\u00c3\u00a9e",
    "whitespace": "  two\t\tspaces \n and a newline  ",
    "weighted": "(\u201cred\u201d:1.3) ballo\ufb00 &amp; [blue]",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    peer = os.environ.get("PEER_DIR")
    cache = str(Path(peer) / "model" / "tokenizer_cache") if peer else None
    parser.add_argument("--tokenizer_cache_dir", default=cache)
    parser.add_argument("--out", default=str(Path(__file__).with_name("upstream_clip_cleanup.json")))
    args = parser.parse_args()

    import ftfy
    import transformers
    from library.strategy_sd import SdTokenizeStrategy

    record = {"transformers": transformers.__version__, "ftfy": ftfy.__version__, "cases": {}}
    for max_length in (None, 225):
        strategy = SdTokenizeStrategy(False, max_length, tokenizer_cache_dir=args.tokenizer_cache_dir)
        for name, caption in CAPTIONS.items():
            (ids,) = strategy.tokenize(caption)
            (weighted,), _ = strategy.tokenize_with_weights(caption)
            record["cases"].setdefault(name, {"caption": caption})[str(max_length)] = {
                "ids": ids[0].tolist(), "weighted_ids": weighted[0].tolist()}
    Path(args.out).write_text(json.dumps(record, ensure_ascii=True) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
