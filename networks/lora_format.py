"""The LoRA file format, as sd-scripts' ``networks/lora.py`` and ``library/train_util.py`` read and write it.

Loading: a ``.safetensors`` file, or a torch pickle read with ``weights_only=True`` (plain tensors only). One reader
with one set of rules serves every LoRA file (``--network_weights``, ``--base_weights``,
``create_network_from_weights``, ``load_weights``): a missing, unreadable or empty file, or one holding anything but
tensors, is a ``UserError`` naming the file (and the option that gave it) and what is wrong.
Saving is atomic (a temporary sibling, then ``os.replace``); ``.safetensors`` (laid out by ``safetensors_bytes``)
gets the metadata plus ``sshs_model_hash`` / ``sshs_legacy_hash`` as sd-scripts'
``train_util.precalculate_safetensors_hashes``; other extensions use ``torch.save``. Tensors are cast for saving
(``--save_precision``) by ``cast_for_saving``. The network modules (``networks.lora``, ``networks.lora_fa``,
``networks.lycoris_adapter``) and the trainer share these functions.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch

from library.base.errors import UserError
from library.base.files import write_file_atomic
from networks import safetensors_bytes

__all__ = ["cast_for_saving", "load_weights_file", "module_ranks", "safetensors_hashes", "save_weights_file",
           "weights_shapes"]


def load_weights_file(file: str | os.PathLike[str], flag: str = "") -> dict[str, torch.Tensor]:
    """The tensors of a LoRA file: a ``.safetensors`` file, or a torch pickle (loaded with ``weights_only=True``)
    holding a dict of tensors. A file that is missing, unreadable, empty or holding anything but tensors is a
    ``UserError`` naming it (after ``flag``, the option that gave it, when given) and what is wrong."""
    path, name = _existing(file, flag)
    if not path.lower().endswith(".safetensors"):
        return _load_pickle(path, name)
    from safetensors.torch import load_file

    with _safetensors_errors(name):
        return _not_empty(load_file(path), name)


def weights_shapes(file: str | os.PathLike[str], flag: str = "") -> dict[str, tuple[int, ...]]:
    """Every tensor's name and shape of a LoRA file, by the rules of ``load_weights_file`` (a ``.safetensors``
    file's header only, so that a pre-load check reads no tensor data)."""
    path, name = _existing(file, flag)
    if not path.lower().endswith(".safetensors"):
        return {key: tuple(value.shape) for key, value in _load_pickle(path, name).items()}
    from safetensors import safe_open

    with _safetensors_errors(name), safe_open(path, framework="pt") as f:
        return _not_empty({key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}, name)


def _existing(file: str | os.PathLike[str], flag: str) -> tuple[str, str]:
    """The path, and how messages name it (``--network_weights path``)."""
    path = os.fspath(file)
    name = f"{flag} {path}" if flag else path
    if not os.path.isfile(path):
        raise UserError(f"{name}: no such file; give a LoRA .safetensors (or .pt/.ckpt) file")
    return path, name


@contextmanager
def _safetensors_errors(name: str) -> Iterator[None]:
    from safetensors import SafetensorError

    try:
        yield
    except (SafetensorError, OSError) as exc:
        raise UserError(f"{name}: cannot be read as a .safetensors file ({exc}); it is truncated or not a "
                        "safetensors file: copy it again, or give another LoRA") from None


def _load_pickle(path: str, name: str) -> dict[str, torch.Tensor]:
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises UnpicklingError, RuntimeError, EOFError, ... for a bad file
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UserError(f"{name}: cannot be read as plain tensors ({first}); a pickle that needs more than that "
                        "could run code, so it is not loaded: convert it to .safetensors") from None
    if not isinstance(loaded, dict):
        raise UserError(f"{name}: holds a {type(loaded).__name__}, not a dict of LoRA tensors")
    other = next((key for key, value in loaded.items() if not isinstance(value, torch.Tensor)), None)
    if other is not None:
        raise UserError(f"{name}: {other!r} holds a {type(loaded[other]).__name__}, not a tensor: a LoRA file holds "
                        "tensors only (this may be a training state or another kind of checkpoint)")
    return _not_empty(loaded, name)


def _not_empty(weights: dict, name: str) -> dict:
    if not weights:
        raise UserError(f"{name}: holds no tensors; give a LoRA .safetensors file")
    return weights


def module_ranks(file: str | os.PathLike[str] | None, weights_sd: Mapping[str, torch.Tensor] | None
                 ) -> tuple[Mapping[str, torch.Tensor], dict[str, int], dict[str, object]]:
    """A saved LoRA's tensors (read from ``file`` unless given) with each module's rank (its ``lora_down``'s first
    dimension) and alpha (its ``.alpha``; the rank where absent, as old files): what ``create_network_from_weights``
    shapes a network by."""
    if weights_sd is None:
        if file is None:
            raise UserError("create_network_from_weights needs a file or weights_sd")
        weights_sd = load_weights_file(file)
    dims: dict[str, int] = {}
    alphas: dict[str, object] = {}
    for key, value in weights_sd.items():
        lora_name, _, rest = key.partition(".")
        if rest == "alpha":
            alphas[lora_name] = value
        elif rest == "lora_down.weight":
            dims[lora_name] = int(value.shape[0])
    for name, dim in dims.items():
        alphas.setdefault(name, dim)
    return weights_sd, dims, alphas


def safetensors_hashes(header_bytes: bytes, parts: list[torch.Tensor]) -> tuple[str, str]:
    """``(sshs_model_hash, sshs_legacy_hash)`` of the safetensors serialisation ``header_bytes`` + the tensor bytes
    ``parts`` (``safetensors_bytes.layout``) with only the ``ss_*`` metadata, as sd-scripts'
    ``precalculate_safetensors_hashes``: the model hash is sha256 of the tensor payload (the same in the final file),
    the legacy hash the first 8 hex chars of sha256 of the 64 KiB at offset 1 MiB, i.e. of nothing (``e3b0c442``)
    for files under 1 MiB."""
    model, window, offset = hashlib.sha256(), bytearray(), len(header_bytes)
    window += header_bytes[0x100000:0x110000]
    for chunk in safetensors_bytes.chunks(parts):
        model.update(chunk)
        lo, hi = max(0x100000, offset), min(0x110000, offset + len(chunk))
        if lo < hi:
            window += chunk[lo - offset:hi - offset]
        offset += len(chunk)
    return model.hexdigest(), hashlib.sha256(window).hexdigest()[:8]


def cast_for_saving(state_dict: Mapping[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """The tensors as a LoRA file holds them: on the CPU, in ``dtype`` (``--save_precision``) when given, except a
    scalar (``alpha``) whose value ``dtype`` cannot hold, which keeps its own dtype, so that no file holds Inf: the
    kohya_ss GUI's LoKr presets use ``network_dim`` 100000, a full matrix whose alpha (100000, unused by LyCORIS
    then) is Inf in fp16. Loaders read alpha with ``.item()``, whatever its dtype."""
    out = {}
    for key, value in state_dict.items():
        tensor = value.detach().to("cpu")
        cast = tensor.to(dtype or tensor.dtype)
        if cast.dim() == 0 and cast.is_floating_point() and not torch.isfinite(cast) and torch.isfinite(tensor):
            cast = tensor
        out[key] = cast.clone().contiguous()
    return out


def save_weights_file(state_dict: Mapping[str, torch.Tensor], file: str | os.PathLike[str],
                      metadata: Mapping[str, str] | None) -> None:
    """Write through a temporary sibling and a rename (``library.base.files``), so that a crash never leaves a
    half-written LoRA; the file gets the usual permissions (0666 less the umask)."""
    path = Path(os.fspath(file))
    if path.suffix == ".safetensors":
        meta = {str(k): str(v) for k, v in (metadata or {}).items()}
        entries, parts = safetensors_bytes.layout(state_dict)
        hashed = safetensors_bytes.header(entries, {k: v for k, v in meta.items() if k.startswith("ss_")})
        meta["sshs_model_hash"], meta["sshs_legacy_hash"] = safetensors_hashes(hashed, parts)
        head = safetensors_bytes.header(entries, meta)
        write_file_atomic(path, lambda f: f.writelines([head, *safetensors_bytes.chunks(parts)]))
    else:
        write_file_atomic(path, lambda f: torch.save(dict(state_dict), f))
