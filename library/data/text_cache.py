"""Text encoder output cache files for SDXL, compatible with sd-scripts'
(``strategy_sdxl.SdxlTextEncoderOutputsCachingStrategy``).

File: ``<image stem>_te_outputs.npz`` beside the image; ``np.savez`` with ``hidden_state1`` (float32 [75n+2, 768]),
``hidden_state2`` ([75n+2, 1280]) and ``pool2`` ([1280]), the keys sd-scripts reads.

Added key ``sdsb_cache_key`` (as in ``latent_cache``): a JSON string with the caption that was encoded, the
``--max_token_length``, whether ``--weighted_captions`` weighted it, and the text encoders' id. A file whose key
differs is rebuilt, so an edited caption, another length, weighting or checkpoint never reuses stale outputs
(sd-scripts checks only that the three arrays exist and so reuses outputs of an old caption). Files sd-scripts wrote
(no key) are rebuilt, because what they encoded is unknown. Files are written to a temporary name and renamed.
"""

from __future__ import annotations

import json
import os
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import torch

from library.data.latent_cache import CACHE_KEY

SUFFIX = "_te_outputs.npz"


def npz_path(image_path: str | Path) -> Path:
    """sd-scripts' text encoder output cache file of an image."""
    image_path = Path(image_path)
    return image_path.with_name(image_path.stem + SUFFIX)


def cache_key(caption: str, max_token_length: int | None, encoder_id: str, weighted: bool = False) -> str:
    """What the cached outputs depend on, as a stable JSON string (``weighted``: ``--weighted_captions``)."""
    return json.dumps({"caption": caption, "max_token_length": max_token_length, "encoder_id": encoder_id,
                       "weighted": weighted}, sort_keys=True)


def is_valid(path: Path, key: str, names: tuple[str, ...]) -> bool:
    """True when ``path`` holds every array of ``names`` made under ``key``."""
    if not path.is_file():
        return False
    try:
        with np.load(path) as npz:
            if any(name not in npz.files for name in names) or CACHE_KEY not in npz.files:
                return False
            return str(npz[CACHE_KEY]) == key
    except (OSError, ValueError, zipfile.BadZipFile, EOFError):
        return False


def read(path: str | Path, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    with np.load(path) as npz:
        return {name: torch.from_numpy(np.array(npz[name], dtype=np.float32)) for name in names}


def write(path: Path, outputs: dict[str, torch.Tensor], key: str) -> None:
    """Write one cache file atomically (temporary file in the same folder, then rename)."""
    arrays = {name: t.float().cpu().numpy() for name, t in outputs.items()}
    arrays[CACHE_KEY] = np.array(key)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
