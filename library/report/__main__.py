"""``python -m library.report LOGDIR [--samples DIR] [--prompts FILE] [--out PNG]``: see ``library/report/cli.py``."""

from __future__ import annotations

import sys

from library.report.cli import main

if __name__ == "__main__":
    sys.exit(main())
