"""Latent cache files, compatible with sd-scripts' (``strategy_sd.SdSdxlLatentsCachingStrategy``).

File: ``<image stem>_<W:04d>x<H:04d><suffix>.npz`` beside the image, the suffix the model family's
(``FamilySpec.latent_suffix``, as sd-scripts keeps the families' files apart), W×H the original (upright) image size;
uncompressed ``np.savez`` with ``latents`` (float32 [C, h, w], unscaled VAE sample; C the family's
``latent_channels``), ``original_size`` [W, H], ``crop_ltrb``, ``latents_flipped`` (with
flip_aug) and ``alpha_mask`` (float32 [H, W] in [0, 1] at the bucket size, with alpha_mask; unflipped). sd-scripts
reads these files as its own. A file without ``alpha_mask`` is rebuilt when the mask is needed; one with it serves a
run without masks too (the key is not read then).

Added key ``sdsb_cache_key``: a JSON string with the SHA-1 of the image file, the bucket, the resized size and the
VAE id. A file whose key differs is rebuilt, so an edited image, a new resolution or another VAE never reuses stale
latents (sd-scripts checks only that ``latents`` exists). Files sd-scripts wrote (no key) are reused when their
latent shape matches the bucket, as sd-scripts would. A file that would be used but is damaged (it cannot be read,
or an array is not floating point, has the wrong shape, holds more than its header declares or holds NaN/Inf; all
but the last are seen in the array's header before numpy allocates it: ``cache_arrays``) is rebuilt with a warning
naming it; with ``--skip_cache_check`` it is named when a batch reads it (exit 2). Files are written as every file of
the trainer (``library/base/files.write_file_atomic``: a temporary name, flushed to disk, renamed; mode 0666 less the
umask), so an interrupted run never leaves a half-written cache; a rebuilt file is written fresh (old keys are not
carried over).
"""

from __future__ import annotations

import hashlib
import json
import logging
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from library.base.errors import UserError
from library.base.files import write_file_atomic
from library.data.cache_arrays import DamagedCache, declared, load_array, load_key

CACHE_KEY = "sdsb_cache_key"
LATENT_CHANNELS = 4  # a Stable Diffusion VAE's; other autoencoders' files say theirs (``LatentFiles``)
LATENT_STRIDE = 8
UNREADABLE = (OSError, ValueError, zipfile.BadZipFile, EOFError)  # np.load of a damaged or hostile file

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LatentFiles:
    """A model family's latent cache files: their name suffix and the channels of their latents."""

    suffix: str
    channels: int


def npz_path(image_path: str | Path, original_size: tuple[int, int], suffix: str) -> Path:
    """sd-scripts' cache file name for an image of ``original_size`` (W, H); ``suffix``: the family's."""
    image_path = Path(image_path)
    return image_path.with_name(f"{image_path.stem}_{original_size[0]:04d}x{original_size[1]:04d}{suffix}.npz")


def file_sha1(path: str | Path) -> str:
    digest = hashlib.sha1()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def cache_key(sha1: str, bucket: tuple[int, int], resized: tuple[int, int], vae_id: str) -> str:
    """What the cached latents depend on, as a stable JSON string."""
    return json.dumps({"sha1": sha1, "bucket": list(bucket), "resized": list(resized), "vae_id": vae_id},
                      sort_keys=True)


def exists(path: Path) -> bool:
    """``--skip_cache_check``: sd-scripts still checks that the file exists, and trusts it unopened when it does. The
    content key is not checked either, so an edited image or another VAE reuses the old latents; a file of the wrong
    latent shape or without ``latents_flipped`` / ``alpha_mask`` is reported when a batch reads it."""
    return path.is_file()


def expected_shapes(bucket: tuple[int, int], flip_aug: bool, alpha_mask: bool,
                    channels: int = LATENT_CHANNELS) -> dict[str, tuple[int, ...]]:
    """The arrays a cache file needs for an image in ``bucket`` (W, H), with their shapes."""
    latents = (channels, bucket[1] // LATENT_STRIDE, bucket[0] // LATENT_STRIDE)
    shapes = {"latents": latents}
    if flip_aug:
        shapes["latents_flipped"] = latents
    if alpha_mask:
        shapes["alpha_mask"] = (bucket[1], bucket[0])
    return shapes


def is_valid(path: Path, bucket: tuple[int, int], flip_aug: bool, key: str, alpha_mask: bool = False,
             channels: int = LATENT_CHANNELS) -> bool:
    """True when ``path`` holds latents for ``bucket`` (and flipped ones with ``flip_aug``, the bucket-sized alpha
    mask with ``alpha_mask``) made under ``key``. A file made for something else (another key; without a key, as
    sd-scripts writes them, latents of another bucket) or lacking an array is rebuilt quietly; a damaged one with a
    warning naming it."""
    if not path.is_file():
        return False
    expected = expected_shapes(bucket, flip_aug, alpha_mask, channels)
    try:
        with np.load(path, allow_pickle=False) as npz:  # an object array in a hostile file would unpickle
            stored_key = load_key(npz, CACHE_KEY) if CACHE_KEY in npz.files else None
            if (stored_key is not None and stored_key != key) or any(name not in npz.files for name in expected):
                return False
            if stored_key is None and declared(npz, "latents")[0] != expected["latents"]:
                return False  # sd-scripts' file for another bucket
            for name, shape in expected.items():
                load_array(npz, name, shape, f"the image's bucket {bucket[0]}x{bucket[1]}")
    except DamagedCache as exc:
        log.warning("%s: damaged latent cache file (%s); rebuilding it", path, exc)
        return False
    except UNREADABLE as exc:
        log.warning("%s: latent cache file cannot be read (%s); rebuilding it", path, exc)
        return False
    return True


def read(path: str | Path, bucket: tuple[int, int], flipped: bool, alpha_mask: bool = False,
         channels: int = LATENT_CHANNELS) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The cached latents (or their mirror image) of one image for ``bucket`` and, with ``alpha_mask``, its
    (unflipped) mask; a file that cannot serve them, which only ``--skip_cache_check`` lets through, is a UserError
    naming it."""
    name = "latents_flipped" if flipped else "latents"
    shapes = expected_shapes(bucket, flipped, alpha_mask, channels)
    expected = {needed: shapes[needed] for needed in (name, "alpha_mask") if needed in shapes}
    fix = "delete it or run without --skip_cache_check, so that it is rebuilt"
    try:
        with np.load(path, allow_pickle=False) as npz:
            for needed in expected:
                if needed not in npz.files:
                    raise UserError(f"{path}: latent cache file has no {needed}; {fix}")
            arrays = {needed: load_array(npz, needed, shape, f"the image's bucket {bucket[0]}x{bucket[1]}")
                      for needed, shape in expected.items()}
    except DamagedCache as exc:
        raise UserError(f"{path}: latent cache file: {exc}; {fix}") from None
    except UNREADABLE as exc:
        raise UserError(f"{path}: latent cache file cannot be read ({exc}); {fix}") from None
    mask = torch.from_numpy(arrays["alpha_mask"].astype(np.float32)) if alpha_mask else None
    return torch.from_numpy(arrays[name].astype(np.float32)), mask


def write(path: Path, latents: torch.Tensor, original_size: tuple[int, int],
          crop_ltrb: tuple[float, float, float, float], flipped: torch.Tensor | None, key: str,
          alpha_mask: torch.Tensor | None = None) -> None:
    """Write one cache file atomically (temporary file in the same folder, then rename), mode 0666 less the umask."""
    arrays = {
        "latents": latents.float().cpu().numpy(),
        "original_size": np.array(original_size),
        "crop_ltrb": np.array(crop_ltrb),
        CACHE_KEY: np.array(key),
    }
    if flipped is not None:
        arrays["latents_flipped"] = flipped.float().cpu().numpy()
    if alpha_mask is not None:
        arrays["alpha_mask"] = alpha_mask.float().cpu().numpy()
    write_file_atomic(path, lambda f: np.savez(f, **arrays))
