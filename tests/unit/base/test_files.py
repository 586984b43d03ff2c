"""Atomic files and folders, the state tree encoding, the output lock and the cleanup after interrupted saves."""

from __future__ import annotations

import os
import random
import stat
import subprocess
import sys

import pytest
import torch

from library.base import files
from library.base.errors import UserError
from library.runtime.output import OutputLock, clean_interrupted
from library.saving.lora_files import OutputNames
from library.saving.state_file import decode, encode


def _tree(folder):
    return {p.name: p.read_text() for p in sorted(folder.iterdir())}


def _fill(text):
    def fill(tmp):
        (tmp / "a.txt").write_text(text)
    return fill


def test_replace_folder_swaps_and_leaves_nothing_else(tmp_path):
    final = tmp_path / "lora-state"
    files.replace_folder(final, _fill("old"))
    files.replace_folder(final, _fill("new"))
    assert _tree(final) == {"a.txt": "new"}
    assert [p.name for p in tmp_path.iterdir()] == ["lora-state"]


def test_an_interrupted_fill_keeps_the_old_folder(tmp_path):
    final = tmp_path / "lora-state"
    files.replace_folder(final, _fill("old"))

    def interrupted(tmp):
        (tmp / "a.txt").write_text("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        files.replace_folder(final, interrupted)
    assert _tree(final) == {"a.txt": "old"}
    assert [p.name for p in tmp_path.iterdir()] == ["lora-state"]


def test_a_signal_between_the_two_renames_loses_nothing(tmp_path, monkeypatch):
    """Before: rmtree(old) then rename(new), so a signal in between lost both. Now the old one is moved aside and
    put back, in the same run when it can, else by the cleanup of the next run."""
    final = tmp_path / "lora-state"
    files.replace_folder(final, _fill("old"))
    real = os.replace
    calls = []

    def second_rename_interrupted(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real(src, dst)

    monkeypatch.setattr(files.os, "replace", second_rename_interrupted)
    with pytest.raises(KeyboardInterrupt):
        files.replace_folder(final, _fill("new"))
    monkeypatch.setattr(files.os, "replace", real)
    assert _tree(final) == {"a.txt": "old"}


def test_cleanup_restores_a_folder_left_aside_and_removes_temporaries(tmp_path):
    names = OutputNames("lora")
    (tmp_path / "lora-state.old-123-0a1b2c3d").mkdir()
    (tmp_path / "lora-state.old-123-0a1b2c3d" / "a.txt").write_text("previous")
    (tmp_path / "lora-state.tmp-123-0a1b2c3d").mkdir()
    (tmp_path / "lora-step00000004-state.tmp").mkdir()  # the fixed name of earlier versions
    (tmp_path / "lora-000002.safetensors.tmp-9-ffffffff").write_bytes(b"half")
    (tmp_path / "lora-step00000002-state.del-9-ffffffff").mkdir()
    (tmp_path / "other-state.tmp-1-abcdef12").mkdir()  # another output name: not ours to touch
    (tmp_path / "lora.safetensors").write_bytes(b"kept")
    clean_interrupted(tmp_path, names.owns)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lora-state", "lora.safetensors",
                                                         "other-state.tmp-1-abcdef12"]
    assert (tmp_path / "lora-state" / "a.txt").read_text() == "previous"


def test_unnamed_outputs_own_the_default_stems():
    names = OutputNames(None)
    assert all(names.owns(n) for n in ("epoch-000001.safetensors", "at-step00000010-state", "last.ckpt",
                                       "last-state"))
    assert not any(names.owns(n) for n in ("lora.safetensors", "epoch-1.safetensors", "last.txt", "last"))


def test_created_files_follow_the_umask(tmp_path):
    old = os.umask(0o002)
    try:
        files.write_bytes_atomic(tmp_path / "x.bin", b"data")
        files.replace_folder(tmp_path / "f", _fill("x"))
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "x.bin").stat().st_mode) == 0o664
    assert stat.S_IMODE((tmp_path / "f").stat().st_mode) == 0o775


def test_state_tree_round_trip():
    random.seed(3)
    objects = {"optimizer": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(2, 3)}},
                             "param_groups": [{"lr": 1e-4, "betas": (0.9, 0.999), "params": [0], "foreach": None,
                                               "nan": float("inf")}]},
               "python": random.getstate(), "dtype": torch.bfloat16, "device": torch.device("cpu"),
               "tricky": {"__tensor__": "not a reference"}}
    tree, tensors = encode(objects)
    import json

    back = decode(json.loads(json.dumps(tree)), tensors)
    assert back["optimizer"]["param_groups"] == objects["optimizer"]["param_groups"]
    assert torch.equal(back["optimizer"]["state"][0]["exp_avg"], objects["optimizer"]["state"][0]["exp_avg"])
    assert back["python"] == objects["python"] and back["dtype"] is torch.bfloat16
    assert back["device"] == torch.device("cpu") and back["tricky"] == {"__tensor__": "not a reference"}


def test_unstorable_objects_are_named():
    from library.saving.state_file import StateFormatError

    with pytest.raises(StateFormatError, match=r"state\.scheduler\.lr_lambdas\[0\] is a function"):
        encode({"scheduler": {"lr_lambdas": [lambda step: 1.0]}})


HOLDER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, str(os.getpid()).encode())
print("ready", flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(sys.platform == "win32", reason="the holder uses fcntl")
def test_a_held_lock_names_its_holder(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / "lora.lock")], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        with pytest.raises(UserError, match=rf"another run is writing there \(process {holder.pid}"):
            OutputLock.acquire(tmp_path, "lora")
    finally:
        holder.kill()
        holder.wait()
    lock = OutputLock.acquire(tmp_path, "lora")  # the OS dropped the dead holder's lock
    assert (tmp_path / "lora.lock").read_text().strip() == str(os.getpid())
    lock.release()
    assert not (tmp_path / "lora.lock").exists()


def test_a_stale_lock_file_is_taken_over(tmp_path, caplog):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / "lora.lock").write_text(f"{dead.pid}\n")
    with OutputLock.acquire(tmp_path, "lora"):
        assert f"left by process {dead.pid}" in caplog.text
    assert not (tmp_path / "lora.lock").exists()
