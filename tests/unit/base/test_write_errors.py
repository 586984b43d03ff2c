"""A file the run cannot write becomes one message naming the file, the cause and what to do (``WriteFailed``, exit
2), chosen by the OSError's errno; before, the OSError escaped as a traceback (exit 1).

The expected phrases are the errnos' meanings (POSIX: ENOSPC no space or inodes left, EDQUOT quota, EROFS read-only
file system, EACCES permission, ENOENT no such file or folder), not the implementation's text."""

from __future__ import annotations

import errno
import os

import pytest

from library.base import files
from library.base.errors import UserError, WriteFailed, write_cause, writing


def _error(code: int) -> OSError:
    return OSError(code, os.strerror(code))


@pytest.mark.parametrize("code, phrases", [
    (errno.ENOSPC, ("no space left", "inodes", "free some space")),
    (errno.EDQUOT, ("quota",)),
    (errno.EROFS, ("read-only", "writable", "--output_dir")),
    (errno.EACCES, ("permission denied", "writable", "--output_dir")),
    (errno.EPERM, ("permission denied",)),
    (errno.EIO, ("input/output error",)),
])
def test_each_errno_gets_its_cause_and_remedy(tmp_path, code, phrases):
    cause = write_cause(_error(code), tmp_path / "lora.safetensors")
    for phrase in phrases:
        assert phrase in cause


def test_a_vanished_folder_is_named_at_its_outermost_missing_level(tmp_path):
    out = tmp_path / "out"  # never created: as if deleted during the run, with its sample folder
    cause = write_cause(_error(errno.ENOENT), out / "sample" / "lora_000002_00.png")
    assert f"the folder {out} no longer exists" in cause
    assert "--output_dir" in cause


@pytest.mark.parametrize("code", [errno.ENAMETOOLONG, errno.ENOENT])
def test_another_errno_keeps_the_systems_words(tmp_path, code):
    """ENOENT while the folder is still there (no folder vanished) is not said to be a deleted folder."""
    assert write_cause(_error(code), tmp_path / "x").startswith(os.strerror(code))


def test_writing_turns_an_oserror_into_one_user_error_with_exit_2(tmp_path):
    target = tmp_path / "lora-step00000002.safetensors"
    with pytest.raises(WriteFailed) as caught, writing("cannot write the LoRA file", target):
        raise _error(errno.ENOSPC)
    assert isinstance(caught.value, UserError) and caught.value.exit_code == 2
    [line] = caught.value.messages
    assert line.startswith(f"cannot write the LoRA file {target}: no space left")


def test_the_message_ends_with_where_the_last_good_lora_is(tmp_path):
    kept = tmp_path / "lora-step00000001.safetensors"
    kept.write_bytes(b"x")
    gone = tmp_path / "gone" / "lora-step00000001.safetensors"
    for checkpoint, earlier, ending in [
        (kept, None, f"the last saved checkpoint, {kept}, is intact"),
        (gone, None, f"the last saved checkpoint, {gone}, is gone with its folder"),
        (None, kept, f"nothing was saved by this run; {kept} from before this run is left as it was"),
        (None, None, "nothing was saved by this run"),
    ]:
        failure = WriteFailed("cannot write the LoRA file", tmp_path / "lora.safetensors", _error(errno.EROFS))
        failure.add_saved(checkpoint, earlier)
        [line] = failure.messages
        assert line.startswith(f"cannot write the LoRA file {tmp_path / 'lora.safetensors'}: the file system is")
        assert line.endswith(f"; {ending}")
        assert str(failure) == line


def test_a_state_folder_that_cannot_be_moved_aside_leaves_no_temporary(tmp_path, monkeypatch):
    final = tmp_path / "lora-state"
    files.replace_folder(final, lambda folder: (folder / "a").write_text("old"))
    real = os.replace

    def read_only(src, dst):
        if os.fspath(src) == os.fspath(final):
            raise _error(errno.EROFS)
        return real(src, dst)

    monkeypatch.setattr(files.os, "replace", read_only)
    with pytest.raises(OSError):
        files.replace_folder(final, lambda folder: (folder / "a").write_text("new"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lora-state"]  # before: a lora-state.tmp-… folder stayed
    assert (final / "a").read_text() == "old"
