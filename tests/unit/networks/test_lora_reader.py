"""``networks.lora_format``'s one reader of LoRA files: ``load_weights_file`` (tensors) and ``weights_shapes`` (names
and shapes, a .safetensors header only) accept and refuse the same files, and name the file, the option that gave it
and what is wrong. Files are written here with safetensors' and torch's own savers."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from library.base.errors import UserError
from networks.lora_format import load_weights_file, weights_shapes

NAME = "lora_unet_mid_block_attentions_0_proj_in"
READERS = {"tensors": load_weights_file, "shapes": weights_shapes}


def _lora() -> dict[str, torch.Tensor]:
    return {f"{NAME}.lora_down.weight": torch.ones(4, 32), f"{NAME}.lora_up.weight": torch.ones(32, 4),
            f"{NAME}.alpha": torch.tensor(2.0)}


@pytest.mark.parametrize("ext", [".safetensors", ".pt"])
def test_a_lora_file_reads_the_same_through_both(tmp_path, ext):
    path = tmp_path / f"lora{ext}"
    if ext == ".safetensors":
        save_file(_lora(), str(path))
    else:
        torch.save(_lora(), str(path))
    tensors = load_weights_file(path)
    torch.testing.assert_close(tensors, _lora())
    assert weights_shapes(path) == {f"{NAME}.lora_down.weight": (4, 32), f"{NAME}.lora_up.weight": (32, 4),
                                    f"{NAME}.alpha": ()}


def _bad_files(tmp_path):
    cut = tmp_path / "cut.safetensors"
    save_file(_lora(), str(cut))
    cut.write_bytes(cut.read_bytes()[:100])
    empty = tmp_path / "empty.safetensors"
    save_file({}, str(empty))
    empty_pickle = tmp_path / "empty.pt"
    torch.save({}, str(empty_pickle))
    a_list = tmp_path / "list.pt"
    torch.save([torch.ones(2)], str(a_list))
    nested = tmp_path / "state.ckpt"
    torch.save({"state_dict": _lora(), "epoch": 3}, str(nested))
    text = tmp_path / "notes.pt"
    text.write_text("not a pickle")
    return [
        (tmp_path / "nope.safetensors", r"nope.safetensors: no such file"),
        (cut, r"cut.safetensors: cannot be read as a .safetensors file .*truncated"),
        (empty, r"empty.safetensors: holds no tensors"),
        (empty_pickle, r"empty.pt: holds no tensors"),
        (a_list, r"list.pt: holds a list, not a dict of LoRA tensors"),
        (nested, r"state.ckpt: 'state_dict' holds a dict, not a tensor"),
        (text, r"notes.pt: cannot be read as plain tensors .*convert it to .safetensors"),
    ]


@pytest.mark.parametrize("reader", READERS.values(), ids=READERS.keys())
def test_both_refuse_the_same_files_naming_the_option_and_the_problem(tmp_path, reader):
    for path, message in _bad_files(tmp_path):
        with pytest.raises(UserError, match=rf"^--base_weights .*{message}") as caught:
            reader(path, "--base_weights")
        assert str(path) in str(caught.value)
        with pytest.raises(UserError, match=message):
            reader(path)
