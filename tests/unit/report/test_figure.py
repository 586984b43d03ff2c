"""library/report/figure.py: what the panels plot (read back from the matplotlib figure), the step axis, epoch
boundaries, the learning-rate lines, the sample grid's labels and marks."""

from __future__ import annotations

import matplotlib
import pytest
from PIL import Image

from library.report.figure import make_figure
from library.report.logs import RunLog, Series
from library.report.samples import THUMB, collect_samples

matplotlib.use("Agg")


def series(steps: list[int], values: list[float]) -> Series:
    return Series(list(steps), [1000.0 + s for s in steps], list(values))


def run_of(scalars: dict[str, Series], epochs=(), resumed=()) -> RunLog:
    return RunLog("20261201100000", [], scalars, list(epochs), list(resumed))


def close(fig) -> None:
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_a_one_step_log_draws_points_and_integer_ticks():
    fig = make_figure(run_of({"loss/current": series([1], [0.5]), "loss/average": series([1], [0.5]),
                              "grad_norm": series([1], [2.0]), "lr/unet": series([1], [1e-3])}), None)
    loss_ax, lr_ax, norm_ax = fig.axes[:3]
    for ax in (loss_ax, lr_ax, norm_ax):
        drawn = [line for line in ax.get_lines() if list(line.get_xdata()) == [1]]
        assert drawn and all(line.get_marker() not in (None, "None", "") for line in drawn)  # visible, not empty
    low, high = norm_ax.get_xlim()
    assert low <= 0 and high >= 2
    ticks = [t for t in norm_ax.get_xticks() if low <= t <= high]
    assert ticks and all(float(t).is_integer() for t in ticks)  # not 0.96 ... 1.04
    close(fig)


def test_step_ticks_are_integers_on_a_short_run():
    fig = make_figure(run_of({"loss/current": series([1, 2, 3], [3.0, 2.0, 1.0])}), None)
    ax = fig.axes[2]
    fig.canvas.draw()
    low, high = ax.get_xlim()
    ticks = [t for t in ax.get_xticks() if low <= t <= high]
    assert len(ticks) >= 2 and all(float(t).is_integer() for t in ticks)
    close(fig)


def test_epoch_boundaries_and_a_resume_are_marked_on_every_panel():
    steps = list(range(1, 31))
    fig = make_figure(run_of({"loss/current": series(steps, [1.0] * 30)}, epochs=[(1, 15), (2, 30)], resumed=[11]),
                      None)
    for ax in fig.axes[:3]:
        vertical = sorted(line.get_xdata()[0] for line in ax.get_lines() if len(set(line.get_xdata())) == 1
                          and len(line.get_xdata()) == 2)
        assert vertical == [10.5, 15.5]  # the resume before step 11, the end of epoch 1 (the run's end is no line)
    texts = [t.get_text().strip() for t in fig.axes[0].texts]
    assert "epoch 1" in texts and "resumed at step 11" in texts
    close(fig)


def test_equal_text_encoder_and_unet_learning_rates_stay_distinguishable():
    same = series([1, 2, 3], [1e-4, 2e-4, 1e-4])
    fig = make_figure(run_of({"lr/textencoder": same, "lr/unet": series(same.steps, same.values)}), None)
    lines = fig.axes[1].get_lines()
    assert [line.get_label() for line in lines] == ["textencoder", "unet (= textencoder)"]
    assert lines[0].get_linestyle() != lines[1].get_linestyle()
    assert lines[0].get_linewidth() > lines[1].get_linewidth()  # the first one shows around the second
    legend = [t.get_text() for t in fig.axes[1].get_legend().get_texts()]
    assert legend == ["textencoder", "unet (= textencoder)"]
    close(fig)


def write(folder, name, size=(32, 32), blank=False):
    folder.mkdir(parents=True, exist_ok=True)
    img = Image.new("RGB", size, (0, 0, 0))
    if not blank:
        img.putpixel((0, 0), (255, 0, 0))
    img.save(folder / name)


def test_sample_rows_are_labelled_with_prompt_sampler_seed_and_size(tmp_path):
    from library.sampling.prompts import load_prompt_file

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("shapes, a red circle on a white background with a long description --w 64 --h 64 --d 7\n"
                       "a blue square --w 96 --h 64 --ss euler_a\n")
    write(tmp_path / "s", "x_e000000_00_20261201100000_7.png", (64, 64))
    write(tmp_path / "s", "x_e000000_01_20261201100000.png", (96, 64))
    grid = collect_samples(tmp_path / "s")
    fig = make_figure(run_of({"loss/current": series([1], [1.0])}), grid, load_prompt_file(prompts), "ddim")
    labels = [t.get_text() for t in fig.axes[3].get_yticklabels()]
    assert labels == ["0: shapes, a red circle on a white…\nddim, seed 7, 64×64",
                      "1: a blue square\neuler_a, random seed, 96×64"]
    close(fig)


def test_non_square_samples_keep_their_aspect(tmp_path):
    from library.report.samples import sheet_image

    folder = tmp_path / "s"
    folder.mkdir()
    Image.new("RGB", (96, 48), (255, 0, 0)).save(folder / "x_000001_00_20261201100000.png")
    sheet, _ = sheet_image(collect_samples(folder))
    assert sheet.size == (THUMB, THUMB)
    red = [(x, y) for x in range(THUMB) for y in range(THUMB) if sheet.getpixel((x, y)) == (255, 0, 0)]
    xs, ys = {x for x, _ in red}, {y for _, y in red}
    assert (max(xs) - min(xs) + 1, max(ys) - min(ys) + 1) == (THUMB, THUMB // 2)  # 2:1, centred
    assert min(ys) == THUMB // 4


@pytest.mark.parametrize(("prompts", "max_rows", "shown"), [(10, 16, 10), (20, 16, 16)])
def test_more_than_eight_prompts_are_drawn_or_named(tmp_path, prompts, max_rows, shown):
    for index in range(prompts):
        write(tmp_path, f"x_000001_{index:02d}_20261201100000.png")
    grid = collect_samples(tmp_path, max_rows=max_rows)
    assert grid.rows == list(range(shown))
    assert grid.omitted == list(range(shown, prompts))
    fig = make_figure(run_of({"loss/current": series([1], [1.0])}), grid)
    title = fig.axes[3].get_title(loc="left")
    assert ("4 more prompts not shown (16-19" in title) == (prompts > max_rows)
    close(fig)


def test_a_blank_nan_sample_is_marked(tmp_path):
    write(tmp_path, "x_000001_00_20261201100000.png")
    write(tmp_path, "x_000001_01_20261201100000.png", blank=True)  # a NaN sample decodes to black
    fig = make_figure(run_of({"loss/current": series([1], [1.0])}), collect_samples(tmp_path))
    marks = [(t.get_position(), t.get_text()) for t in fig.axes[3].texts]
    assert marks == [((THUMB * 0.5, THUMB * 1.5), "blank\n(NaN?)")]
    close(fig)


def test_the_title_labels_its_loss_as_what_it_is():
    from library.report.figure import headline

    current, average = series([1, 2], [0.9, 0.5]), series([1, 2], [0.9, 0.7])
    assert headline(run_of({"loss/current": current, "loss/average": average})) == \
        "run 20261201100000, 2 steps, avg loss (moving average) 0.7000"
    assert headline(run_of({"loss/current": current})) == "run 20261201100000, 2 steps, loss (last step) 0.5000"
