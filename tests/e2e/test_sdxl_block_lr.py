"""End to end: ``sdxl_train.py --block_lr`` on the built-in tiny SDXL. A block at learning rate 0 keeps its weights
bit for bit while the others train, and a wrong count stops with exit 2 before anything loads.

Blocks as upstream 48d368fa ``sdxl_train.py`` ``get_block_params_to_optimize`` numbers them on the SGM U-Net: 0 is
``time_embed`` + ``label_emb`` (diffusers' ``time_embedding``, ``add_embedding``), 1 is ``input_blocks.0``
(``conv_in``), 12 is ``middle_block.2`` (``mid_block.resnets.1``), 13 is ``output_blocks.0``
(``up_blocks.0.resnets.0``), 22 is ``out`` (``conv_norm_out``, ``conv_out``).
"""

from __future__ import annotations

import torch

import train_network
from tests.e2e.test_fine_tune import common, images

FROZEN = {0: ("time_embedding.", "add_embedding."), 1: ("conv_in.",), 12: ("mid_block.resnets.1.",)}
TRAINED = {13: ("up_blocks.0.resnets.0.",), 22: ("conv_norm_out.", "conv_out.")}


def _block_lr(zero: set[int]) -> str:
    return ",".join("0" if i in zero else "1e-3" for i in range(23))


def test_a_block_at_0_keeps_its_weights_and_the_others_train(tmp_path, caplog):
    from diffusers import UNet2DConditionModel

    from library.families.sdxl.loading import build_builtin_sdxl

    args = ["--pretrained_model_name_or_path", "builtin:tiny-sdxl", "--train_data_dir", str(images(tmp_path / "d")),
            "--caption_extension", ".txt", "--block_lr", _block_lr(set(FROZEN)),
            "--save_model_as", "diffusers_safetensors", "--max_train_steps", "2"]
    with caplog.at_level("INFO"):
        assert train_network.main(common(tmp_path / "out", *args), family="sdxl", script="sdxl_train.py") == 0
    assert "unet (lr block2 0.001, block3 0.001, " in caplog.text and "block12 " not in caplog.text
    saved = UNet2DConditionModel.from_pretrained(str(tmp_path / "out" / "model"), subfolder="unet",
                                                 local_files_only=True).state_dict()
    start = build_builtin_sdxl("builtin:tiny-sdxl", 0).unet.to(torch.bfloat16).state_dict()

    def keys(prefixes: tuple[str, ...]) -> list[str]:
        found = [key for key in start if key.startswith(prefixes)]
        assert found, prefixes
        return found

    for block, prefixes in FROZEN.items():
        for key in keys(prefixes):
            assert torch.equal(saved[key], start[key]), (block, key)
    for block, prefixes in TRAINED.items():
        assert any(not torch.equal(saved[key], start[key]) for key in keys(prefixes)), block


def test_a_wrong_count_stops_before_anything_loads(tmp_path, capsys):
    args = ["--pretrained_model_name_or_path", "builtin:tiny-sdxl", "--train_data_dir", str(tmp_path),
            "--block_lr", ",".join(["1e-4"] * 22)]
    assert train_network.main(common(tmp_path / "out", *args), family="sdxl", script="sdxl_train.py") == 2
    err = capsys.readouterr().err
    assert "--block_lr: 22 values given; SDXL's U-Net has 23 blocks" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()
