"""bench/rounds.py: a side-by-side bench's runs, failures and precision lines as the rounds go."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "bench"))

import rounds  # noqa: E402


def test_reports_failures_and_the_first_rounds_precision_lines(tmp_path, capsys):
    log = tmp_path / "run.log"
    log.write_text("INFO precision: DiT bf16\nsomething else\n" + '{"stamps": [1, 2]} bf16\n')
    collected = rounds.RoundResults(lambda report: report["seconds"])
    good = {"seconds": 1.5, "peak_rss_at_last_step_bytes": 2**30, "peak_rss_bytes": 2 * 2**30, "load": "1.0",
            "wall": 12.0}
    collected.add(0, "row", "ours", dict(good), log)
    collected.add(1, "row", "ours", {"error": "exit 1"}, log)
    collected.add(1, "row", "upstream", dict(good), log)
    runs, failures, precisions = collected.results()
    assert [r["seconds"] for r in runs[("ours", "row")]] == [1.5] and ("upstream", "row") in runs
    assert failures == ["round 2, row, ours: `exit 1`"]
    assert precisions == {("ours", "row"): ["INFO precision: DiT bf16"]}  # the first round's runs only
    printed = capsys.readouterr().out
    assert "round 1 row ours: 1.50 s/step, peak RSS 1.00 GiB (with the save 2.00)" in printed
    assert "round 2 row ours: FAILED: exit 1" in printed
