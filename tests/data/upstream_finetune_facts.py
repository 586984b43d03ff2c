"""Generator of the upstream full fine-tuning parser reference data in this folder (run with upstream's own Python).

Writes, next to this file (or into ``--out_dir``), one file per upstream full fine-tuning script:

* ``upstream_fine_tune_flags.json``: every option of upstream ``fine_tune.setup_parser()``;
* ``upstream_train_db_flags.json``: every option of upstream ``train_db.setup_parser()``;
* ``upstream_sdxl_train_flags.json``: every option of upstream ``sdxl_train.setup_parser()``;
* ``upstream_flux_train_flags.json``: every option of upstream ``flux_train.setup_parser()``.

Each holds ``flags`` in the format of ``upstream_train_network_flags.json`` (dest, action, type, nargs, default,
choices; help texts left out), plus two lists of dests that compare it with its LoRA sibling
(``train_network.setup_parser()`` for fine_tune and train_db, ``sdxl_train_network.setup_parser()`` for sdxl_train,
``flux_train_network.setup_parser()`` for flux_train):
``<script>_only`` (dests the sibling's parser lacks) and ``<sibling>_only`` (dests only the sibling has), and
``differs_from_<sibling>``: the dests both have whose action, type, nargs, default or choices differ.

Upstream reference: kohya-ss/sd-scripts commit 48d368fa. Run it from the upstream checkout with that
checkout's virtual environment, for example, where PEER_DIR holds ``sd-scripts/``, ``venv/`` and the torchvision
``shim/``:

    cd "$PEER_DIR/sd-scripts" && PYTHONPATH="$PEER_DIR/shim:." "$PEER_DIR/venv/bin/python" \
        <this repository>/tests/data/upstream_finetune_facts.py [--upstream_dir DIR] [--out_dir DIR]

``--upstream_dir`` defaults to ``$PEER_DIR/sd-scripts`` (or the current directory when PEER_DIR is unset).
Nothing from upstream is copied here: the script only imports upstream's scripts and introspects their parsers
(with ``parser_flags`` of ``upstream_flux_facts.py``). Costs a few seconds of CPU; no model is built or read.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path

from upstream_flux_facts import UPSTREAM_COMMIT, parser_flags

# script -> its LoRA sibling
SCRIPTS = {
    "fine_tune": "train_network",
    "train_db": "train_network",
    "sdxl_train": "sdxl_train_network",
    "flux_train": "flux_train_network",
}


def make_flags(script: str, sibling: str, out_dir: Path) -> dict:
    flags = parser_flags(importlib.import_module(script).setup_parser())
    sibling_flags = {f["dest"]: f for f in parser_flags(importlib.import_module(sibling).setup_parser())}
    dests = {f["dest"] for f in flags}
    script_only = [f["dest"] for f in flags if f["dest"] not in sibling_flags]
    sibling_only = [d for d in sibling_flags if d not in dests]
    differs = [f["dest"] for f in flags if f["dest"] in sibling_flags and sibling_flags[f["dest"]] != f]
    data = {
        "source": f"kohya-ss/sd-scripts {UPSTREAM_COMMIT}, {script}.py setup_parser(): every option's dest, "
        "action, type, nargs, default and choices (help texts left out), introspected in upstream's venv by "
        f"tests/data/upstream_finetune_facts.py (no stubs needed); {script}_only: the dests that {sibling}.py "
        f"setup_parser() lacks; {sibling}_only: the dests of {sibling}.py setup_parser() that {script}.py lacks "
        f"(both in parser order); differs_from_{sibling}: the dests both have whose action, type, nargs, default "
        "or choices differ",
        "flags": flags,
        f"{script}_only": script_only,
        f"{sibling}_only": sibling_only,
        f"differs_from_{sibling}": differs,
    }
    (out_dir / f"upstream_{script}_flags.json").write_text(json.dumps(data, indent=1) + "\n")
    return {
        "flags": len(flags),
        f"{script}_only": len(script_only),
        f"{sibling}_only": len(sibling_only),
        f"differs_from_{sibling}": differs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    peer = os.environ.get("PEER_DIR")
    parser.add_argument("--upstream_dir", type=Path, default=Path(peer) / "sd-scripts" if peer else Path.cwd())
    parser.add_argument("--out_dir", type=Path, default=Path(__file__).resolve().parent)
    args = parser.parse_args()

    upstream = args.upstream_dir.resolve()
    missing = [s for s in [*SCRIPTS, *SCRIPTS.values()] if not (upstream / f"{s}.py").exists()]
    if missing:
        sys.exit(f"--upstream_dir {upstream} lacks {', '.join(f'{s}.py' for s in missing)}")
    out_dir = args.out_dir.resolve()
    sys.path.insert(0, str(upstream))
    os.chdir(upstream)
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

    report = {script: make_flags(script, sibling, out_dir) for script, sibling in SCRIPTS.items()}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
