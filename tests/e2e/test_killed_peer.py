"""One process of a 2-process run killed with SIGKILL (as the out-of-memory killer or a lost machine stops it): the
survivor prints one line that names the lost process and the last checkpoint, and exits with ``PEER_LOST`` (4), not
with gloo's ``RuntimeError: ... Connection closed by peer`` traceback (nor, when torchrun's SIGTERM follows, a
``KeyboardInterrupt`` one).

torchrun runs this file in each process (``__main__`` below, as ``tests/e2e/ddp_driver.py`` runs its plans): the real
``train_network.main`` saves a LoRA after every step; the chosen process kills itself with SIGKILL when it starts its
``KILL_AT``-th loss computation (0-based), after the saves of the first steps. Each survivor writes
``OUT/rank<r>.json`` (exit code, the lines it printed on stderr, or the exception that escaped ``main``); torchrun
writes each process's raw output to ``--log-dir`` (``--redirects 3``), where no traceback may appear.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import os
import re
import signal
import sys
import traceback
from pathlib import Path

from safetensors.torch import load_file

from tests import launching
from tests.e2e.test_train_network import train_args
from tests.launching import launch_env, torchrun

PEER_LOST = 4  # the exit code README documents for "another process stopped unexpectedly"
KILL_AT = 3  # the 4th micro-batch: steps 1-3 were saved (or step 3 is being written) on the main process


def _worker(out: Path, kill_rank: int, args: list[str]) -> None:
    """One process of the launch: the real trainer, this process killing itself if it is ``kill_rank``."""
    import torch

    import library.runtime.run
    import train_network

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    calls = itertools.count()
    original = library.runtime.run.BatchLoss

    class KillingLoss(original):
        def __call__(self, batch):
            if rank == kill_rank and next(calls) == KILL_AT:
                os.kill(os.getpid(), signal.SIGKILL)
            return super().__call__(batch)

    library.runtime.run.BatchLoss = KillingLoss
    stderr = io.StringIO()
    record: dict[str, object] = {}
    try:
        with contextlib.redirect_stderr(stderr):
            record["exit"] = train_network.main(args)
    except BaseException:  # noqa: BLE001 (the test reports whatever escaped the trainer)
        record["raised"] = traceback.format_exc()
    record["stderr"] = stderr.getvalue().splitlines()
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(record))


def _launch(tmp_path: Path, kill_rank: int) -> tuple[dict, str, Path]:
    """The survivor's record, its raw stderr, and the output folder."""
    out, logs, records = tmp_path / "out", tmp_path / "logs", tmp_path / "records"
    args = train_args(out, "--max_train_steps", "20", "--save_every_n_steps", "1")
    done = launching.launch(
        [torchrun(__file__, str(records), str(kill_rank), *args,
                  extra=("--standalone", "--log-dir", str(logs), "--redirects", "3"))],
        launch_env(), [f"a run whose process {kill_rank} is killed"], f"the launch killing process {kill_rank}")
    assert not done.timed_out, done.problem()
    survivor = 1 - kill_rank
    record_file = records / f"rank{survivor}.json"
    assert record_file.is_file(), done.problem(note=f"process {survivor} wrote no record")
    raw = "".join(path.read_text(errors="replace")
                  for path in logs.glob(f"*/attempt_0/{survivor}/stderr.log"))
    return json.loads(record_file.read_text()), raw, out


def _error_lines(record: dict) -> list[str]:
    assert "raised" not in record, record["raised"][-3000:]
    return [line for line in record["stderr"] if line.startswith("error:")]


def _newest_lora(out: Path) -> Path:
    return max(out.glob("lora-step*.safetensors"), key=lambda p: int(re.findall(r"\d+", p.stem)[-1]))


def test_main_process_names_the_last_checkpoint_when_process_1_is_killed(tmp_path):
    record, raw, out = _launch(tmp_path, kill_rank=1)
    lines = _error_lines(record)
    assert len(lines) == 1, record["stderr"][-20:]
    match = re.fullmatch(r"error: process 1 stopped unexpectedly; the last checkpoint, (.+), is intact", lines[0])
    assert match, lines
    named = Path(match[1])
    assert named == _newest_lora(out)  # the newest file the run saved (step 2 or 3: torchrun's SIGTERM may cut 3)
    assert load_file(named)
    assert record["exit"] == PEER_LOST
    assert "Traceback" not in raw and "Connection" not in raw, raw[-3000:]


def test_process_1_reports_once_when_the_main_process_is_killed(tmp_path):
    record, raw, _ = _launch(tmp_path, kill_rank=0)
    assert _error_lines(record) == ["error: process 0 stopped unexpectedly; the last checkpoint it saved is intact"]
    assert record["exit"] == PEER_LOST
    assert "Traceback" not in raw and "Connection" not in raw, raw[-3000:]


def test_the_line_says_what_is_known_with_more_processes_or_a_timeout():
    from library.runtime.process_info import lost_peer_lines

    timeout = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1800000ms for recv operation")
    assert lost_peer_lines(0, 4, timeout, None) == [
        "error: another process stopped answering (--ddp_timeout ran out); this run saved no checkpoint yet"]
    closed = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:16062")
    assert lost_peer_lines(2, 4, closed, Path("out/lora-step00000002.safetensors")) == [
        "error: another process stopped unexpectedly; the last checkpoint the main process saved is intact"]


if __name__ == "__main__":  # torchrun starts this file with PYTHONPATH at the checkout (launch_env)
    _worker(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:])
