"""Let upstream sd-scripts' Anima trainers read a DiT file with fewer blocks than the real 28 (real widths).

Upstream 48d368fa's ``library/anima_utils.load_anima_model`` builds the DiT from a fixed config (``num_blocks`` 28,
``anima_models.Anima(**dit_config)`` on empty weights) and raises ``RuntimeError("Missing keys in checkpoint")`` for
a file with fewer blocks. The real 28 blocks (2.09 B parameters) make a side-by-side CPU benchmark run for hours,
so ``bench/anima_vs_upstream.py`` uses the real widths at reduced depth. ``fit_dit_blocks()`` makes
``load_anima_model`` build as many blocks as the file holds (``net.blocks.N.*`` keys) by replacing the
``anima_models.Anima`` it calls, for that call only; every other value of upstream's config is kept, so a 28-block
file loads exactly as before.

Runs in upstream's Python with the upstream tree importable; it imports nothing of this project.
"""

from __future__ import annotations

import re

BLOCK_KEY = re.compile(r"^(?:net\.)?blocks\.(\d+)\.")


def dit_blocks_in(path: str) -> int:
    """The number of DiT blocks in the ``.safetensors`` file ``path`` (its ``[net.]blocks.N.*`` keys)."""
    from safetensors import safe_open

    with safe_open(path, "pt") as weights:
        found = [int(match[1]) for key in weights.keys() if (match := BLOCK_KEY.match(key))]
    if not found:
        raise ValueError(f"{path}: no blocks.N.* keys, not an Anima DiT file")
    return 1 + max(found)


def fit_dit_blocks() -> None:
    """Wrap upstream's ``anima_utils.load_anima_model`` so that it builds the file's number of DiT blocks."""
    from library import anima_models, anima_utils

    load, model_class = anima_utils.load_anima_model, anima_models.Anima

    def load_anima_model(device, dit_path, *args, **kwargs):
        blocks = dit_blocks_in(dit_path)

        def model(**config):
            return model_class(**{**config, "num_blocks": blocks})

        anima_models.Anima = model
        try:
            return load(device, dit_path, *args, **kwargs)
        finally:
            anima_models.Anima = model_class

    anima_utils.load_anima_model = load_anima_model
