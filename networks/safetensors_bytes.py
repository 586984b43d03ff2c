"""The safetensors file layout, written in one pass: what ``safetensors.torch.save`` writes, without its per-tensor
pointer wrapping (about 0.12 ms per tensor through ctypes and numpy: 0.36 s for a tiny SDXL LoRA's 2,958 tensors)
and without building the whole file in memory (``save`` returns it as one ``bytes``: a second copy of a full
fine-tuning checkpoint, 4.3 GB for SD 1.5 in fp32); ``write`` streams the tensors into the file one at a time.

Layout (safetensors 0.4-0.8, ``safetensors/src/tensor.rs`` ``prepare``/``serialize``): an 8-byte little-endian header
length, the header (compact JSON, ``__metadata__`` first, then one entry per tensor: dtype, shape, data offsets,
padded with spaces to a multiple of 8 bytes), then the tensor bytes with no gaps. The tensors are laid out by dtype
(``ORDER``: the library's dtype enum, largest first, which puts wider alignments first), then by name; the header
lists them in that order. Metadata keys keep the caller's order (the library's own order is random). The payload is
therefore the library's byte for byte, which sd-scripts' ``sshs_model_hash`` (sha256 of the payload) depends on.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Mapping
from typing import BinaryIO

import torch

# The safetensors dtype names, in the order the library lays tensors out (its enum, descending).
ORDER: dict[torch.dtype, str] = {
    torch.uint64: "U64", torch.int64: "I64", torch.float64: "F64", torch.complex64: "C64", torch.float32: "F32",
    torch.uint32: "U32", torch.int32: "I32", torch.bfloat16: "BF16", torch.float16: "F16", torch.uint16: "U16",
    torch.int16: "I16", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
_RANK = {dtype: rank for rank, dtype in enumerate(ORDER)}


def header(entries: Mapping[str, dict], metadata: Mapping[str, str] | None) -> bytes:
    """The length prefix and JSON header for ``entries`` (name -> dtype/shape/data_offsets, in layout order)."""
    head = {"__metadata__": dict(metadata), **entries} if metadata is not None else dict(entries)
    encoded = json.dumps(head, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)
    return len(encoded).to_bytes(8, "little") + encoded


def _stored(tensor: torch.Tensor, cast: torch.dtype | None) -> torch.dtype:
    """The dtype ``tensor`` is written in: ``cast`` for a floating-point tensor when given, else its own."""
    return cast if cast is not None and tensor.is_floating_point() else tensor.dtype


def _raw(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def layout(tensors: Mapping[str, torch.Tensor], cast: torch.dtype | None = None
           ) -> tuple[dict[str, dict], list[torch.Tensor]]:
    """The header entries (in layout order) and the payload's parts (in the same order) for ``tensors``; a
    ``ValueError`` naming a tensor whose dtype safetensors has no name for. Without ``cast`` the parts are each CPU
    tensor's bytes (a ``uint8`` view; no copy of a contiguous tensor); with it the tensors themselves, which
    ``chunks`` converts (floating-point ones to ``cast``, on any device) one at a time as they are written."""
    if sys.byteorder != "little":
        raise ValueError("safetensors stores little-endian bytes; this writer does not swap them")
    unknown = [name for name, tensor in tensors.items() if _stored(tensor, cast) not in _RANK]
    if unknown:
        raise ValueError(f"{unknown[0]}: safetensors cannot store {_stored(tensors[unknown[0]], cast)}")
    names = sorted(tensors, key=lambda name: (_RANK[_stored(tensors[name], cast)], name))
    entries, parts, offset = {}, [], 0
    for name in names:
        tensor = tensors[name].detach()
        dtype = _stored(tensor, cast)
        size = tensor.numel() * dtype.itemsize
        entries[name] = {"dtype": ORDER[dtype], "shape": list(tensor.shape), "data_offsets": [offset, offset + size]}
        parts.append(tensor if cast is not None else _raw(tensor))
        offset += size
    return entries, parts


def chunks(parts: list[torch.Tensor], cast: torch.dtype | None = None) -> Iterator[memoryview]:
    """The payload, one tensor's bytes at a time (what follows the header, with no gaps); with ``cast`` (as given
    to ``layout``) each part is brought to the host and converted just before its bytes are written."""
    for part in parts:
        if cast is not None:
            part = _raw(part.to("cpu", _stored(part, cast)))
        yield memoryview(part.numpy()).cast("B")


def write(file: BinaryIO, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None,
          cast: torch.dtype | None = None) -> None:
    """Write ``tensors`` with ``metadata`` to the open ``file``, one tensor at a time: no copy of the whole payload
    is made, whatever the model's size. ``cast``: the dtype floating-point tensors are stored in, each converted as
    it is written (sd-scripts' ``mem_eff_save_file`` converts the same way), so no converted copy of the model is
    made either; the tensors may then be on any device."""
    entries, parts = layout(tensors, cast)
    file.write(header(entries, metadata))
    for chunk in chunks(parts, cast):
        file.write(chunk)
