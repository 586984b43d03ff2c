"""What filling a cache shows and where it can stop (``TrainData.cache_latents``, ``cache_text_encoder_outputs``).

Each pass logs how many images it encodes and how many disk caches it reuses, as before, and on the main process of
the run shows a progress bar with an ETA over the encodes (tqdm, as the training loop's bar; a flip_aug image counts
twice: it is encoded mirrored too). sd-scripts shows a tqdm bar over its caching batches too (upstream
``library/train_util.py`` ``BaseDataset.cache_latents``, its loop over ``cache_batch_latents``). ``step`` runs before
every batch that is encoded: in a multi-process run it is a sync point (``library/runtime/processes.py``), so that
an interruption or an error on one process stops the others at their next batch instead of after their whole share.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from tqdm import tqdm

logger = logging.getLogger(__name__)


class CacheProgress:
    """The log line and progress bar of each caching pass; ``show``: whether this process shows the bar."""

    def __init__(self, show: bool = False, step: Callable[[], None] = lambda: None) -> None:
        self.show = show
        self.step = step
        self.bar: tqdm | None = None

    def begin(self, what: str, count: int, reused: int, sharded: bool, encodes: int | None = None) -> None:
        """A pass over ``count`` images to encode (``encodes`` encoder inputs, mirrored ones included; ``count`` when
        not given), ``reused`` taken from disk caches; ``sharded``: the count is this process's share."""
        logger.info("caching %s: %d to encode, %d reused from disk%s", what, count, reused,
                    " (this process's share)" if sharded else "")
        self.close()
        total = count if encodes is None else encodes
        if total and self.show:
            self.bar = tqdm(total=total, desc=f"caching {what}", unit="image", smoothing=0, disable=None)

    def watch(self, encode: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """``encode`` with ``step`` before each batch and the bar advanced by the batch's length after it; the bar is
        closed when a batch fails or is interrupted, so that the message that follows starts a line of its own."""

        def call(batch: Any) -> Any:
            try:
                self.step()
                encoded = encode(batch)
            except BaseException:
                self.close()
                raise
            if self.bar is not None:
                self.bar.update(len(batch))
                if self.bar.n >= self.bar.total:
                    self.close()
            return encoded

        return call

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


QUIET = CacheProgress()  # the log lines only: no bar, no sync point (the default of TrainData's caching)
