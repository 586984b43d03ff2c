"""Small types shared by the training loop and the writers: where training stands, the save and sample callbacks.

Both ``library/train/loop.py`` (the loop) and ``library/saving/lora_files.py`` (the writers) import these; neither
imports the other for them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Position:
    """Where training stands: epochs completed, updates done, and micro-batches consumed in the current epoch.

    ``batch`` is what a resume skips in the epoch it starts in; it is 0 at every epoch start. It is stored rather
    than derived from ``step`` because a run started with ``--initial_step`` (without
    ``--skip_until_initial_step``) restarts the data of its first epoch, so its epochs and steps do not line up.
    """

    epoch: int = 0
    step: int = 0
    batch: int = 0


@dataclass
class SaveHooks:
    """Callbacks that write files; each receives the position after the update/epoch it follows."""

    every_n_steps: int | None
    every_n_epochs: int | None
    step_save: Callable[[Position], None]
    epoch_save: Callable[[Position], None]
    final_save: Callable[[Position], None]


@dataclass(frozen=True)
class SampleHooks:
    """When the loop draws sample images (sd-scripts' cadence, decided before the loop) and the callback that
    draws them. ``sample(pos, epoch)`` names the images after ``epoch`` (0 for the images at first) or, when
    ``epoch`` is None, after ``pos.step``. ``every_n_steps`` is None when the epoch cadence is set."""

    every_n_steps: int | None
    every_n_epochs: int | None
    at_first: bool
    sample: Callable[[Position, int | None], None]
