"""The LoRA file format, as sd-scripts' ``networks/lora.py`` and ``library/train_util.py`` read and write it.

Loading: a ``.safetensors`` file, or a torch pickle read with ``weights_only=True`` (plain tensors only).
Saving (§9.7) is atomic (a temporary sibling, then ``os.replace``); ``.safetensors`` gets the metadata plus
``sshs_model_hash`` / ``sshs_legacy_hash`` as sd-scripts' ``train_util.precalculate_safetensors_hashes``; other
extensions use ``torch.save``. Tensors are cast for saving (``--save_precision``) by ``cast_for_saving``. The network
modules (``networks.lora``, ``networks.lora_fa``, ``networks.lycoris_adapter``) and the trainer share these functions.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path

import torch

from library.base.errors import UserError
from library.base.files import write_bytes_atomic, write_file_atomic

__all__ = ["cast_for_saving", "load_weights_file", "safetensors_hashes", "save_weights_file"]


def load_weights_file(file: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Tensors of a ``.safetensors`` file, or of a torch pickle (loaded with ``weights_only=True``)."""
    path = os.fspath(file)
    if not os.path.isfile(path):
        raise UserError(f"network weights file not found: {path}")
    if path.endswith(".safetensors"):
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(path)
        except (SafetensorError, OSError) as exc:
            raise UserError(f"{path}: not a readable .safetensors file ({exc})") from None
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises UnpicklingError, RuntimeError, EOFError, ... for a bad file
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UserError(f"{path}: cannot be read as plain tensors ({first}); a pickle that needs more than that "
                        "could run code, so it is not loaded: convert it to .safetensors") from None
    if not isinstance(loaded, dict) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
        raise UserError(f"{path}: holds a {type(loaded).__name__}, not a dict of LoRA tensors")
    return loaded


def weights_shapes(file: str | os.PathLike[str] | None, weights_sd: Mapping[str, torch.Tensor] | None
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


def safetensors_hashes(state_dict: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> tuple[str, str]:
    """``(sshs_model_hash, sshs_legacy_hash)`` as sd-scripts' ``precalculate_safetensors_hashes``.

    Both hash the safetensors serialisation with only the ``ss_*`` metadata: the model hash is sha256 of the
    bytes after the header (the tensor payload, the same in the final file), the legacy hash the first 8 hex chars
    of sha256 of the 64 KiB at offset 1 MiB, i.e. of nothing (``e3b0c442``) for files under 1 MiB.
    """
    from safetensors.torch import save

    data = save(dict(state_dict), {k: v for k, v in metadata.items() if k.startswith("ss_")})
    header_len = int.from_bytes(data[:8], "little")
    model_hash = hashlib.sha256(data[8 + header_len:]).hexdigest()
    legacy_hash = hashlib.sha256(data[0x100000:0x100000 + 0x10000]).hexdigest()[:8]
    return model_hash, legacy_hash


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
        from safetensors.torch import save

        meta = {str(k): str(v) for k, v in (metadata or {}).items()}
        meta["sshs_model_hash"], meta["sshs_legacy_hash"] = safetensors_hashes(state_dict, meta)
        write_bytes_atomic(path, save(dict(state_dict), meta))
    else:
        write_file_atomic(path, lambda f: torch.save(dict(state_dict), f))
