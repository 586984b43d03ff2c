"""Ctrl-C and SIGTERM in a multi-process run (``library/runtime/processes.py`` installs them when the processes join).

A signal is raised at once as ``KeyboardInterrupt``, except inside a sync point, where it waits until the collective is
done: a process leaving a collective half-way would leave the others waiting for it. torchrun and ``accelerate
launch`` send SIGTERM to the processes still running when one of them ends; once the run has stopped (every process
agreed, or the process group broke because a process is gone) signals are ignored, so that the exit is not cut short
by a ``KeyboardInterrupt`` traceback.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class ProcessSignals:
    """SIGINT / SIGTERM of one process of the run; a signal that arrives before a sync point's exchange makes that
    exchange report the interruption (``take_pending``)."""

    def __init__(self) -> None:
        self.depth = 0
        self.pending = False
        self.previous: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in (signal.SIGINT, signal.SIGTERM):
            self.previous[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.depth:
            self.pending = True
            return
        raise KeyboardInterrupt

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
