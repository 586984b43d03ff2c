"""One picture of a training run, for looking rather than reading: loss, validation loss, learning rate, grad norm,
epoch boundaries and the sample images.

    .venv/bin/python -m library.report output/demo/logs --samples output/demo/sample \\
        --prompts configs/demo_prompts.txt --out output/demo/report.png

LOGDIR is a ``--logging_dir`` (its newest run is drawn, joined to the runs it resumed), or one run folder. Both this
trainer's layout (``<logging_dir>/<prefix><timestamp>/``) and sd-scripts' (``.../<timestamp>/network_train/``) are
read (``library/report/logs.py``). ``--samples`` is ``<output_dir>/sample``; ``--prompts`` the run's
``--sample_prompts`` file, to label the rows with the prompts (``library/report/samples.py``); ``--sampler`` its
``--sample_sampler`` (default ddim, as the trainer's). Prints the path of the PNG. ``python -m bench.report`` is the
same command.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from library.report.samples import collect_samples


def build_report(log_dir: Path, samples: Path | None = None, out: Path | None = None, max_columns: int = 8,
                 prompts: Path | None = None, sampler: str | None = "ddim", max_rows: int = 16) -> Path:
    """Draw the report of the run in ``log_dir``; returns the PNG written (default ``<run folder>/report.png``)."""
    import matplotlib.pyplot as plt

    from library.report.figure import make_figure
    from library.report.logs import read_run

    run = read_run(log_dir)
    grid = collect_samples(samples, max_columns, max_rows) if samples is not None else None
    prompt_list = None
    if prompts is not None:
        from library.sampling.prompts import load_prompt_file

        prompt_list = load_prompt_file(prompts)
    if grid is not None and grid.omitted:
        print(f"{samples}: {len(grid.omitted)} prompts not drawn (at most --max_rows {max_rows})", file=sys.stderr)
    fig = make_figure(run, grid, prompt_list, sampler)
    out = out or run.folders[-1] / "report.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, bbox_inches="tight")
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit code (2 with a message for a bad prompt file)."""
    from library.base.errors import UserError

    parser = argparse.ArgumentParser(prog="python -m library.report", description=__doc__.splitlines()[0])
    parser.add_argument("log_dir", type=Path, help="a --logging_dir, or one run folder inside it")
    parser.add_argument("--samples", type=Path, help="the run's sample folder (<output_dir>/sample)")
    parser.add_argument("--prompts", type=Path, help="the run's --sample_prompts file (labels the sample rows)")
    parser.add_argument("--sampler", default="ddim", help="the run's --sample_sampler (default: ddim)")
    parser.add_argument("--out", type=Path, help="PNG to write (default: <run folder>/report.png)")
    parser.add_argument("--max_columns", type=int, default=8, help="checkpoints shown in the sample grid")
    parser.add_argument("--max_rows", type=int, default=16, help="prompts shown in the sample grid")
    args = parser.parse_args(argv)
    try:
        print(build_report(args.log_dir, args.samples, args.out, max(2, args.max_columns), args.prompts,
                           args.sampler, max(1, args.max_rows)))
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0
