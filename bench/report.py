"""``python -m bench.report``: the same command as ``python -m library.report`` (``library/report/``), kept because
earlier READMEs and scripts call it by this name."""

from __future__ import annotations

import sys

from library.report.cli import build_report, main
from library.report.figure import make_figure, smooth
from library.report.logs import Series, at_update, read_run, read_scalars
from library.report.samples import SAMPLE_NAME, THUMB, SampleGrid, collect_samples

__all__ = ["SAMPLE_NAME", "THUMB", "SampleGrid", "Series", "at_update", "build_report", "collect_samples", "main",
           "make_figure", "read_run", "read_scalars", "smooth"]

if __name__ == "__main__":
    sys.exit(main())
