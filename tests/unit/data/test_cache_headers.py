"""Cache files whose ``.npy`` member headers ask for more than the family's caches hold: a hand-edited header declaring
shape (2**40, 64) (256 TiB of float32), a cache key of as many strings, a member holding more bytes than its
header declares (a zip bomb). Each is rebuilt with a warning naming the file, or refused with a ``UserError`` naming
it (``--skip_cache_check``), before numpy allocates anything; before, ``np.load`` stopped the run with numpy's
``_ArrayMemoryError``. The files are written by the trainer's own writers (``latent_cache.write``,
``text_cache.write``), then one member is replaced by a hand-made header (``numpy.lib.format.write_array_header_1_0``)
and a few bytes of data.
"""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from library.base.errors import UserError
from library.data import latent_cache, text_cache
from library.data.latent_cache import CACHE_KEY
from library.data.text_cache import ArrayNames

HUGE = (2**40, 64)  # 2**46 float32 values: 256 TiB
FLUX_LATENTS = 16  # FLUX.1's autoencoder channels (upstream flux_models.AutoEncoder z_channels)
FLUX_TE_SHAPES = {"l_pooled": (768,), "t5_out": (8, 32), "txt_ids": (8, 3), "t5_attn_mask": (8,)}
WARNED = "rebuilding it"


def _plant(path: Path, name: str, shape: tuple[int, ...], descr: str = "<f4", data: bytes = b"\0" * 64) -> None:
    """Replace member ``name`` of the npz file ``path`` by a header declaring ``shape`` of ``descr`` and ``data``."""
    with zipfile.ZipFile(path) as archive:
        members = {info.filename: archive.read(info) for info in archive.infolist()}
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": descr, "fortran_order": False, "shape": shape})
    members[f"{name}.npy"] = header.getvalue() + data
    with zipfile.ZipFile(path, "w") as archive:
        for member, content in members.items():
            archive.writestr(member, content)


def _latent_file(tmp_path: Path) -> Path:
    path = tmp_path / "img_0064x0064_flux.npz"
    latents = torch.zeros(FLUX_LATENTS, 8, 8)
    latent_cache.write(path, latents, (64, 64), (0, 0, 64, 64), latents.clone(), "key")
    return path


def _text_file(tmp_path: Path) -> tuple[Path, ArrayNames]:
    names = ArrayNames(tuple(FLUX_TE_SHAPES), FLUX_TE_SHAPES, "_flux_te.npz")
    path = text_cache.npz_path(tmp_path / "img.png", names)
    text_cache.write(path, {name: torch.zeros(shape) for name, shape in FLUX_TE_SHAPES.items()}, "key")
    return path, names


def _warned(caplog, path: Path, *words: str) -> bool:
    return any(str(path) in r.message and WARNED in r.message and all(w in r.message for w in words)
               for r in caplog.records)


@pytest.mark.parametrize("name", ["latents", "latents_flipped"])
def test_huge_latent_header_is_rebuilt_with_a_warning(tmp_path, caplog, name):
    path = _latent_file(tmp_path)
    assert latent_cache.is_valid(path, (64, 64), True, "key", channels=FLUX_LATENTS)  # the planted file is good
    _plant(path, name, HUGE)
    assert not latent_cache.is_valid(path, (64, 64), True, "key", channels=FLUX_LATENTS)
    assert _warned(caplog, path, f"{name} has shape [1099511627776, 64]", f"[{FLUX_LATENTS}, 8, 8]")


def test_huge_latent_header_is_named_when_a_trusted_file_is_read(tmp_path):
    path = _latent_file(tmp_path)
    _plant(path, "latents", HUGE)
    with pytest.raises(UserError, match=r"img_0064x0064_flux.npz: latent cache file: latents has shape "
                                        r"\[1099511627776, 64\], but the image's bucket 64x64 needs \[16, 8, 8\]"):
        latent_cache.read(path, (64, 64), False, channels=FLUX_LATENTS)


def test_huge_keyless_latent_header_is_another_buckets_file(tmp_path, caplog):
    path = tmp_path / "img_0064x0064_flux.npz"
    np.savez(path, latents=np.zeros((FLUX_LATENTS, 8, 8), np.float32))  # as sd-scripts writes them: no key
    _plant(path, "latents", HUGE)
    assert not latent_cache.is_valid(path, (64, 64), False, "key", channels=FLUX_LATENTS)


def test_huge_cache_key_is_rebuilt_with_a_warning(tmp_path, caplog):
    path = _latent_file(tmp_path)
    _plant(path, CACHE_KEY, HUGE, descr="<U64")  # 2**46 strings of 64 characters
    assert not latent_cache.is_valid(path, (64, 64), False, "key", channels=FLUX_LATENTS)
    assert _warned(caplog, path, f"{CACHE_KEY} is no cache key string")
    text_path, names = _text_file(tmp_path)
    _plant(text_path, CACHE_KEY, HUGE, descr="<U64")
    assert not text_cache.is_valid(text_path, "key", names)
    assert _warned(caplog, text_path, f"{CACHE_KEY} is no cache key string")


def test_zip_bomb_member_is_rebuilt_with_a_warning(tmp_path, caplog):
    path = _latent_file(tmp_path)
    good = np.zeros((FLUX_LATENTS, 8, 8), np.float32).tobytes()
    _plant(path, "latents", (FLUX_LATENTS, 8, 8), data=good + b"\0" * (1 << 20))  # right header, 1 MiB more data
    assert not latent_cache.is_valid(path, (64, 64), False, "key", channels=FLUX_LATENTS)
    assert _warned(caplog, path, "latents holds", "more than the")


@pytest.mark.parametrize("name", list(FLUX_TE_SHAPES))
def test_huge_text_output_header_is_rebuilt_or_refused(tmp_path, caplog, name):
    path, names = _text_file(tmp_path)
    assert text_cache.is_valid(path, "key", names)
    _plant(path, name, HUGE)
    assert not text_cache.is_valid(path, "key", names)
    assert _warned(caplog, path, f"{name} has shape [1099511627776, 64]")
    with pytest.raises(UserError, match=rf"img_flux_te.npz: text encoder output cache file: {name} has shape"):
        text_cache.read(path, names)


def test_huge_text_output_header_without_known_shapes_is_bounded(tmp_path, caplog):
    path, names = _text_file(tmp_path)
    _plant(path, "t5_out", HUGE)
    assert not text_cache.is_valid(path, "key", tuple(names))  # a plain tuple of names: no shape to compare with
    assert _warned(caplog, path, "t5_out declares shape [1099511627776, 64]")
