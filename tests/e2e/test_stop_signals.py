"""A stop signal sent to the run's whole process group, as ``timeout``, ``docker stop``, SLURM's ``scancel``,
Kubernetes (SIGTERM) and a terminal's Ctrl-C (SIGINT) send it, with the DataLoader's workers at their default count.

Each run is the real trainer started in a session of its own (``tests/e2e/stop_driver.py`` holds it in one phase:
caching, compiling, the first step, mid-epoch with the workers started, validation, sampling, saving); once its
stderr shows the phase's line the whole group gets the signal (``os.killpg``). What must hold, README "Exit codes":
exit 130, one line that names the last file the run saved or says that it saved none, no traceback (before: the
workers died of the signal and torch's SIGCHLD handler raised ``RuntimeError: DataLoader worker (pid …) is killed by
signal: Terminated`` inside the shutdown, or, while workers were being started, the interrupt was swallowed as
"Exception ignored" and the run trained on), the lock released and no temporary left.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import launching
from tests.e2e.test_train_network import train_args

REPO = Path(__file__).resolve().parents[2]
DRIVER = REPO / "tests" / "e2e" / "stop_driver.py"
WAIT_S = 600.0  # only a hung run reaches it
NOTHING = "interrupted: nothing was saved by this run"
AGAIN = "interrupted again: stopped at once; the next run on this output folder clears its lock and temporaries"
LOG_PREFIXES = ("INFO ", "WARNING ", "DEBUG ")


def _saved(out: Path, step: int) -> str:
    return f"interrupted: the last saved checkpoint, {out / f'lora-step{step:08d}.safetensors'}, is intact"


# phase: (extra flags, the line expected: None for nothing saved, else the step of the last saved LoRA)
PHASES = {
    "caching": (("--cache_latents",), None),
    "compiling": (("--torch_compile", "--dynamo_backend", "aot_eager"), None),
    "first_step": ((), None),
    "mid_epoch": (("--save_every_n_steps", "2"), 6),
    "validation": (("--validation_split", "0.25", "--validate_every_n_steps", "2", "--save_every_n_steps", "1"), 1),
    "sampling": (("--sample_every_n_steps", "2", "--save_every_n_steps", "1"), 1),
    "saving": (("--save_every_n_steps", "1"), 2),
}
CASES = [(phase, signal.SIGTERM) for phase in PHASES] + [
    (phase, signal.SIGINT) for phase in ("compiling", "mid_epoch", "saving")]


def _args(tmp_path: Path, phase: str) -> list[str]:
    extra = list(PHASES[phase][0])
    if phase == "sampling":
        prompts = tmp_path / "prompts.txt"
        prompts.write_text("a red square --w 64 --h 64 --d 1 --s 2\n", encoding="utf-8")
        extra += ["--sample_prompts", str(prompts)]
    args = train_args(tmp_path / "out", "--max_train_steps", "20", *extra)
    at = args.index("--max_data_loader_n_workers")
    return args[:at] + args[at + 2:]  # the default count of workers


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1"}


def _wait_for(text: str, log: Path, process: subprocess.Popen) -> None:
    ends = time.monotonic() + WAIT_S
    while text not in log.read_text(errors="replace"):
        if process.poll() is not None or time.monotonic() > ends:
            with contextlib.suppress(ProcessLookupError):  # gone already, with its workers
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            pytest.fail(f"{text!r} never came (exit {process.returncode}):\n{log.read_text()[-3000:]}")
        time.sleep(0.05)


def _marker(phase: str) -> str:
    return "--torch_compile: compiling the UNet" if phase == "compiling" else f"phase {phase}"


def _messages(err: str) -> list[str]:
    """The lines of stderr that are not log records nor the driver's phase lines."""
    return [line for line in err.splitlines()
            if line.strip() and not line.startswith(LOG_PREFIXES) and not line.startswith("phase ")]


def _check_folder(out: Path) -> None:
    left = sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) if out.exists() else []
    assert "lora.lock" not in left, left
    assert not [name for name in left if ".tmp-" in name or ".old-" in name], left


def _start(tmp_path: Path, phase: str, args: list[str]) -> tuple[subprocess.Popen, Path]:
    log = tmp_path / "stderr.log"
    with log.open("w") as err:
        process = subprocess.Popen([sys.executable, str(DRIVER), phase, *args], cwd=REPO, env=_env(),
                                   stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    return process, log


@pytest.mark.parametrize(("phase", "sig"), CASES, ids=[f"{p}-{s.name}" for p, s in CASES])
def test_a_stop_signal_to_the_process_group_ends_with_one_line(tmp_path, phase, sig):
    process, log = _start(tmp_path, phase, _args(tmp_path, phase))
    _wait_for(_marker(phase), log, process)
    os.killpg(process.pid, sig)
    code = process.wait(timeout=WAIT_S)
    err = log.read_text(errors="replace")
    assert "Traceback" not in err and "Exception ignored" not in err, err[-4000:]
    assert code == 130, err[-3000:]
    out, step = tmp_path / "out", PHASES[phase][1]
    assert _messages(err) == [NOTHING if step is None else _saved(out, step)]
    _check_folder(out)


def test_a_second_ctrl_c_while_stopping_ends_at_once(tmp_path):
    process, log = _start(tmp_path, "stopping", _args(tmp_path, "mid_epoch"))
    _wait_for("phase mid_epoch", log, process)
    os.killpg(process.pid, signal.SIGINT)
    _wait_for("phase stopping", log, process)  # the first stop is under way, held in the shutdown
    os.killpg(process.pid, signal.SIGINT)
    code = process.wait(timeout=WAIT_S)
    err = log.read_text(errors="replace")
    assert "Traceback" not in err and "Exception ignored" not in err, err[-4000:]
    assert code == 130
    assert _messages(err) == [AGAIN]


def test_every_process_of_a_torchrun_launch_stops_with_the_group_signal(tmp_path):
    """torchrun starts each process in a session of its own and passes a SIGTERM on to each one's process group
    (the DataLoader's workers included)."""
    out, logs, records = tmp_path / "out", tmp_path / "logs", tmp_path / "records"
    records.mkdir()
    args = _args(tmp_path, "mid_epoch")
    command = launching.torchrun(str(DRIVER), "mid_epoch", *args,
                                 extra=("--standalone", "--log-dir", str(logs), "--redirects", "3"))
    launcher_log = tmp_path / "torchrun.log"
    with launcher_log.open("w") as err:
        process = subprocess.Popen(command, cwd=REPO, env={**launching.launch_env(), "STOP_DRIVER_RECORDS":
                                   str(records), "PYTHONUNBUFFERED": "1"}, stdout=err, stderr=err,
                                   start_new_session=True)
    ends = time.monotonic() + WAIT_S
    while not any("phase mid_epoch" in p.read_text(errors="replace") for p in logs.glob("*/attempt_0/0/stderr.log")):
        if process.poll() is not None or time.monotonic() > ends:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            pytest.fail(f"the launch never reached the phase:\n{launcher_log.read_text()[-3000:]}")
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGTERM)
    process.wait(timeout=WAIT_S)
    for rank in (0, 1):
        err = "".join(p.read_text(errors="replace") for p in logs.glob(f"*/attempt_0/{rank}/stderr.log"))
        assert "Traceback" not in err and "Exception ignored" not in err, err[-4000:]
        assert (records / f"rank{rank}.exit").read_text() == "130", err[-3000:]
        assert _messages(err) == ([_saved(out, 6)] if rank == 0 else []), err[-3000:]
    _check_folder(out)
