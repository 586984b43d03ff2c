"""End to end: ``anima_train_network.py --blocks_to_swap N`` moves the last N DiT blocks' weights around their use
(host and device are both the CPU here, the same code path as on CUDA) and trains the LoRA of no swapping bit for bit,
Qwen3's LoRA too (its gradient arrives through the cross-attention context every block reads), with a sample image
drawn between the steps (the grad-free pass turns the window of resident blocks) equal to the one without swapping.

``builtin:tiny-anima`` has two blocks, which the limit (depth - 2) lets none swap; the DiT here is the tiny one with
four blocks, written as the files users give (``test_anima_fine_tune.four_block_files``; full fine-tuning with
swapped blocks is tested there).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from library.families.anima.model import STACK
from library.families.block_swap import BlockSwap, Move
from tests.e2e.test_anima_fine_tune import four_block_files
from tests.e2e.test_anima_train import anima_args, train

DEPTH = 4


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> list[str]:
    return four_block_files(tmp_path_factory.mktemp("anima-files"))


@pytest.fixture
def moves(monkeypatch) -> list[Move]:
    recorded: list[Move] = []
    monkeypatch.setattr(BlockSwap, "record", lambda self, move: recorded.append(move))
    return recorded


def run(out: Path, files: list[str], prompts: Path, *extra: str) -> None:
    assert train(anima_args(out, *files, "--gradient_checkpointing", "--sample_prompts", str(prompts),
                            "--sample_every_n_steps", "1", *extra)) == 0


def test_swapping_trains_the_lora_of_no_swapping_and_samples_the_same_image(files, tmp_path, moves, caplog):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red square --w 64 --h 64 --s 3 --d 5 --l 4.0 --n blurry\n")
    run(tmp_path / "plain", files, prompts)
    assert not moves
    caplog.set_level("INFO", logger="library.families.anima.swap")
    run(tmp_path / "swapped", files, prompts, "--blocks_to_swap", "2")
    assert "--blocks_to_swap 2: the last 2 of the DiT's 4 blocks" in caplog.text
    assert {(move.stack, move.phase) for move in moves} == {(STACK, "forward"), (STACK, "backward"), (STACK, "sample")}
    plain, swapped = (load_file(tmp_path / name / "lora.safetensors") for name in ("plain", "swapped"))
    assert plain.keys() == swapped.keys()
    assert len([k for k in plain if k.startswith("lora_unet_blocks_")]) == 3 * DEPTH * 10  # down, up, alpha
    assert [k for k in plain if k.startswith("lora_te_")]
    assert [k for k in plain if not torch.equal(plain[k], swapped[k])] == []
    plain_images, swapped_images = (sorted((tmp_path / name / "sample").iterdir()) for name in ("plain", "swapped"))
    assert [p.name.split("_")[1] for p in swapped_images] == ["000001", "000002"]  # between and after the steps
    pixels = [_pixels(p) for p in swapped_images]
    assert [_pixels(p) for p in plain_images] == pixels and pixels[0] != pixels[1]  # the LoRA's step shows


def _pixels(path: Path) -> bytes:
    from PIL import Image

    with Image.open(path) as image:
        return image.tobytes()


def test_above_the_limit_and_with_cpu_offload_checkpointing_are_refused(files, tmp_path, capsys):
    assert train(anima_args(tmp_path / "deep", *files, "--blocks_to_swap", "3")) == 2
    assert "--blocks_to_swap 3: cannot swap more than 2 blocks; this DiT has 4 blocks" in capsys.readouterr().err
    assert train(anima_args(tmp_path / "offload", "--blocks_to_swap", "1", "--gradient_checkpointing",
                            "--cpu_offload_checkpointing")) == 2
    assert "cannot be combined with --cpu_offload_checkpointing" in capsys.readouterr().err
