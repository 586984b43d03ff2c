"""A save the file system refuses in the middle of a run ends with one message naming the file, the cause, what to do
and the last good LoRA, exit 2 (README "Exit codes"), no traceback, the lock file removed, no temporary left and the
earlier files intact. Before, each ended with the OSError's traceback and exit 1.

The faults are simulated without root, at the call that creates or fills a file (``library/base/files.py``
``write_new_file``, which every atomic write goes through): a disk that fills up while the second state folder is
written (the temporary is created, then a write fails with ENOSPC), an output folder that turns read-only after the
first save (creating a file fails with EROFS; the sample image comes first at step 2), and the output folder deleted
after the first save (the sample folder cannot be made: ENOENT; before, it and the output folder were made anew and
the run saved on there, without its lock). One tiny run per fault, shared by its tests.

With 2 processes (torchrun runs this file in each, as ``test_killed_peer.py`` does): the main process's disk has no
inode left at the second save (creating the file fails with ENOSPC); both processes end with exit 2, the main one
prints the message once, and neither hangs.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests import launching
from tests.e2e.test_train_network import train_args
from tests.launching import launch_env, torchrun

WRITE_FAILED = 2  # README: exit 2 covers a file the run cannot write
FIRST = "lora-step00000001.safetensors"
SECOND = "lora-step00000002.safetensors"
PROMPT = "a red square --w 64 --h 64 --d 1 --s 1\n"


def _patch_writes(patch: pytest.MonkeyPatch, fault) -> None:
    """Route every file the trainer creates through ``fault(path, write)``, which may fail it."""
    from library.base import files
    from library.saving import state_file

    real = files.write_new_file

    def write_new_file(path, write):
        fault(Path(path), write, real)

    patch.setattr(files, "write_new_file", write_new_file)
    patch.setattr(state_file, "write_new_file", write_new_file)


def _fills_up(path, write, real):
    """The temporary is created and half written, then the disk is full."""
    def half(f):
        f.write(b"\0" * 4096)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    real(path, half)


def _run(out: Path, args: list[str], fault, *, after_first_save=None) -> tuple[int, str]:
    """One run of the real trainer with ``fault`` on the writes; stderr as printed (the log lines included)."""
    import train_network
    from library.saving import lora_files

    stderr = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stderr(stderr):
        _patch_writes(patch, fault)
        if after_first_save is not None:
            real = lora_files.Saver.save_lora

            def save_lora(self, *a, **k):
                path = real(self, *a, **k)
                if path.name == FIRST:
                    after_first_save(out)
                return path

            patch.setattr(lora_files.Saver, "save_lora", save_lora)
        code = train_network.main(args)
    return code, stderr.getvalue()


def _disk_full(root: Path) -> tuple[int, str, Path]:
    out = root / "out"

    def fault(path, write, real):
        second_state = path.parent.name.startswith("lora-step00000002-state.tmp-")
        (_fills_up if second_state else lambda p, w, r: r(p, w))(path, write, real)

    code, err = _run(out, train_args(out, "--save_every_n_steps", "1", "--save_state"), fault)
    return code, err, out


def _sampling(root: Path) -> tuple[str, ...]:
    prompts = root / "prompts.txt"
    prompts.write_text(PROMPT, encoding="utf-8")
    return "--sample_prompts", str(prompts), "--sample_every_n_steps", "1"


def _read_only(root: Path) -> tuple[int, str, Path]:
    out = root / "out"

    def fault(path, write, real):
        if (out / FIRST).exists():
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        real(path, write)

    code, err = _run(out, train_args(out, "--save_every_n_steps", "1", *_sampling(root)), fault)
    return code, err, out


def _deleted(root: Path) -> tuple[int, str, Path]:
    out = root / "out"
    code, err = _run(out, train_args(out, "--save_every_n_steps", "1", *_sampling(root)), lambda p, w, r: r(p, w),
                     after_first_save=shutil.rmtree)
    return code, err, out


@pytest.fixture(scope="module", params=["disk_full", "read_only", "deleted"])
def faulted(request, tmp_path_factory):
    scenario = {"disk_full": _disk_full, "read_only": _read_only, "deleted": _deleted}[request.param]
    return (request.param, *scenario(tmp_path_factory.mktemp(request.param)))


def _one_error(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err[-3000:]
    return lines[0]


EXPECTED = {  # patterns: the file named, the cause and the remedy, the last good file's fate
    "disk_full": (r"cannot write the state folder \S+lora-step00000002-state", "no space left", "inodes",
                  f"the last saved checkpoint, .*{SECOND}, is intact"),
    "read_only": (r"cannot write the sample image \S+/sample/lora_000002_00_\d+_1\.png", "read-only",
                  "--output_dir", f"the last saved checkpoint, .*{FIRST}, is intact"),
    "deleted": (r"cannot create the sample image folder \S+/out/sample", r"the folder \S+/out no longer exists",
                "--output_dir",
                f"the last saved checkpoint, .*{FIRST}, is gone with its folder"),
}


def test_one_message_naming_file_cause_and_last_good_file_exit_2(faulted):
    name, code, err, out = faulted
    line = _one_error(err)
    file, *words, last = EXPECTED[name]
    assert re.match(rf"error: {file}: ", line), line
    for word in words:
        assert re.search(word, line), line
    assert re.search(last + "$", line), line
    assert code == WRITE_FAILED
    assert "Traceback" not in err, err[-3000:]


def test_lock_and_temporaries_are_gone_and_earlier_files_intact(faulted):
    name, code, err, out = faulted
    if name == "deleted":
        assert not out.exists()  # before, the sample images' mkdir made it anew and the run saved on, unlocked
        return
    left = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
    assert not [p for p in left if re.search(r"\.(tmp|old|del)-|\.lock$", p)], left
    assert load_file(out / FIRST)
    if name == "disk_full":
        assert load_file(out / SECOND)
        assert (out / "lora-step00000001-state" / "train_state.json").is_file()
        assert not (out / "lora-step00000002-state").exists()


# --- 2 processes ----------------------------------------------------------------------------------------------------

def _worker(records: Path, args: list[str]) -> None:
    """One process of the launch: the real trainer; on the main process, no inode is left after the first save."""
    import torch

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    out = Path(args[args.index("--output_dir") + 1])

    def fault(path, write, real):
        if rank == 0 and (out / FIRST).exists():
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        real(path, write)

    record: dict[str, object] = {}
    try:
        record["exit"], record["stderr"] = _run(out, args, fault)
    except BaseException as exc:  # noqa: BLE001 (the test reports whatever escaped the trainer)
        record["raised"] = repr(exc)
    records.mkdir(parents=True, exist_ok=True)
    (records / f"rank{rank}.json").write_text(json.dumps(record))


def test_two_processes_stop_together_with_the_main_process_message(tmp_path):
    out, logs, records = tmp_path / "out", tmp_path / "logs", tmp_path / "records"
    args = train_args(out, "--max_train_steps", "6", "--save_every_n_steps", "1")
    done = launching.launch(
        [torchrun(__file__, str(records), *args, extra=("--standalone", "--log-dir", str(logs), "--redirects", "3"))],
        launch_env(), ["a 2-process run whose main process's disk fills up"], "the launch with a full disk")
    assert not done.timed_out, done.problem()
    main, other = (json.loads((records / f"rank{r}.json").read_text()) for r in (0, 1))
    assert "raised" not in main and "raised" not in other, (main, other)
    line = _one_error(main["stderr"])
    assert re.fullmatch(rf"error: cannot write the LoRA file \S+{SECOND}: no space left .*; the last saved "
                        rf"checkpoint, \S+{FIRST}, is intact", line), line
    assert not [x for x in other["stderr"].splitlines() if x.startswith("error:")], other["stderr"][-2000:]
    assert (main["exit"], other["exit"]) == (WRITE_FAILED, WRITE_FAILED)
    raw = "".join(p.read_text(errors="replace") for p in logs.glob("*/attempt_0/*/stderr.log"))
    assert "Traceback" not in raw, raw[-3000:]
    assert sorted(p.name for p in out.iterdir()) == [FIRST]  # no lock, no temporary
    assert load_file(out / FIRST)


if __name__ == "__main__":  # torchrun starts this file with PYTHONPATH at the checkout (launch_env)
    _worker(Path(sys.argv[1]), sys.argv[2:])
