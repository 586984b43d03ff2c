"""bench/finetune_vs_upstream.py's pure parts: the update intervals from LR-schedule stamps and the table's ratios."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))

import finetune_vs_upstream as bench  # noqa: E402

GIB = 2**30


def report(stamps: list[float], peak_gib: float) -> dict:
    return {"stamps": stamps, "peak_rss_at_last_step_bytes": peak_gib * GIB}


def test_step_seconds_skips_the_schedules_creation_and_the_warmup():
    # creation at 0; updates at 10, 30 (warm-up), then 33, 36, 40: timed intervals 3, 3, 4 after 2 warm-up updates
    assert bench.step_seconds(report([0, 10, 30, 33, 36, 40], 1), warmup=2) == 3
    assert bench.step_seconds(report([0, 10, 30, 33, 36, 40], 1), warmup=1) == 3.5  # 20, 3, 3, 4


def test_table_gives_each_row_against_its_upstream_row_and_upstreams_mixed_adamw():
    stamps = [0, 1, 2, 4, 6]
    runs = {("ours", row): [report(stamps, 5.0)] for row in bench.ROWS}
    runs[("upstream", "mixed bf16, AdamW")] = [report(stamps, 10.0)]
    runs[("upstream", "--full_bf16, Adafactor")] = [report(stamps, 8.0)]
    lines = bench.table(runs, warmup=1).splitlines()[2:]
    assert lines[0] == "| mixed bf16, AdamW | 2.00 | 2.00 | 5.00 | 10.00 | **0.50×** | **0.50×** |"
    assert lines[1] == "| --full_bf16, Adafactor | 2.00 | 2.00 | 5.00 | 8.00 | **0.62×** | **0.50×** |"
    assert lines[2].endswith("| 5.00 | — | — | **0.50×** |") and len(lines) == len(bench.ROWS)
