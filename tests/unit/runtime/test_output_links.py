"""Links planted at names the trainer writes (``library/base/files.py``, ``library/runtime/output.py``) and output
names whose saves collide (``OutputNames.shares_names_with``)."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import pytest

from library.base import files
from library.base.errors import UserError
from library.config import LogConfig
from library.runtime import console_log
from library.runtime.output import OutputLock, open_output
from library.saving.lora_files import OutputNames
from library.train.tracking import make_log_folder

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="symbolic links need privileges on Windows")

PRECIOUS = b"precious\n"


@pytest.fixture
def victim_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "elsewhere"
    folder.mkdir()
    (folder / "keep.txt").write_bytes(PRECIOUS)
    return folder


def _fill(tmp: Path) -> None:
    (tmp / "a.txt").write_text("new")


def test_replace_folder_replaces_a_link_and_removes_it_as_a_link(tmp_path, victim_folder):
    final = tmp_path / "out" / "lora-state"
    final.parent.mkdir()
    final.symlink_to(victim_folder, target_is_directory=True)
    files.replace_folder(final, _fill)
    assert not final.is_symlink() and (final / "a.txt").read_text() == "new"
    assert sorted(p.name for p in final.parent.iterdir()) == ["lora-state"]  # before: a .old- link stayed
    assert (victim_folder / "keep.txt").read_bytes() == PRECIOUS


def test_replace_folder_over_a_dangling_link(tmp_path):
    final = tmp_path / "lora-state"
    final.symlink_to(tmp_path / "missing", target_is_directory=True)
    files.replace_folder(final, _fill)  # before: exists() said no, and renaming a folder over the link failed
    assert not final.is_symlink() and (final / "a.txt").read_text() == "new"
    assert not (tmp_path / "missing").exists()


def test_remove_folder_removes_a_link_not_its_target(tmp_path, victim_folder):
    link = tmp_path / "out" / "lora-000001-state"
    link.parent.mkdir()
    link.symlink_to(victim_folder, target_is_directory=True)
    files.remove_folder(link)
    assert list(link.parent.iterdir()) == []  # before: a .del- link stayed
    assert (victim_folder / "keep.txt").read_bytes() == PRECIOUS


def test_write_file_exclusive_never_writes_through_a_link(tmp_path):
    target, link = tmp_path / "target.toml", tmp_path / "new.toml"
    link.symlink_to(target)
    with pytest.raises(FileExistsError):
        files.write_file_exclusive(link, lambda f: f.write(b"x"))
    assert not target.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["new.toml"]
    files.write_file_exclusive(tmp_path / "fresh.toml", lambda f: f.write(b"y"))
    assert (tmp_path / "fresh.toml").read_bytes() == b"y"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fresh.toml", "new.toml"]


def test_open_no_follow_refuses_links_and_hard_links(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(PRECIOUS)
    (tmp_path / "soft").symlink_to(victim)
    os.link(victim, tmp_path / "hard")
    for name, why in (("soft", "is a symbolic link"), ("hard", "other hard link")):
        with pytest.raises(files.UnsafePath, match=why):
            files.open_no_follow(tmp_path / name, os.O_RDWR | os.O_CREAT)
    assert victim.read_bytes() == PRECIOUS


def test_a_hard_linked_console_log_file_is_refused_and_a_plain_one_starts_afresh(tmp_path):
    victim, log_file = tmp_path / "victim.log", tmp_path / "train.log"
    victim.write_bytes(PRECIOUS)
    os.link(victim, log_file)
    try:
        with pytest.raises(UserError, match="train.log has 1 other hard link"):
            console_log.setup_logging(LogConfig(console_log_file=str(log_file)))
        assert victim.read_bytes() == PRECIOUS  # before: emptied by FileHandler(mode="w")
        log_file.unlink()
        log_file.write_text("old run\n")
        console_log.setup_logging(LogConfig(console_log_file=str(log_file)))
        logging.getLogger("x").warning("new run")
    finally:
        console_log.setup_logging()
    assert log_file.read_text() == "WARNING new run\n"


def test_a_lock_file_with_other_content_is_not_repeated(tmp_path, caplog):
    (tmp_path / "lora.lock").write_text("the content of some other file\n")
    with OutputLock.acquire(tmp_path, "lora"):
        pass
    assert "other file" not in caplog.text  # before: "took over the lock file ... left by process the content ..."


def test_a_tensorboard_folder_name_that_is_a_file_is_a_user_error(tmp_path):
    (tmp_path / "run1").write_text("a file")
    with pytest.raises(UserError, match="run1 is not a folder"):  # before: FileExistsError from SummaryWriter
        make_log_folder(tmp_path / "run1")
    make_log_folder(tmp_path / "run2")
    make_log_folder(tmp_path / "run2")  # an existing real folder is used
    assert (tmp_path / "run2").is_dir()


@pytest.mark.parametrize("ours,other,shared", [
    ("a", "a-000001", "a-000001"),
    ("a-000001", "a", "a-000001"),
    ("a", "a-step00000010", "a-step00000010"),
    (None, "epoch", "epoch-000001"),
    (None, "at", "at-step00000001"),
    (None, "epoch-000003", "epoch-000003"),
    ("epoch", "last", "epoch-000001"),  # last.lock may be the unnamed run's
    ("last-000001", "last", "last-000001"),  # ... or --output_name last's
])
def test_output_names_whose_saves_collide(ours, other, shared):
    assert OutputNames(ours).shares_names_with(other) == shared
    if ours is not None and other != "last":
        assert OutputNames(other).shares_names_with(ours) == shared


def test_output_names_whose_saves_never_collide():
    for ours, other in (("a", "a-1"), ("a", "b"), ("a-000001", "a-000002"), ("a", "a-state"),
                        ("a", "a-000001-000001"), (None, "lora"), ("lora", "lora_v2")):
        assert OutputNames(ours).shares_names_with(other) is None, (ours, other)
    assert OutputNames("a").shares_names_with("a-000001") == "a-000001"


def test_a_held_lock_of_a_colliding_name_refuses_and_a_stale_one_does_not(tmp_path):
    (tmp_path / "a-step00000002.lock").write_text("12345\n")  # stale: nobody holds it
    with OutputLock.acquire(tmp_path, "a"):
        with pytest.raises(UserError, match=rf"a run named a is writing there \(process {os.getpid()}"):
            open_output(str(tmp_path), OutputNames("a-000001"))
        assert sorted(p.name for p in tmp_path.iterdir()) == ["a-step00000002.lock", "a.lock"]
        with open_output(str(tmp_path), OutputNames("b")):
            pass
    with open_output(str(tmp_path), OutputNames("a-000001")):
        pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-step00000002.lock"]
