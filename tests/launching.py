"""The time limit of the tests' torchrun launches (``tests/unit/runtime/test_processes.py``,
``tests/e2e/test_distributed_training.py``).

A launch's limit is there only to stop a hung process group; it measures nothing. So it scales with what the launch
holds: ``SD_TEST_LAUNCH_BUDGET_S`` seconds (default 300) for each torchrun it starts and as much again for each run it
holds. Unloaded, on 2 cores, a start takes about 7 s and a run of the tiny model about 3 s, so a busy machine slows
the suite a long way before it reaches a limit. When a launch does reach it, every process it started (torchrun and
its workers, found by their parents) is killed, and the message names the runs the launch held and the variable that
raises the budget.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def torchrun(*args: str, nproc: int = 2, extra: tuple[str, ...] = ("--standalone",)) -> list[str]:
    """The command that starts ``nproc`` processes of a script with torch's launcher (torchrun)."""
    return [sys.executable, "-m", "torch.distributed.run", *extra, "--nproc_per_node", str(nproc), *args]


def launch_env() -> dict[str, str]:
    """The environment of a launch: this checkout on the path, one thread, offline, no GPU, no inherited rank."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "CUDA_VISIBLE_DEVICES": ""}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


BUDGET_VARIABLE = "SD_TEST_LAUNCH_BUDGET_S"
DEFAULT_BUDGET_S = 300.0


def budget_s() -> float:
    """Seconds allowed per start and per run: ``SD_TEST_LAUNCH_BUDGET_S``, or the default."""
    text = os.environ.get(BUDGET_VARIABLE, "").strip()
    if not text:
        return DEFAULT_BUDGET_S
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise ValueError(f"{BUDGET_VARIABLE}={text!r}: expected a positive number of seconds (per start and per run)")
    return value


@dataclass
class Launch:
    """What the processes of one launch left: exit codes (``processes``), output, and whether the limit killed them."""

    what: str
    runs: tuple[str, ...]
    budget_s: float
    limit_s: float
    elapsed_s: float
    timed_out: bool
    processes: list[subprocess.Popen]
    stdout: list[str]
    stderr: list[str]

    @property
    def outputs(self) -> list[str]:
        """Per process started: its stdout, then its stderr."""
        return [out + err for out, err in zip(self.stdout, self.stderr, strict=True)]

    @property
    def output(self) -> str:
        return "".join(self.outputs)

    def problem(self, note: str = "", tail: int = 4000) -> str | None:
        """None when every process exited with 0; else what went wrong, with the end of each process's output."""
        held = f"{len(self.runs)} run(s): {', '.join(self.runs)}"
        if self.timed_out:
            head = (f"{self.what} ({held}) did not end within its limit of {self.limit_s:.0f} s = {self.budget_s:g} "
                    f"s x ({len(self.processes)} start(s) + {len(self.runs)} run(s)) and was killed. "
                    f"The limit only stops a hung process group: if this machine is merely this slow, raise "
                    f"{BUDGET_VARIABLE} (seconds per start and per run; now {self.budget_s:g}).")
        elif any(p.returncode != 0 for p in self.processes):
            head = (f"{self.what} ({held}) exited with {[p.returncode for p in self.processes]} "
                    f"after {self.elapsed_s:.0f} s.")
        else:
            return None
        ends = [f"--- process {i}: stdout ---\n{out[-tail:]}\n--- process {i}: stderr ---\n{err[-tail:]}"
                for i, (out, err) in enumerate(zip(self.stdout, self.stderr, strict=True))]
        return "\n".join([head, *([note] if note else []), *ends])


def _children() -> dict[int, list[int]]:
    """The children of every process, from ``/proc`` (Linux; elsewhere none are found)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # ended meanwhile
        children.setdefault(parent, []).append(int(stat.parent.name))
    return children


def _tree(roots: Sequence[int]) -> set[int]:
    children, found, todo = _children(), set(), list(roots)
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, []))
    return found


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _kill(processes: list[subprocess.Popen]) -> None:
    """Kill the launch's torchruns and everything under them. torchrun starts each worker in a session of its own, so
    killing its process group (or torchrun alone) would leave the workers running; they are found by their parents,
    all stopped first (none can start another meanwhile, nor lose its parent), then killed."""
    stopped: set[int] = set()
    while tree := _tree([p.pid for p in processes if p.returncode is None]) - stopped:
        for pid in tree:
            _signal(pid, signal.SIGSTOP)
        stopped |= tree
    for pid in stopped:
        _signal(pid, signal.SIGKILL)
    for process in processes:
        process.wait()


def _read(file) -> str:
    file.seek(0)
    text = file.read().decode("utf-8", "replace")
    file.close()
    return text


def launch(commands: Sequence[Sequence[str]], env: dict[str, str], runs: Sequence[str], what: str) -> Launch:
    """Start ``commands`` together (one torchrun each) and wait for all of them, within
    ``budget_s() * (len(commands) + len(runs))`` seconds in all; past it, kill them and their workers."""
    budget = budget_s()
    limit = budget * (len(commands) + len(runs))
    started = time.monotonic()
    processes: list[subprocess.Popen] = []
    timed_out, finished = False, False
    with tempfile.TemporaryDirectory() as tmp:
        # files, not pipes: a process blocked on a full pipe while we wait for another one would hang the launch
        files = [(open(f"{tmp}/{i}.out", "w+b"), open(f"{tmp}/{i}.err", "w+b")) for i in range(len(commands))]
        try:
            for command, (out, err) in zip(commands, files, strict=True):
                processes.append(subprocess.Popen(list(command), env=env, stdout=out, stderr=err,
                                                  start_new_session=True))
            for process in processes:
                try:
                    process.wait(timeout=max(0.0, started + limit - time.monotonic()))
                except subprocess.TimeoutExpired:
                    timed_out = True
                    break
            finished = not timed_out
        finally:
            if not finished:  # the limit, or an interruption: nothing this launch started may outlive it
                _kill(processes)
            texts = [[_read(f) for f in pair] for pair in files]
    elapsed = time.monotonic() - started
    return Launch(what=what, runs=tuple(runs), budget_s=budget, limit_s=limit, elapsed_s=elapsed,
                  timed_out=timed_out, processes=processes, stdout=[t[0] for t in texts],
                  stderr=[t[1] for t in texts])
