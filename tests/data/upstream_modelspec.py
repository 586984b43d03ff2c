"""Generator of ``upstream_modelspec.json``: the ModelSpec entries upstream sd-scripts (48d368fa) writes into a
LoRA, per family and flag case, from each trainer's own ``get_sai_model_spec`` (``train_network.NetworkTrainer``,
``sdxl_train_network.SdxlNetworkTrainer``, ``flux_train_network.FluxNetworkTrainer`` with ``model_type`` and
``is_schnell`` as its model loading sets them) on its own ``setup_parser()``'s arguments. Run with upstream's
Python, not ours; upstream code is called, nothing copied. The entries that change per run (date, title,
implementation_version) are left out; a key upstream does not write is absent.

    cd "$PEER_DIR/sd-scripts" && PYTHONPATH="$PEER_DIR/shim:." "$PEER_DIR/venv/bin/python" \
        <this repository>/tests/data/upstream_modelspec.py [--upstream_dir DIR] [--out FILE]

``--upstream_dir`` defaults to ``$PEER_DIR/sd-scripts`` (else the current directory), ``--out`` to
``upstream_modelspec.json`` beside this script. A few seconds of CPU.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path

UPSTREAM_COMMIT = "48d368fa"
VARYING = ("modelspec.date", "modelspec.title", "modelspec.implementation_version")
# case name -> (trainer module, flags, FluxNetworkTrainer's model_type and is_schnell or None)
CASES = {
    "sd_v1": ("train_network", [], None),
    "sd_v1_v": ("train_network", ["--v_parameterization"], None),
    "sd_v2": ("train_network", ["--v2"], None),
    "sd_v2_v": ("train_network", ["--v2", "--v_parameterization"], None),
    "sdxl": ("sdxl_train_network", [], None),
    "sdxl_v": ("sdxl_train_network", ["--v_parameterization"], None),
    "flux_dev": ("flux_train_network", [], ("flux", False)),
    "flux_schnell": ("flux_train_network", [], ("flux", True)),
    "chroma": ("flux_train_network", [], ("chroma", False)),
}
TRAINERS = {"train_network": "NetworkTrainer", "sdxl_train_network": "SdxlNetworkTrainer",
            "flux_train_network": "FluxNetworkTrainer"}


def case_entries(module_name: str, flags: list[str], flux: tuple[str, bool] | None) -> dict[str, str]:
    module = importlib.import_module(module_name)
    args = module.setup_parser().parse_args(flags)
    trainer = getattr(module, TRAINERS[module_name])()
    if flux is not None:
        trainer.model_type, trainer.is_schnell = flux
    spec = trainer.get_sai_model_spec(args)
    return {key: value for key, value in sorted(spec.items()) if key not in VARYING}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    peer = os.environ.get("PEER_DIR")
    parser.add_argument("--upstream_dir", default=str(Path(peer) / "sd-scripts") if peer else ".")
    parser.add_argument("--out", default=str(Path(__file__).with_suffix(".json")))
    options = parser.parse_args()
    sys.path.insert(0, str(Path(options.upstream_dir).resolve()))
    cases = {name: case_entries(*case) for name, case in CASES.items()}
    record = {"upstream_commit": UPSTREAM_COMMIT, "generator": Path(__file__).name, "cases": cases}
    Path(options.out).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    print(f"wrote {options.out}: {len(cases)} cases")


if __name__ == "__main__":
    main()
