"""Generator of ``upstream_anima_train_network_flags.json`` and ``upstream_anima_train_flags.json`` (run with
upstream's own Python): every option of upstream ``anima_train_network.setup_parser()`` (dest, action, type, nargs,
default, choices; help texts left out) and ``anima_only``, the dests that ``train_network.setup_parser()`` lacks;
and every option of upstream ``anima_train.setup_parser()`` (the full fine-tuning script) compared with its LoRA
sibling ``anima_train_network.py``, in the format of ``upstream_finetune_facts.py``'s files (``anima_train_only``,
``anima_train_network_only``, ``differs_from_anima_train_network``).

Upstream reference: kohya-ss/sd-scripts commit 48d368fa. Run it from the upstream checkout with that checkout's
virtual environment, for example, where PEER_DIR holds ``sd-scripts/``, ``venv/`` and the torchvision ``shim/``:

    cd "$PEER_DIR/sd-scripts" && PYTHONPATH="$PEER_DIR/shim:.:<this repository>/tests/data" \
        "$PEER_DIR/venv/bin/python" <this repository>/tests/data/upstream_anima_flags.py [--out_dir DIR]

Nothing from upstream is copied here: the script only imports upstream's scripts and introspects their parsers
(with ``parser_flags`` of ``upstream_flux_facts.py``). No model is built or read.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from upstream_finetune_facts import make_flags  # noqa: E402
from upstream_flux_facts import UPSTREAM_COMMIT, parser_flags  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out_dir", type=Path, default=Path(__file__).resolve().parent)
    args = parser.parse_args()
    sys.path.insert(0, str(Path.cwd()))
    flags = parser_flags(importlib.import_module("anima_train_network").setup_parser())
    shared = {f["dest"] for f in parser_flags(importlib.import_module("train_network").setup_parser())}
    data = {
        "source": f"kohya-ss/sd-scripts {UPSTREAM_COMMIT}, anima_train_network.py setup_parser(): every option's "
        "dest, action, type, nargs, default and choices (help texts left out), introspected in upstream's venv by "
        "tests/data/upstream_anima_flags.py; anima_only: the dests that train_network.py setup_parser() lacks",
        "flags": flags,
        "anima_only": [f["dest"] for f in flags if f["dest"] not in shared],
    }
    out = args.out_dir / "upstream_anima_train_network_flags.json"
    out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {out}")
    print(json.dumps(make_flags("anima_train", "anima_train_network", args.out_dir), indent=1))


if __name__ == "__main__":
    main()
