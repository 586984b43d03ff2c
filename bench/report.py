"""One picture of a training run, for looking rather than reading: loss, validation loss, learning rate, grad norm and
the sample images.

Reads the run's TensorBoard event files (``--logging_dir``; sd-scripts' tag names, so its logs work too) with
tensorboard's ``EventAccumulator`` and draws with matplotlib:

* training loss per update (``loss/current``, thin) and its moving average (``loss/average``; an exponential
  smoothing, as TensorBoard's slider at 0.9, when a log has no such tag), with the validation loss
  (``loss/validation/step_average`` as a line, ``loss/validation/epoch_average`` as points at the last update of
  their epoch, found by wall time because sd-scripts logs epoch values at the epoch number);
* learning rate per group (``lr/<group>``) and, for D-Adaptation / Prodigy, the step size they apply
  (``lr/d*lr/<group>``, dashed), on a log scale when they are far apart;
* gradient norm (``grad_norm``, before clipping);
* with ``--samples`` (``<output_dir>/sample``, sd-scripts' sample files
  ``<output_name>_<e000001|000001>_<NN>_<timestamp>[_<seed>].png``): a grid of the images, one row per prompt, one
  column per checkpoint in the order they were made (at most ``--max_columns``, evenly spaced, first and last kept).

    .venv/bin/python -m bench.report output/demo/logs --samples output/demo/sample --out output/demo/report.png

LOGDIR is a run folder with event files, or the ``--logging_dir`` above it (then its newest run is drawn). Prints
the path of the PNG.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

SAMPLE_NAME = re.compile(r"^(?:(?P<name>.+)_)?(?P<when>e?\d{6})_(?P<prompt>\d{2,})_(?P<stamp>\d{14})"
                         r"(?:_(?P<seed>\d+))?\.png$")
THUMB = 128


@dataclass
class Series:
    steps: list[int] = field(default_factory=list)
    walls: list[float] = field(default_factory=list)
    values: list[float] = field(default_factory=list)


@dataclass
class SampleGrid:
    """Sample images by (prompt row, checkpoint column); ``columns`` are labels in the order they were made."""

    columns: list[str]
    rows: list[int]
    images: dict[tuple[int, int], Path]


def find_run(log_dir: Path) -> Path:
    """``log_dir`` if it holds event files, else its newest subfolder that does."""
    if any(log_dir.glob("events.out.tfevents.*")):
        return log_dir
    runs = sorted(p for p in log_dir.iterdir() if p.is_dir() and any(p.glob("events.out.tfevents.*"))) \
        if log_dir.is_dir() else []
    if not runs:
        raise SystemExit(f"{log_dir}: no TensorBoard event files here or in a subfolder; pass the --logging_dir of a "
                         "run (or one run folder inside it)")
    return runs[-1]


def read_scalars(run_dir: Path) -> dict[str, Series]:
    """Every scalar of a run, all events kept (EventAccumulator samples by default)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    out: dict[str, Series] = {}
    for tag in events.Tags()["scalars"]:
        series = out.setdefault(tag, Series())
        for event in events.Scalars(tag):
            series.steps.append(event.step)
            series.walls.append(event.wall_time)
            series.values.append(event.value)
    return out


def smooth(values: list[float], weight: float = 0.9) -> list[float]:
    """TensorBoard's smoothing: an exponential moving average, debiased at the start."""
    out, last, norm = [], 0.0, 0.0
    for value in values:
        last = last * weight + (1 - weight) * value
        norm = norm * weight + (1 - weight)
        out.append(last / norm)
    return out


def at_update(epoch_series: Series, updates: Series) -> list[int]:
    """The update each epoch-logged value follows: the last update logged before it (by wall time)."""
    steps = []
    for wall in epoch_series.walls:
        before = [s for s, w in zip(updates.steps, updates.walls, strict=True) if w <= wall]
        steps.append(before[-1] if before else 0)
    return steps


def collect_samples(folder: Path, max_columns: int = 8, max_rows: int = 8) -> SampleGrid | None:
    """The sample images of ``folder`` as a grid, or None when it has none."""
    found: dict[str, dict[int, tuple[str, Path]]] = {}
    made: dict[str, str] = {}
    for path in sorted(folder.glob("*.png")) if folder.is_dir() else []:
        match = SAMPLE_NAME.match(path.name)
        if match is None:
            continue
        when, prompt, stamp = match["when"], int(match["prompt"]), match["stamp"]
        kept = found.setdefault(when, {})
        if prompt not in kept or stamp > kept[prompt][0]:  # a rerun into the same folder: the newest wins
            kept[prompt] = (stamp, path)
        made[when] = min(made.get(when, stamp), stamp)
    if not found:
        return None
    order = sorted(found, key=lambda w: (made[w], w))
    if len(order) > max_columns:
        picks = sorted({round(i * (len(order) - 1) / (max_columns - 1)) for i in range(max_columns)})
        order = [order[i] for i in picks]
    rows = sorted({p for w in order for p in found[w]})[:max_rows]
    images = {(r, c): found[w][p][1] for c, w in enumerate(order) for r, p in enumerate(rows) if p in found[w]}
    return SampleGrid([_label(w) for w in order], rows, images)


def _label(when: str) -> str:
    number = int(when.lstrip("e"))
    if number == 0:
        return "start"
    return f"epoch {number}" if when.startswith("e") else f"step {number}"


def _grid_image(grid: SampleGrid):
    from PIL import Image

    sheet = Image.new("RGB", (THUMB * len(grid.columns), THUMB * len(grid.rows)), (255, 255, 255))
    for (r, c), path in grid.images.items():
        with Image.open(path) as img:
            sheet.paste(img.convert("RGB").resize((THUMB, THUMB)), (c * THUMB, r * THUMB))
    return sheet


def draw(run_dir: Path, scalars: dict[str, Series], grid: SampleGrid | None, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heights = [3.0, 1.6, 1.6] + ([len(grid.rows) * min(1.5, 9.0 / len(grid.columns)) + 0.6] if grid else [])
    fig = plt.figure(figsize=(10, sum(heights) + 1.0), dpi=100, layout="constrained")
    spec = fig.add_gridspec(len(heights), 1, height_ratios=heights)
    loss_ax = fig.add_subplot(spec[0])
    lr_ax = fig.add_subplot(spec[1], sharex=loss_ax)
    norm_ax = fig.add_subplot(spec[2], sharex=loss_ax)

    current = scalars.get("loss/current")
    if current is not None:
        loss_ax.plot(current.steps, current.values, color="tab:blue", alpha=0.3, lw=0.8, label="training loss")
        average = scalars.get("loss/average")
        smoothed = average.values if average is not None else smooth(current.values)
        loss_ax.plot(average.steps if average is not None else current.steps, smoothed, color="tab:blue", lw=1.8,
                     label="moving average" if average is not None else "smoothed (EMA 0.9)")
    val_step = scalars.get("loss/validation/step_average")
    if val_step is not None:
        loss_ax.plot(val_step.steps, val_step.values, color="tab:orange", lw=1.8, marker="." if
                     len(val_step.steps) < 50 else None, label="validation loss")
    val_epoch = scalars.get("loss/validation/epoch_average")
    if val_epoch is not None and current is not None:
        loss_ax.plot(at_update(val_epoch, current), val_epoch.values, "D", color="tab:red", ms=6,
                     label="validation loss, end of epoch")
    _finish(loss_ax, "loss", current is None)

    lr_tags = sorted(t for t in scalars if t.startswith("lr/"))
    for tag in lr_tags:
        s = scalars[tag]
        lr_ax.plot(s.steps, s.values, ls="--" if tag.startswith("lr/d*lr/") else "-", lw=1.4,
                   label=tag.removeprefix("lr/"))
    values = [v for t in lr_tags for v in scalars[t].values if v > 0]
    if values and max(values) / min(values) > 100:
        lr_ax.set_yscale("log")
    _finish(lr_ax, "learning rate", not lr_tags)

    grad = scalars.get("grad_norm")
    if grad is not None:
        norm_ax.plot(grad.steps, grad.values, color="tab:green", lw=1.2, label="grad norm")
    _finish(norm_ax, "gradient norm", grad is None)
    norm_ax.set_xlabel("optimizer step")

    if grid is not None:
        grid_ax = fig.add_subplot(spec[3])
        grid_ax.imshow(_grid_image(grid))
        grid_ax.set_xticks([THUMB * (c + 0.5) for c in range(len(grid.columns))], grid.columns, fontsize=8)
        grid_ax.set_yticks([THUMB * (r + 0.5) for r in range(len(grid.rows))], [f"prompt {p}" for p in grid.rows],
                           fontsize=8)
        grid_ax.xaxis.tick_top()
        grid_ax.tick_params(length=0)
        grid_ax.set_title("sample images (rows: prompts, columns: checkpoints)", fontsize=10, loc="left")

    fig.suptitle(_headline(run_dir, scalars), fontsize=11)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, bbox_inches="tight")
    plt.close(fig)
    return out


def _finish(ax, title: str, empty: bool) -> None:
    ax.set_title(title, fontsize=10, loc="left")
    ax.grid(alpha=0.3)
    if empty:
        ax.text(0.5, 0.5, "not logged", transform=ax.transAxes, ha="center", va="center", color="grey")
    else:
        ax.legend(fontsize=8, loc="upper right")


def _headline(run_dir: Path, scalars: dict[str, Series]) -> str:
    parts = [f"run {run_dir.name}"]
    current = scalars.get("loss/current")
    if current is not None and current.steps:
        parts.append(f"{current.steps[-1]} steps")
        average = scalars.get("loss/average")
        last = (average or current).values[-1]
        if math.isfinite(last):
            parts.append(f"loss {last:.4f}")
    for tag in ("loss/validation/epoch_average", "loss/validation/step_average"):
        if tag in scalars:
            parts.append(f"validation loss {scalars[tag].values[-1]:.4f}")
            break
    return ", ".join(parts)


def build_report(log_dir: Path, samples: Path | None = None, out: Path | None = None,
                 max_columns: int = 8) -> Path:
    """Draw the report of the run in ``log_dir``; returns the PNG written (default ``<run folder>/report.png``)."""
    run_dir = find_run(log_dir)
    grid = collect_samples(samples, max_columns) if samples is not None else None
    return draw(run_dir, read_scalars(run_dir), grid, out or run_dir / "report.png")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log_dir", type=Path, help="a --logging_dir, or one run folder inside it")
    parser.add_argument("--samples", type=Path, help="the run's sample folder (<output_dir>/sample)")
    parser.add_argument("--out", type=Path, help="PNG to write (default: <run folder>/report.png)")
    parser.add_argument("--max_columns", type=int, default=8, help="checkpoints shown in the sample grid")
    args = parser.parse_args(argv)
    print(build_report(args.log_dir, args.samples, args.out, max(2, args.max_columns)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
