"""Stop signals (Ctrl-C's SIGINT, SIGTERM) and the DataLoader's worker processes.

``timeout``, ``docker stop``, SLURM's ``scancel``, Kubernetes and a terminal's Ctrl-C signal the run's whole process
group, the DataLoader's workers included. Only the main process decides how the run stops (one line, exit 130:
``library/runtime/processes.py``); a worker that died of the signal would make torch's SIGCHLD handler raise
``RuntimeError: DataLoader worker (pid …) is killed by signal`` inside the main process's shutdown. So every worker
ignores both signals from its ``worker_init_fn`` on (``ignore_stop_signals``), and the main process forks its workers
with the signals held (``starting_workers``): a forked worker inherits the main process's handler until its
``worker_init_fn`` runs, and a ``KeyboardInterrupt`` raised in the main process inside the fork's ``at_fork`` hooks
would be printed as "Exception ignored" and lost, so the run would go on. The main process then stops at the end of
the worker start, as the signal asked. The workers end when the main process shuts them down, or by themselves
when it is gone (torch's watchdog).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def ignore_stop_signals(worker_id: int) -> None:
    """The DataLoader's ``worker_init_fn``: this worker ignores SIGINT and SIGTERM."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


@contextmanager
def starting_workers() -> Iterator[None]:
    """Hold SIGINT and SIGTERM while the block runs (it starts DataLoader workers); a signal that came meanwhile is
    raised again after it, to the handler that was in place (in the main process only: a forked worker drops it)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came: list[int] = []
    previous = {signum: signal.signal(signum, lambda signum, frame: came.append(signum)) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if came:
        signal.raise_signal(came[0])
