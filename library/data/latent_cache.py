"""Latent cache files, compatible with sd-scripts' (``strategy_sd.SdSdxlLatentsCachingStrategy``).

File: ``<image stem>_<W:04d>x<H:04d>_sd.npz`` (SDXL: ``_sdxl.npz``, as sd-scripts keeps the two apart) beside the
image, W×H the original (upright) image size; uncompressed
``np.savez`` with ``latents`` (float32 [4, h, w], unscaled VAE sample), ``original_size`` [W, H], ``crop_ltrb``,
``latents_flipped`` (with flip_aug) and ``alpha_mask`` (float32 [H, W] in [0, 1] at the bucket size, with
alpha_mask; unflipped). sd-scripts reads these files as its own. A file without ``alpha_mask`` is rebuilt when the
mask is needed; one with it serves a run without masks too (the key is not read then).

Added key ``sdsb_cache_key``: a JSON string with the SHA-1 of the image file, the bucket, the resized size and the
VAE id. A file whose key differs is rebuilt, so an edited image, a new resolution or another VAE never reuses stale
latents (sd-scripts checks only that ``latents`` exists). Files sd-scripts wrote (no key) are reused when their
latent shape matches the bucket, as sd-scripts would. Files are written to a temporary name and renamed, so an
interrupted run never leaves a half-written cache; a rebuilt file is written fresh (old keys are not carried over).
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import numpy as np
import torch

from library.base.errors import UserError
from library.base.files import write_file_atomic

CACHE_KEY = "sdsb_cache_key"
LATENT_CHANNELS = 4
LATENT_STRIDE = 8


def npz_path(image_path: str | Path, original_size: tuple[int, int], suffix: str = "_sd") -> Path:
    """sd-scripts' cache file name for an image of ``original_size`` (W, H); ``suffix`` ``_sdxl`` for SDXL."""
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


def is_valid(path: Path, bucket: tuple[int, int], flip_aug: bool, key: str, alpha_mask: bool = False) -> bool:
    """True when ``path`` holds latents for ``bucket`` (and flipped ones with ``flip_aug``, the bucket-sized alpha
    mask with ``alpha_mask``) made under ``key``."""
    if not path.is_file():
        return False
    expected = (LATENT_CHANNELS, bucket[1] // LATENT_STRIDE, bucket[0] // LATENT_STRIDE)
    try:
        with np.load(path, allow_pickle=False) as npz:  # an object array in a hostile file would unpickle
            if "latents" not in npz.files or tuple(npz["latents"].shape) != expected:
                return False
            if flip_aug and "latents_flipped" not in npz.files:
                return False
            if alpha_mask and ("alpha_mask" not in npz.files or npz["alpha_mask"].shape != (bucket[1], bucket[0])):
                return False
            if CACHE_KEY in npz.files:
                return str(npz[CACHE_KEY]) == key
            return True
    except (OSError, ValueError, zipfile.BadZipFile, EOFError):
        return False


def read(path: str | Path, bucket: tuple[int, int], flipped: bool,
         alpha_mask: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The cached latents (or their mirror image) of one image for ``bucket`` and, with ``alpha_mask``, its
    (unflipped) mask; a file that cannot serve them, which only ``--skip_cache_check`` lets through, is a UserError
    naming it."""
    name = "latents_flipped" if flipped else "latents"
    expected = (LATENT_CHANNELS, bucket[1] // LATENT_STRIDE, bucket[0] // LATENT_STRIDE)
    fix = "delete it or run without --skip_cache_check, so that it is rebuilt"
    try:
        with np.load(path, allow_pickle=False) as npz:
            for needed in (name, "alpha_mask") if alpha_mask else (name,):
                if needed not in npz.files:
                    raise UserError(f"{path}: latent cache file has no {needed}; {fix}")
            latents = np.array(npz[name], dtype=np.float32)
            mask = np.array(npz["alpha_mask"], dtype=np.float32) if alpha_mask else None
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise UserError(f"{path}: latent cache file cannot be read ({exc}); {fix}") from None
    if tuple(latents.shape) != expected or (mask is not None and mask.shape != (bucket[1], bucket[0])):
        raise UserError(f"{path}: latent cache file holds latents of shape {list(latents.shape)}, but the image's "
                        f"bucket {bucket[0]}x{bucket[1]} needs {list(expected)}; {fix}")
    return torch.from_numpy(latents), None if mask is None else torch.from_numpy(mask)


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
