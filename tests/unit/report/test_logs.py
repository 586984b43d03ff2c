"""library/report/logs.py: sd-scripts' ``<timestamp>/network_train`` layout, resumed runs drawn as one continuous run
(two timestamp folders, or two event files in one), epoch values moved to their update."""

from __future__ import annotations

from pathlib import Path

import pytest

from library.report.cli import build_report
from library.report.figure import headline
from library.report.logs import read_run


def write_events(folder: Path, steps: range, offset: float = 0.0, wall0: float = 1_000_000.0, suffix: str = "",
                 epoch_every: int | None = None) -> None:
    """``loss/current`` = step + offset per step (one second apart), and ``loss/epoch_average`` at the epoch number
    after every ``epoch_every`` steps, as the trainer logs them."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(folder), filename_suffix=suffix)
    for step in steps:
        writer.add_scalar("loss/current", step + offset, step, walltime=wall0 + step)
        writer.add_scalar("lr/unet", 1e-3, step, walltime=wall0 + step)
        if epoch_every and step % epoch_every == 0:
            writer.add_scalar("loss/epoch_average", 0.5, step // epoch_every, walltime=wall0 + step + 0.5)
    writer.close()


def test_sd_scripts_layout_two_levels_down_is_found_and_named_after_the_timestamp(tmp_path):
    # sd-scripts: <logging_dir>/<log_prefix><YYYYmmddHHMMSS>/network_train/events.out.tfevents.*
    write_events(tmp_path / "logs" / "20261201100000" / "network_train", range(1, 6))
    write_events(tmp_path / "logs" / "20261201110000" / "network_train", range(1, 4))
    run = read_run(tmp_path / "logs")
    assert run.name == "20261201110000"
    assert run.scalars["loss/current"].steps == [1, 2, 3]
    assert run.resumed_at == []
    out = build_report(tmp_path / "logs", out=tmp_path / "r.png")
    assert out.is_file()
    # one run folder given directly: named after its timestamp folder, not "network_train"
    assert read_run(tmp_path / "logs" / "20261201100000" / "network_train").name == "20261201100000"


def test_no_event_files_is_one_clear_message(tmp_path):
    (tmp_path / "logs" / "20261201100000" / "network_train").mkdir(parents=True)
    with pytest.raises(SystemExit, match="network_train"):
        read_run(tmp_path / "logs")


@pytest.mark.parametrize("layout", ["two timestamp folders", "two event files", "sd-scripts folders"])
def test_a_resumed_run_is_one_continuous_run(tmp_path, layout):
    # the first run went to step 20 (state saved at 10), the resumed one continues at 11 to 30
    logs = tmp_path / "logs"
    if layout == "two timestamp folders":
        first, second = logs / "20261201100000", logs / "20261201110000"
    elif layout == "two event files":
        first = second = logs / "20261201100000"
    else:
        first, second = logs / "20261201100000" / "network_train", logs / "20261201110000" / "network_train"
    write_events(first, range(1, 21), offset=0.0, suffix=".a", epoch_every=10)
    write_events(second, range(11, 31), offset=100.0, wall0=2_000_000.0, suffix=".b", epoch_every=10)
    run = read_run(logs)
    loss = run.scalars["loss/current"]
    assert loss.steps == list(range(1, 31))  # no jump back, no repeated step
    assert loss.values == [float(s) for s in range(1, 11)] + [100.0 + s for s in range(11, 31)]  # newest per step
    assert run.resumed_at == [11]
    assert run.epochs == [(1, 10), (2, 20), (3, 30)]  # epoch 2 of the first run (after the state) dropped
    assert run.scalars["loss/epoch_average"].steps == [10, 20, 30]
    assert "resumed at step 11" in headline(run)
    assert run.name == "20261201110000" if layout != "two event files" else "20261201100000"


def test_an_unrelated_newer_run_is_not_joined(tmp_path):
    write_events(tmp_path / "logs" / "20261201100000", range(1, 6))
    write_events(tmp_path / "logs" / "20261201110000", range(20, 31))  # starts after a gap: not a resume of it
    write_events(tmp_path / "logs" / "other20261201090000", range(1, 40))  # another --log_prefix
    run = read_run(tmp_path / "logs")
    assert run.scalars["loss/current"].steps == list(range(20, 31))
    assert run.resumed_at == [] and len(run.folders) == 1
