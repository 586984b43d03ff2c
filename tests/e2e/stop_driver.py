"""The trainer, held in one phase of a run until a stop signal comes (``tests/e2e/test_stop_signals.py``).

``python -m tests.e2e.stop_driver PHASE TRAIN_ARGS...`` runs the real ``train_network.main`` in this process (its
DataLoader workers forked from it as usual). When the run reaches ``PHASE`` it prints ``phase PHASE`` on stderr and
waits there (at most ``WAIT_S`` seconds, then goes on), so that a signal sent after that line lands inside the phase
however busy the machine is. ``stopping`` waits in the shutdown after the first signal (the tracker's close), for a
second one. ``compiling`` needs no hold: the trainer's own line before ``--torch_compile`` compiles is the marker.
Under torchrun (``RANK`` set) only the main process announces and every process holds.
"""

from __future__ import annotations

import itertools
import os
import sys
import time

WAIT_S = 600.0


def _hold(phase: str) -> None:
    if os.environ.get("RANK", "0") == "0":
        print(f"phase {phase}", file=sys.stderr, flush=True)
    ends = time.monotonic() + WAIT_S
    while time.monotonic() < ends:
        time.sleep(0.02)


def _on_call(owner, name: str, phase: str, when) -> None:
    """Hold in ``phase`` before the call of ``owner.name`` for which ``when(count, args)`` is true (0-based count)."""
    original = getattr(owner, name)
    calls = itertools.count()

    def wrapper(*args, **kwargs):
        if when(next(calls), args):
            _hold(phase)
        return original(*args, **kwargs)

    setattr(owner, name, wrapper)


def _after_call(owner, name: str, phase: str, when) -> None:
    """Hold in ``phase`` after the call of ``owner.name`` for which ``when(count, args)`` is true."""
    original = getattr(owner, name)
    calls = itertools.count()

    def wrapper(*args, **kwargs):
        result = original(*args, **kwargs)
        if when(next(calls), args):
            _hold(phase)
        return result

    setattr(owner, name, wrapper)


def install(phase: str) -> None:
    import library.base.files
    import library.data.cache_progress
    import library.runtime.run
    import library.sampling.images
    import library.train.tracking
    import library.train.validation as validation

    if phase == "caching":  # before the second batch of the latent cache is encoded
        original_watch = library.data.cache_progress.CacheProgress.watch

        def watch(self, encode):
            batches = itertools.count()

            def held(batch):
                if next(batches) == 1:
                    _hold(phase)
                return encode(batch)

            return original_watch(self, held)

        library.data.cache_progress.CacheProgress.watch = watch
    elif phase == "first_step":
        _on_call(library.runtime.run.BatchLoss, "__call__", phase, lambda n, _: n == 0)
    elif phase == "mid_epoch":  # the 7th micro-batch: steps 2, 4 and 6 were saved (--save_every_n_steps 2)
        _on_call(library.runtime.run.BatchLoss, "__call__", phase, lambda n, _: n == 6)
    elif phase == "validation":
        _on_call(validation, "validation_loss", phase, lambda n, _: n == 0)
    elif phase == "sampling":
        _on_call(library.sampling.images.SampleImages, "draw", phase, lambda n, _: n == 0)
    elif phase == "saving":  # the temporary of the step-3 LoRA is written, not yet renamed to its name
        _after_call(library.base.files, "write_new_file", phase,
                    lambda n, args: "lora-step00000003.safetensors.tmp-" in str(args[0]))
    elif phase == "stopping":  # the first signal came at the 3rd micro-batch; the run is shutting down
        _on_call(library.runtime.run.BatchLoss, "__call__", "mid_epoch", lambda n, _: n == 2)
        _on_call(library.train.tracking.Tracker, "close", phase, lambda n, _: True)


if __name__ == "__main__":
    install(sys.argv[1])
    import train_network

    code = train_network.main(sys.argv[2:])
    if os.environ.get("STOP_DRIVER_RECORDS"):  # under torchrun, whose own exit code says nothing of the processes'
        record = os.path.join(os.environ["STOP_DRIVER_RECORDS"], f"rank{os.environ.get('RANK', '0')}.exit")
        with open(record, "w") as f:
            f.write(str(code))
    sys.exit(code)
