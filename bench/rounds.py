"""What the interleaved rounds of a side-by-side bench collect (``bench/flux_finetune_vs_upstream.py``,
``bench/anima_vs_upstream.py``): each (side, row)'s child reports, a line per failed run, and the precision lines
of the first round's runs; each run is printed as it ends."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from vs_upstream import load_average

PRECISION_LINE = re.compile(r"bf16|bfloat16|dtype|precision|stochastic", re.IGNORECASE)


def precision_lines(log: Path, limit: int = 6) -> list[str]:
    """The log lines of a run that say which dtypes it trains in (at most ``limit``)."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines()
             if PRECISION_LINE.search(line) and '"stamps"' not in line]
    return [line[:220] for line in lines[:limit]]


class RoundResults:
    """The reports of the runs so far (``runs[(side, row)]``), the failures and the precision lines."""

    def __init__(self, seconds: Callable[[dict], float]):
        self.seconds = seconds  # a report's s/step
        self.runs: dict[tuple[str, str], list[dict]] = {}
        self.failures: list[str] = []
        self.precisions: dict[tuple[str, str], list[str]] = {}

    def add(self, round_index: int, row: str, side: str, report: dict, log: Path) -> None:
        """Record one run's ``report`` (``{"error": ...}`` for a failed run) and print its line; ``log``: its log."""
        if round_index == 0:
            self.precisions[(side, row)] = precision_lines(log)
        if "error" in report:
            print(f"round {round_index + 1} {row} {side}: FAILED: {report['error']} (log {log})", flush=True)
            self.failures.append(f"round {round_index + 1}, {row}, {side}: `{report['error']}`")
            return
        report["load_after"] = load_average()
        self.runs.setdefault((side, row), []).append(report)
        print(f"round {round_index + 1} {row} {side}: {self.seconds(report):.2f} s/step, "
              f"peak RSS {report['peak_rss_at_last_step_bytes'] / 2**30:.2f} GiB (with the save "
              f"{report['peak_rss_bytes'] / 2**30:.2f}), load {report['load']} -> {report['load_after']}, "
              f"{report['wall']:.0f} s", flush=True)

    def results(self) -> tuple[dict, list, dict]:
        return self.runs, self.failures, self.precisions
