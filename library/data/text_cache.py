"""Text encoder output cache files of the families that cache them (``ModelFamily.cache_names``), compatible with
sd-scripts' (``strategy_sdxl.SdxlTextEncoderOutputsCachingStrategy``,
``strategy_flux.FluxTextEncoderOutputsCachingStrategy``).

File: ``<image stem>`` + the family's ``FamilySpec.text_cache_suffix`` beside the image (``_te_outputs.npz`` for SDXL,
``_flux_te.npz`` for FLUX.1); ``np.savez`` with the family's arrays under the keys sd-scripts reads (SDXL:
``hidden_state1`` float32 [75n+2, 768], ``hidden_state2`` [75n+2, 1280], ``pool2`` [1280]).

Added key ``sdsb_cache_key`` (as in ``latent_cache``): a JSON string with the caption that was encoded, the
``--max_token_length``, whether ``--weighted_captions`` weighted it, and the text encoders' id. A file whose key
differs is rebuilt, so an edited caption, another length, weighting or checkpoint never reuses stale outputs
(sd-scripts checks only that the three arrays exist and so reuses outputs of an old caption). Files sd-scripts wrote
(no key) are rebuilt, because what they encoded is unknown. A file with the right key that is damaged (unreadable,
an array missing, not floating point, of another shape than the text encoders give, holding more than its header
declares, or holding NaN/Inf; all but the last are seen in the array's header before numpy allocates it:
``cache_arrays``) is rebuilt with a warning naming it; sd-scripts would fail with it in the middle of training.
Files are written as every file of the trainer (``library/base/files.write_file_atomic``: a temporary name, flushed
to disk, renamed; mode 0666 less the umask).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

from library.base.errors import UserError
from library.base.files import write_file_atomic
from library.data.cache_arrays import DamagedCache, load_array, load_key
from library.data.latent_cache import CACHE_KEY, UNREADABLE

log = logging.getLogger(__name__)


class ArrayNames(tuple):
    """The names of the arrays a cache file holds (a tuple of str: the family's ``cache_names``) and, where known,
    the shape of each for one caption (``shapes``: what the text encoders give, ``model_setup`` measures it), so that
    a file whose arrays do not fit the model is rebuilt. A plain tuple of names checks no shape."""

    shapes: dict[str, tuple[int, ...]]
    suffix: str  # the file name's end: the family's ``FamilySpec.text_cache_suffix``, as upstream names the files

    def __new__(cls, names: Sequence[str], shapes: Mapping[str, tuple[int, ...]] | None, suffix: str) -> ArrayNames:
        self = super().__new__(cls, names)
        self.shapes = dict(shapes or {})
        self.suffix = suffix
        return self


def npz_path(image_path: str | Path, names: ArrayNames) -> Path:
    """sd-scripts' text encoder output cache file of an image: its stem and the family's suffix."""
    image_path = Path(image_path)
    return image_path.with_name(image_path.stem + names.suffix)


def cache_key(caption: str, max_token_length: int | None, encoder_id: str, weighted: bool = False) -> str:
    """What the cached outputs depend on, as a stable JSON string (``weighted``: ``--weighted_captions``)."""
    return json.dumps({"caption": caption, "max_token_length": max_token_length, "encoder_id": encoder_id,
                       "weighted": weighted}, sort_keys=True)


def _load(npz: np.lib.npyio.NpzFile, names: Sequence[str]) -> dict[str, np.ndarray]:
    """Every array of ``names`` from an open file, each checked by ``cache_arrays.load_array`` against the shape
    ``names`` gives (any shape up to a bound where it gives none); a ``DamagedCache`` says what is wrong."""
    missing = [name for name in names if name not in npz.files]
    if missing:
        raise DamagedCache(f"it has no {', '.join(missing)}")
    shapes = getattr(names, "shapes", {})
    return {name: load_array(npz, name, shapes.get(name), "the text encoders' output") for name in names}


def is_valid(path: Path, key: str, names: Sequence[str]) -> bool:
    """True when ``path`` holds every array of ``names`` made under ``key`` (of the shapes ``names`` gives, finite);
    a file with the right key that cannot serve is rebuilt with a warning naming it."""
    if not path.is_file():
        return False
    try:
        with np.load(path, allow_pickle=False) as npz:
            if CACHE_KEY not in npz.files or load_key(npz, CACHE_KEY) != key:
                return False
            _load(npz, names)
    except DamagedCache as exc:
        log.warning("%s: damaged text encoder output cache file (%s); rebuilding it", path, exc)
        return False
    except UNREADABLE as exc:
        log.warning("%s: text encoder output cache file cannot be read (%s); rebuilding it", path, exc)
        return False
    return True


def read(path: str | Path, names: Sequence[str]) -> dict[str, torch.Tensor]:
    """The cached outputs of one caption; a file damaged since it was validated is a UserError naming it."""
    fix = "delete it so that it is rebuilt"
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = _load(npz, names)
    except DamagedCache as exc:
        raise UserError(f"{path}: text encoder output cache file: {exc}; {fix}") from None
    except UNREADABLE as exc:
        raise UserError(f"{path}: text encoder output cache file cannot be read ({exc}); {fix}") from None
    return {name: torch.from_numpy(arrays[name].astype(np.float32)) for name in names}


def write(path: Path, outputs: dict[str, torch.Tensor], key: str) -> None:
    """Write one cache file atomically (``write_file_atomic``); a failure to write is a UserError naming it."""
    arrays = {name: t.float().cpu().numpy() for name, t in outputs.items()}
    arrays[CACHE_KEY] = np.array(key)
    try:
        write_file_atomic(path, lambda f: np.savez(f, **arrays))
    except OSError as exc:
        raise UserError(f"{path}: cannot write the text encoder output cache ({exc.strerror or exc}); free some "
                        "space or make the folder writable, or use --cache_text_encoder_outputs (in RAM)") from None
