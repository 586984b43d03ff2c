"""End to end: one run per output name (lock), permissions, names that escape --output_dir, cleanup at start."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys

import pytest

import train_network
from library.families import model_setup
from library.train.batch_loss import BatchLoss
from tests.e2e.test_train_network import SAMPLES, train_args
from tests.unit.base.test_files import HOLDER


def _no_model(monkeypatch):
    monkeypatch.setattr(model_setup, "load_model", lambda *a, **k: pytest.fail("the model loaded"))


@pytest.mark.skipif(sys.platform == "win32", reason="the holder uses fcntl")
def test_a_second_run_on_the_same_output_stops_before_loading(tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(out / "lora.lock")], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        _no_model(monkeypatch)
        assert train_network.main(train_args(out)) == 2
        err = capsys.readouterr().err
        assert f"process {holder.pid}" in err and "lora.lock" in err
    finally:
        holder.kill()
        holder.wait()


def test_stale_lock_is_taken_over_and_the_lock_is_gone_after_the_run(tmp_path, caplog):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    tmp_path.joinpath("lora.lock").write_text(f"{dead.pid}\n")
    assert train_network.main(train_args(tmp_path, "--max_train_steps", "1")) == 0
    assert f"left by process {dead.pid}" in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lora.safetensors"]


def test_the_lock_is_released_on_interrupt_and_on_error(tmp_path, monkeypatch, capsys):
    def interrupted(self, batch):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(BatchLoss, "__call__", interrupted)
        assert train_network.main(train_args(tmp_path / "a")) == 130
        # Ctrl-C at the first step: no checkpoint exists to be "intact"; a LoRA from before the run is named
        assert capsys.readouterr().err.splitlines()[-1] == "interrupted: nothing was saved by this run"
        assert not (tmp_path / "a").exists()  # the run created it and left it empty: removed with the lock
        (tmp_path / "a").mkdir()
        (tmp_path / "a" / "lora.safetensors").write_bytes(b"an earlier run's file")
        assert train_network.main(train_args(tmp_path / "a")) == 130
        assert capsys.readouterr().err.splitlines()[-1] == (
            f"interrupted: nothing was saved by this run; {tmp_path / 'a' / 'lora.safetensors'} from before this "
            "run is left as it was")
    assert not (tmp_path / "a" / "lora.lock").exists()
    args = train_args(tmp_path / "b")
    args[1] = str(tmp_path / "missing.safetensors")  # fails while loading, after the lock was taken
    assert train_network.main(args) == 2
    assert not (tmp_path / "b").exists()  # created by the run, left empty: removed


def test_files_follow_the_umask(tmp_path):
    data = tmp_path / "data" / "1_two"
    data.mkdir(parents=True)
    for src in sorted((SAMPLES / "10_shapes").iterdir())[:2]:
        shutil.copy(src, data / src.name)
    old = os.umask(0o002)
    try:
        args = train_args(tmp_path / "out", "--max_train_steps", "1", "--train_batch_size", "1", "--save_state",
                          "--cache_latents_to_disk", data=tmp_path / "data")
        assert train_network.main(args) == 0
    finally:
        os.umask(old)

    def mode(path):
        return stat.S_IMODE(path.stat().st_mode)

    # before: 0600 for the LoRA (safetensors' save_file) and the caches (mkstemp)
    assert mode(tmp_path / "out" / "lora.safetensors") == 0o664
    assert {mode(p) for p in (tmp_path / "out" / "lora-state").iterdir()} == {0o664}
    assert mode(tmp_path / "out" / "lora-state") == 0o775
    caches = list(data.glob("*.npz"))
    assert caches and {mode(p) for p in caches} == {0o664}


@pytest.mark.parametrize("name", ["../escaped", "sub/lora", "..", "a\\b"])
def test_output_names_that_leave_the_output_dir_are_refused(tmp_path, capsys, monkeypatch, name):
    _no_model(monkeypatch)
    args = train_args(tmp_path / "out")
    args[args.index("--output_name") + 1] = name
    assert train_network.main(args) == 2
    assert "--output_name" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_an_unwritable_output_dir_stops_before_loading(tmp_path, capsys, monkeypatch):
    (tmp_path / "file").write_text("not a folder")
    _no_model(monkeypatch)
    assert train_network.main(train_args(tmp_path / "file" / "out")) == 2
    assert "--output_dir" in capsys.readouterr().err


def test_leftovers_of_interrupted_saves_are_cleaned_at_start(tmp_path):
    (tmp_path / "lora-step00000002-state.tmp").mkdir()  # earlier versions' fixed name
    (tmp_path / "lora-state.tmp-77-0badcafe").mkdir()
    (tmp_path / "lora.safetensors.tmp-77-0badcafe").write_bytes(b"half")
    (tmp_path / "keep-state.tmp-77-0badcafe").mkdir()  # another output name
    assert train_network.main(train_args(tmp_path, "--max_train_steps", "1")) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep-state.tmp-77-0badcafe", "lora.safetensors"]
