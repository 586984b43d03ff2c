"""The check of the arrays a cache file holds (``latent_cache``, ``text_cache``): dtype, shape and finiteness.

It runs on the host, once per file when the file is validated (before training, to rebuild a damaged file with a
warning naming it) or read (a file ``--skip_cache_check`` trusted unopened: a ``UserError`` naming it), never on the
training device. sd-scripts checks only that the arrays are there (``strategy_sd`` / ``strategy_sdxl``
``is_disk_cached_*_expected``), so a wrong-shaped array fails in the middle of training and NaN/Inf latents show up
as a diverging loss.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np


def array_problem(arrays: Mapping[str, np.ndarray], expected: Mapping[str, tuple[int, ...]],
                  source: str) -> str | None:
    """What is wrong with ``arrays`` (None: nothing): an array that is not floating point, one whose shape differs
    from ``expected`` (names absent there take any shape; ``source`` says what needs that shape), or one holding NaN
    or Inf."""
    for name, array in arrays.items():
        if array.dtype.kind != "f":
            return f"{name} holds {array.dtype} values, not floating point"
        want = expected.get(name)
        if want is not None and tuple(array.shape) != tuple(want):
            return f"{name} has shape {list(array.shape)}, but {source} needs {list(want)}"
        if not np.isfinite(array).all():
            return f"{name} holds NaN or Inf"
    return None
