"""Ctrl-C and SIGTERM of a run (``library/runtime/processes.py`` installs them when the processes join; a single
process is the case N = 1).

The first signal is raised as ``KeyboardInterrupt``, and the run stops with one line and exit 130. A second one while
the run stops (closing the DataLoader's workers, removing temporaries, releasing the lock) ends a single process at
once, with one line and the same exit code, as users expect of a second Ctrl-C; the lock and temporaries it leaves are
cleared by the next run on the output folder (``library/runtime/output.py``). In a multi-process run a second signal is
ignored, as below. The DataLoader's workers ignore both (``library/data/worker_signals.py``).

In a multi-process run a signal is raised at once as ``KeyboardInterrupt``, except inside a sync point, where it waits
until the collective is done: a process leaving a collective half-way would leave the others waiting for it. torchrun
and ``accelerate launch`` send SIGTERM to the processes still running when one of them ends; once the run has stopped
(every process agreed, or the process group broke because a process is gone) signals are ignored, so that the exit is
not cut short by a ``KeyboardInterrupt`` traceback.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from library.runtime.process_info import INTERRUPTED

AGAIN = b"interrupted again: stopped at once; the next run on this output folder clears its lock and temporaries\n"


class ProcessSignals:
    """SIGINT / SIGTERM of one process of the run; a signal that arrives before a sync point's exchange makes that
    exchange report the interruption (``take_pending``)."""

    def __init__(self) -> None:
        self.depth = 0
        self.pending = False
        self.stopping = False  # a signal stopped the run
        self.at_once = False  # a second signal ends the process at once (a single process)
        self.previous: dict[int, Any] = {}

    def install(self, at_once: bool = False) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        self.at_once = at_once
        for signum in (signal.SIGINT, signal.SIGTERM):
            self.previous[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.stopping:
            if self.at_once:
                os.write(2, AGAIN)
                os._exit(INTERRUPTED)
            return
        self.stopping = True
        if self.depth:
            self.pending = True
            return
        raise KeyboardInterrupt

    def as_stop(self, exc: BaseException | None) -> BaseException | None:
        """``exc``, or ``KeyboardInterrupt`` when a signal stopped the run and ``exc`` is (or wraps: ``torch.compile``
        wraps what fails while it compiles) torch's ``RuntimeError: DataLoader worker (pid …) is killed by signal``,
        raised by its SIGCHLD handler when a worker died of the signal: the stop, not a crash."""
        cause = exc
        while self.stopping and cause is not None:
            if isinstance(cause, RuntimeError) and "DataLoader worker" in str(cause) and "killed by" in str(cause):
                return KeyboardInterrupt()
            cause = cause.__cause__ or cause.__context__
        return exc

    def take_pending(self) -> bool:
        pending, self.pending = self.pending, False
        return pending

    @contextmanager
    def deferred(self) -> Iterator[None]:
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
        if not self.depth and self.take_pending():
            raise KeyboardInterrupt

    def ignore(self) -> None:
        """After a stop: the exit must not be cut short (torchrun signals the processes still running when the first
        one exits)."""
        for signum in self.previous:
            signal.signal(signum, signal.SIG_IGN)

    def restore(self) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        self.previous.clear()
