"""Let upstream sd-scripts' FLUX.1 trainer read a T5-XXL file with fewer encoder layers (real widths).

Upstream 48d368fa's ``library/flux_utils.load_t5xxl`` builds T5-XXL from a fixed config (24 encoder layers,
``T5Config(**config)`` on empty weights) and loads the file into it with ``strict=False, assign=True``: the layers a
smaller file lacks stay on the meta device, and the first ``.to(device)`` fails ("Cannot copy out of meta tensor").
The full 24 layers (4.7 B parameters) do not fit a small test machine beside the transformer, so the FLUX checks and
benchmarks use a random T5 at T5-XXL's widths with fewer layers. ``fit_t5_layers()`` makes ``load_t5xxl`` build as
many encoder layers as the file holds (``encoder.block.N.*`` keys) by replacing the ``T5Config`` it calls, for that
call only; every other value of upstream's config is kept, so a full 24-layer file loads exactly as before.

Runs in upstream's Python with the upstream tree importable; it imports nothing of this project.
"""

from __future__ import annotations

import re

LAYER_KEY = re.compile(r"^encoder\.block\.(\d+)\.")


def t5_layers_in(path: str) -> int:
    """The number of T5 encoder layers in the ``.safetensors`` file ``path`` (its ``encoder.block.N.*`` keys)."""
    from safetensors import safe_open

    with safe_open(path, "pt") as weights:
        found = [int(match[1]) for key in weights.keys() if (match := LAYER_KEY.match(key))]
    if not found:
        raise ValueError(f"{path}: no encoder.block.N.* keys, not a T5 encoder file")
    return 1 + max(found)


def fit_t5_layers() -> None:
    """Wrap upstream's ``flux_utils.load_t5xxl`` so that it builds the file's number of encoder layers."""
    from library import flux_utils

    load, config_class = flux_utils.load_t5xxl, flux_utils.T5Config

    def load_t5xxl(ckpt_path, *args, **kwargs):
        if ckpt_path is None:
            return load(ckpt_path, *args, **kwargs)
        layers = t5_layers_in(ckpt_path)

        def config(**values):
            return config_class(**{**values, "num_layers": layers, "num_decoder_layers": layers})

        flux_utils.T5Config = config
        try:
            return load(ckpt_path, *args, **kwargs)
        finally:
            flux_utils.T5Config = config_class

    flux_utils.load_t5xxl = load_t5xxl
