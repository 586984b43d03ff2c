"""Counted runs of several model families in each process of one torchrun launch, for ``test_feature_ops.py``:

    python -m torch.distributed.run --standalone --nproc_per_node 2 -m tests.e2e.ops_driver OUT UPDATES FAMILY...

Each process makes one process group (``library/runtime/processes.py`` adopts it, as for ``ddp_driver.py``), then
for each family in turn trains ``bench.launches.run_args(family, OUT/family, UPDATES)`` counted by
``bench.launches.count_run`` and prints the report as ``bench.launches``' child does (``MARKER`` and one JSON object),
with the process's rank and the family added. One launch for every family instead of one each: each process
imports torch and the trainer once. ``reports`` reads them back.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.launches import MARKER, count_run, run_args  # noqa: E402


def reports(output: str, families: tuple[str, ...], processes: int) -> dict[str, list[dict[str, Any]]]:
    """Per family, the reports of a launch's processes by rank; a ValueError when one is missing."""
    decoder = json.JSONDecoder()
    found: dict[str, list[dict[str, Any]]] = {family: [] for family in families}
    # the processes share one pipe, so two reports may share a line: read one JSON object after each marker
    for part in output.split(MARKER)[1:]:
        report = decoder.raw_decode(part)[0]
        found[report["family"]].append(report)
    for family, ranks in found.items():
        ranks.sort(key=lambda report: report["rank"])
        if [report["rank"] for report in ranks] != list(range(processes)):
            raise ValueError(f"{family}: expected the reports of {processes} processes, got ranks "
                             f"{[report['rank'] for report in ranks]}")
    return found


def main() -> None:
    import torch.distributed as dist

    import library.runtime.processes  # noqa: F401  (before the group exists: its torch.distributed.nn import)

    dist.init_process_group("gloo")
    out, updates, families = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    for family in families:
        report = count_run(family, run_args(family, out / family, updates))
        print(MARKER + json.dumps({**report, "rank": dist.get_rank(), "family": family}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
