"""``networks/safetensors_bytes.py`` against the safetensors library: the same payload bytes (which sd-scripts'
``sshs_model_hash`` hashes), the same header once parsed, every dtype the library stores, files it reads back, and
the tensors written without a copy of the payload."""

from __future__ import annotations

import io
import json

import pytest
import torch
from safetensors.torch import load, save

from networks import safetensors_bytes


def library_parts(data: bytes) -> tuple[dict, bytes]:
    size = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + size]), data[8 + size:]


def tensors_of_every_dtype() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    out = {}
    for index, dtype in enumerate(safetensors_bytes.ORDER):
        values = torch.randn(2, 3, generator=generator) * 50
        if dtype == torch.complex64:
            values = torch.complex(values, values.flip(0))
        for name in (f"b{index}", f"a{index}"):  # names out of order within a dtype
            out[name] = values.to(dtype).clone()
    out["scalar"] = torch.tensor(2.5)
    out["empty"] = torch.zeros(0, 4, dtype=torch.bfloat16)
    return out


@pytest.mark.parametrize("metadata", [None, {}, {"ss_b": "2", "ss_a": 'q"\\\n 日本'}], ids=["none", "empty", "some"])
def test_layout_and_header_are_the_librarys(metadata):
    tensors = tensors_of_every_dtype()
    file = io.BytesIO()
    safetensors_bytes.write(file, tensors, metadata)
    ours = file.getvalue()
    reference = save(tensors, metadata)
    (ours_header, ours_payload), (their_header, their_payload) = library_parts(ours), library_parts(reference)
    assert ours_payload == their_payload
    assert ours_header == their_header and list(ours_header) == list(their_header)  # tensors in the library's order
    assert len(ours) == len(reference) and int.from_bytes(ours[:8], "little") % 8 == 0
    back = load(ours)
    assert back.keys() == tensors.keys() and all(torch.equal(back[k], tensors[k]) for k in tensors)


def test_a_dtype_safetensors_cannot_store_is_named():
    with pytest.raises(ValueError, match="odd: safetensors cannot store torch.complex128"):
        safetensors_bytes.layout({"fine": torch.zeros(2), "odd": torch.zeros(2, dtype=torch.complex128)})


def test_the_payload_is_the_tensors_own_memory_not_a_copy():
    tensors = {"w": torch.randn(64, 32), "b": torch.randn(32).to(torch.bfloat16)}
    _, parts = safetensors_bytes.layout(tensors)
    assert sorted(part.data_ptr() for part in parts) == sorted(t.data_ptr() for t in tensors.values())


@pytest.mark.parametrize("cast", [torch.bfloat16, torch.float16, torch.float32])
def test_a_cast_writes_what_the_library_writes_for_the_converted_tensors(cast):
    """``cast`` converts each floating-point tensor as it is written (sd-scripts' ``--mem_eff_save`` way): the file
    is the library's for the tensors converted beforehand (the integer and bool ones kept), layout order included."""
    tensors = tensors_of_every_dtype()
    file = io.BytesIO()
    safetensors_bytes.write(file, tensors, {"k": "v"}, cast=cast)
    converted = {k: v.to(cast) if v.is_floating_point() else v for k, v in tensors.items()}
    assert file.getvalue() == save(converted, {"k": "v"})


def test_a_cast_converts_one_tensor_at_a_time():
    """No converted copy of the whole model exists while writing: ``layout`` keeps the tensors themselves and
    ``chunks`` converts one when its bytes are asked for."""
    tensors = {"w": torch.randn(64, 32), "b": torch.randn(32)}
    _, parts = safetensors_bytes.layout(tensors, cast=torch.bfloat16)
    assert sorted(part.data_ptr() for part in parts) == sorted(t.data_ptr() for t in tensors.values())
    assert all(part.dtype == torch.float32 for part in parts)
    first = next(safetensors_bytes.chunks(parts, cast=torch.bfloat16))
    assert len(first) == parts[0].numel() * 2
