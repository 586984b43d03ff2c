"""The report's matplotlib figure: loss (training, moving average, validation), learning rate, gradient norm and the
sample grid, sharing one integer step axis with the epoch boundaries (and a resume) marked.

* training loss per update (``loss/current``, thin) and its moving average (``loss/average``; an exponential
  smoothing, as TensorBoard's slider at 0.9, when a log has no such tag), with the validation loss
  (``loss/validation/step_average`` as a line, ``loss/validation/epoch_average`` as points at the last update of
  their epoch);
* learning rate per group (``lr/<group>``), each group its own line style, a group equal to an earlier one says so
  in the legend; for D-Adaptation / Prodigy the step size they apply (``lr/d*lr/<group>``); a log scale when they
  are far apart;
* gradient norm (``grad_norm``, before clipping).

Few points (a one-step log) are drawn as markers, and the step axis then spans at least one step either side.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from library.report.logs import RunLog, Series, run_name
from library.report.samples import THUMB, SampleGrid, row_labels, sheet_image

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from library.sampling.prompts import SamplePrompt

MARKERS_BELOW = 50  # series with fewer points get markers
LINE_STYLES = ("-", "--", ":", "-.")


def smooth(values: list[float], weight: float = 0.9) -> list[float]:
    """TensorBoard's smoothing: an exponential moving average, debiased at the start."""
    out, last, norm = [], 0.0, 0.0
    for value in values:
        last = last * weight + (1 - weight) * value
        norm = norm * weight + (1 - weight)
        out.append(last / norm)
    return out


def _marker(series: Series) -> str | None:
    return "." if len(series.steps) < MARKERS_BELOW else None


def _loss_panel(ax: Axes, scalars: dict[str, Series]) -> None:
    current = scalars.get("loss/current")
    if current is not None:
        ax.plot(current.steps, current.values, color="tab:blue", alpha=0.3, lw=0.8, marker=_marker(current),
                label="training loss")
        average = scalars.get("loss/average")
        shown = average if average is not None else Series(current.steps, current.walls, smooth(current.values))
        ax.plot(shown.steps, shown.values, color="tab:blue", lw=1.8, marker=_marker(shown),
                label="moving average" if average is not None else "smoothed (EMA 0.9)")
    val_step = scalars.get("loss/validation/step_average")
    if val_step is not None:
        ax.plot(val_step.steps, val_step.values, color="tab:orange", lw=1.8, marker=_marker(val_step),
                label="validation loss")
    val_epoch = scalars.get("loss/validation/epoch_average")
    if val_epoch is not None:
        ax.plot(val_epoch.steps, val_epoch.values, "D", color="tab:red", ms=6, label="validation loss, end of epoch")
    _finish(ax, "loss", current is None and val_step is None)


def _lr_panel(ax: Axes, scalars: dict[str, Series]) -> None:
    tags = sorted(t for t in scalars if t.startswith("lr/"))
    for i, tag in enumerate(tags):
        series = scalars[tag]
        label = tag.removeprefix("lr/")
        same = [t.removeprefix("lr/") for t in tags[:i] if scalars[t].steps == series.steps
                and scalars[t].values == series.values]
        if same:
            label += f" (= {same[0]})"
        ax.plot(series.steps, series.values, ls=LINE_STYLES[i % len(LINE_STYLES)], lw=2.6 if i == 0 else 1.4,
                marker=_marker(series), label=label)
    values = [v for t in tags for v in scalars[t].values if v > 0]
    if values and max(values) / min(values) > 100:
        ax.set_yscale("log")
    _finish(ax, "learning rate", not tags)


def _grad_panel(ax: Axes, scalars: dict[str, Series]) -> None:
    grad = scalars.get("grad_norm")
    if grad is not None:
        ax.plot(grad.steps, grad.values, color="tab:green", lw=1.2, marker=_marker(grad), label="grad norm")
    _finish(ax, "gradient norm", grad is None)
    ax.set_xlabel("optimizer step")


def _finish(ax: Axes, title: str, empty: bool) -> None:
    ax.set_title(title, fontsize=10, loc="left")
    ax.grid(alpha=0.3)
    if empty:
        ax.text(0.5, 0.5, "not logged", transform=ax.transAxes, ha="center", va="center", color="grey")
    else:
        ax.legend(fontsize=8, loc="upper right")


def _step_axis(axes: list[Axes], run: RunLog) -> None:
    """Integer ticks; at least one step either side of a lone step; epoch boundaries and resumes marked."""
    from matplotlib.ticker import MaxNLocator

    steps = [s for series in run.scalars.values() for s in series.steps]
    if steps:
        low, high = min(steps), max(steps)
        if high - low < 2:
            axes[0].set_xlim(low - 1, high + 1)
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    last = max(steps, default=0)
    for epoch, step in run.epochs:
        if step >= last:
            continue  # the end of training, not a boundary
        for ax in axes:
            ax.axvline(step + 0.5, color="grey", lw=0.8, ls=":", zorder=0)
        axes[0].text(step + 0.5, 1.0, f" epoch {epoch} ", transform=axes[0].get_xaxis_transform(), fontsize=7,
                     color="grey", ha="right", va="top")
    for step in run.resumed_at:
        for ax in axes:
            ax.axvline(step - 0.5, color="tab:purple", lw=1.0, ls="--", zorder=0)
        axes[0].text(step - 0.5, 0.0, f" resumed at step {step}", transform=axes[0].get_xaxis_transform(),
                     fontsize=7, color="tab:purple", ha="left", va="bottom")


def _grid_panel(ax: Axes, grid: SampleGrid, prompts: list[SamplePrompt] | None, sampler: str | None) -> None:
    sheet, blank = sheet_image(grid)
    ax.imshow(sheet)
    ax.set_xticks([THUMB * (c + 0.5) for c in range(len(grid.columns))], grid.columns, fontsize=8)
    ax.set_yticks([THUMB * (r + 0.5) for r in range(len(grid.rows))], row_labels(grid, prompts, sampler), fontsize=7)
    ax.xaxis.tick_top()
    ax.tick_params(length=0)
    for r, c in sorted(blank):
        ax.text(THUMB * (c + 0.5), THUMB * (r + 0.5), "blank\n(NaN?)", ha="center", va="center", fontsize=8,
                color="red", fontweight="bold", bbox={"facecolor": "white", "alpha": 0.7, "lw": 0})
    title = "sample images (rows: prompts, columns: checkpoints)"
    if grid.omitted:
        title += f"; {len(grid.omitted)} more prompts not shown ({_ranges(grid.omitted)}; --max_rows)"
    ax.set_title(title, fontsize=10, loc="left")


def _ranges(numbers: list[int]) -> str:
    """``[8, 9, 10, 12]`` -> ``"8-10, 12"``."""
    spans: list[list[int]] = []
    for n in numbers:
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def headline(run: RunLog) -> str:
    """The figure's title: run name, resumes, steps, the loss (the last moving average, else the last step's; each
    labelled as what it is) and validation loss."""
    import math

    parts = [f"run {run.name}"]
    if run.resumed_at:
        text = "resumed at step " + ", ".join(str(s) for s in run.resumed_at)
        if len(run.folders) > 1:
            text += f" (logs {' + '.join(run_name(f) for f in run.folders)})"
        parts.append(text)
    current = run.scalars.get("loss/current")
    if current is not None and current.steps:
        parts.append(f"{current.steps[-1]} step" + ("s" if current.steps[-1] != 1 else ""))
        average = run.scalars.get("loss/average")  # sd-scripts' moving average over an epoch's steps
        last = (average or current).values[-1]
        if math.isfinite(last):
            parts.append(f"{'avg loss (moving average)' if average else 'loss (last step)'} {last:.4f}")
    for tag in ("loss/validation/epoch_average", "loss/validation/step_average"):
        if tag in run.scalars:
            parts.append(f"validation loss {run.scalars[tag].values[-1]:.4f}")
            break
    return ", ".join(parts)


def make_figure(run: RunLog, grid: SampleGrid | None, prompts: list[SamplePrompt] | None = None,
                sampler: str | None = None) -> Figure:
    """The report figure (matplotlib, Agg); panels in order: loss, learning rate, gradient norm[, samples]."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heights = [3.0, 1.6, 1.6] + ([len(grid.rows) * min(1.5, 9.0 / len(grid.columns)) + 0.6] if grid else [])
    fig = plt.figure(figsize=(10, sum(heights) + 1.0), dpi=100, layout="constrained")
    spec = fig.add_gridspec(len(heights), 1, height_ratios=heights)
    loss_ax = fig.add_subplot(spec[0])
    lr_ax = fig.add_subplot(spec[1], sharex=loss_ax)
    norm_ax = fig.add_subplot(spec[2], sharex=loss_ax)
    _loss_panel(loss_ax, run.scalars)
    _lr_panel(lr_ax, run.scalars)
    _grad_panel(norm_ax, run.scalars)
    _step_axis([loss_ax, lr_ax, norm_ax], run)
    if grid is not None:
        _grid_panel(fig.add_subplot(spec[3]), grid, prompts, sampler)
    fig.suptitle(headline(run), fontsize=11)
    return fig
