"""The check of the arrays a cache file holds (``latent_cache``, ``text_cache``): dtype, shape, size and finiteness.

It runs on the host, once per file when the file is validated (before training, to rebuild a damaged file with a
warning naming it) or read (a file ``--skip_cache_check`` trusted unopened: a ``UserError`` naming it), never on the
training device. sd-scripts checks only that the arrays are there (``strategy_sd`` / ``strategy_sdxl``
``is_disk_cached_*_expected``), so a wrong-shaped array fails in the middle of training and NaN/Inf latents show up
as a diverging loss.

An ``.npz`` file is a zip of ``.npy`` members, and ``np.load`` allocates whatever shape a member's header declares
before it reads a byte of data: a hand-edited header asking for (2**40, 64) floats stops the run with numpy's memory
error. So each member's header is read from the zip stream first (``numpy.lib.format.read_magic`` and
``read_array_header_*``), its dtype and shape are compared with what the model family's caches hold (the shape the
caller expects; a bounded size where no shape is known, as for the cache key), and its stored size with what the
header declares, before numpy loads it.
"""

from __future__ import annotations

import math

import numpy as np

FREE_SIZE = 1 << 24  # bytes an array of no expected shape may take (the cache key: a JSON string of a few KiB)
HEADER_READERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}


class DamagedCache(ValueError):
    """An array of a cache file that cannot serve, found before or after loading it; the message says why."""


def declared(npz: np.lib.npyio.NpzFile, name: str) -> tuple[tuple[int, ...], np.dtype]:
    """The shape and dtype the ``.npy`` header of member ``name`` declares, read without loading the array. A member
    that is no ``.npy`` array, or whose stored (decompressed) size is larger than its header declares (a zip bomb),
    is a ``DamagedCache``."""
    member = f"{name}.npy"
    if member not in npz.zip.namelist():
        raise DamagedCache(f"{name} is not an .npy array")
    info = npz.zip.getinfo(member)
    with npz.zip.open(info) as stream:
        version = np.lib.format.read_magic(stream)
        if version not in HEADER_READERS:
            raise DamagedCache(f"{name} has .npy format version {version[0]}.{version[1]}, which caches never use")
        shape, _fortran_order, dtype = HEADER_READERS[version](stream)
        size = stream.tell() + math.prod(shape) * dtype.itemsize
    if info.file_size > size:
        raise DamagedCache(f"{name} holds {info.file_size} bytes, more than the {size} its header declares")
    return tuple(shape), dtype


def load_array(npz: np.lib.npyio.NpzFile, name: str, shape: tuple[int, ...] | None, source: str) -> np.ndarray:
    """Array ``name`` of an open npz file, loaded once its header declares floating point values of ``shape``
    (``source`` says what needs that shape; None: any shape of at most ``FREE_SIZE`` bytes), and checked to hold no
    NaN or Inf; anything else is a ``DamagedCache`` saying what is wrong."""
    declared_shape, dtype = declared(npz, name)
    if dtype.kind != "f":
        raise DamagedCache(f"{name} holds {dtype} values, not floating point")
    if shape is not None and declared_shape != tuple(shape):
        raise DamagedCache(f"{name} has shape {list(declared_shape)}, but {source} needs {list(shape)}")
    size = math.prod(declared_shape) * dtype.itemsize
    if shape is None and size > FREE_SIZE:
        raise DamagedCache(f"{name} declares shape {list(declared_shape)} ({size} bytes), more than the {FREE_SIZE} "
                           "bytes a cache array may take")
    array = npz[name]
    if not np.isfinite(array).all():
        raise DamagedCache(f"{name} holds NaN or Inf")
    return array


def load_key(npz: np.lib.npyio.NpzFile, name: str) -> str:
    """The cache key of an open npz file (member ``name``): one string of at most ``FREE_SIZE`` bytes, loaded once
    its header says so; anything else is a ``DamagedCache``."""
    declared_shape, dtype = declared(npz, name)
    if dtype.kind not in "US" or declared_shape != () or dtype.itemsize > FREE_SIZE:
        raise DamagedCache(f"{name} is no cache key string of at most {FREE_SIZE} bytes (it declares {dtype} values "
                           f"of shape {list(declared_shape)})")
    return str(npz[name])
