"""What every generator of this folder does first, run with upstream's Python: its ``--upstream_dir`` (default
``$PEER_DIR/sd-scripts``, else the current folder) and ``--data_dir`` (default: this folder), upstream's source
importable and the current folder, one torch thread."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def enter_upstream(description: str) -> Path:
    """Parse the two folders and enter upstream's; returns the data folder."""
    peer = os.environ.get("PEER_DIR")
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--upstream_dir", default=os.path.join(peer, "sd-scripts") if peer else ".")
    parser.add_argument("--data_dir", default=str(Path(__file__).resolve().parent))
    cli = parser.parse_args()
    upstream, data = Path(cli.upstream_dir).resolve(), Path(cli.data_dir).resolve()
    sys.path.insert(0, str(upstream))
    os.chdir(upstream)
    import torch

    torch.set_num_threads(1)
    return data
