"""End to end: ``anima_train.py``, Anima full fine-tuning, on ``builtin:tiny-anima``: the DiT trains in bf16 with
StochasticAdamW stepped inside backward (``--fused_backward_pass``), its component learning rates in their own
optimizer groups (logged ``lr/<group>``; ``--mod_lr 0`` freezes the modulations), Qwen3 frozen; the checkpoint is one
``.safetensors`` file with upstream's ``net.`` keys and ModelSpec entries, which loads back (with the tiny model's
Qwen3 folder and VAE file, as an Anima file needs ``--qwen3`` and ``--vae``) and trains on, in fp32 without
``--full_bf16``; a resume from a step's state equals the uninterrupted run; ``--blocks_to_swap`` (a four-block tiny
DiT written as a file: the built-in's two blocks let none swap) trains the weights of no swapping bit for bit.

Expected facts come from upstream 48d368fa: ``anima_utils.save_anima_model`` (``dit.state_dict()`` with ``net.`` in
front, each tensor in the save dtype, ``format: pt``), ``get_sai_model_spec(..., is_stable_diffusion_ckpt=True,
anima="preview")`` (architecture anima-preview, Anima's implementation, no ``ss_*`` entries), the key set of
upstream's tiny ``Anima`` (``tests/data/upstream_anima_parity.safetensors``), ``anima_train.py``'s cast of the DiT
to fp32 without ``--full_bf16``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import train_network
from tests.e2e.test_fine_tune import images
from tests.e2e.test_validation import scalars
from tests.unit.families.anima.test_anima_fine_tune import upstream_tiny_keys

SCRIPT = "anima_train.py"
RATES = ("--learning_rate", "1e-3", "--self_attn_lr", "1e-4", "--mod_lr", "0")
FULL_BF16 = ("--mixed_precision", "bf16", "--full_bf16", "--optimizer_type", "StochasticAdamW",
             "--fused_backward_pass")


def common(out: Path, data: Path, *extra: str) -> list[str]:
    return ["--train_data_dir", str(data), "--caption_extension", ".txt", "--resolution", "64", "--output_dir",
            str(out), "--output_name", "model", "--train_batch_size", "2", "--seed", "3",
            "--max_data_loader_n_workers", "0", "--qwen3_max_token_length", "64", "--t5_max_token_length", "64",
            "--cache_latents", *RATES, *extra]


def start_dit() -> torch.nn.Module:
    from library.families.anima.builtin import build_tiny_dit

    return build_tiny_dit()


@pytest.fixture(scope="module")
def fine_tuned(tmp_path_factory):
    """Two updates of the DiT in bf16, a state saved after the first."""
    root = tmp_path_factory.mktemp("anima_train")
    data = images(root / "data")
    args = ["--pretrained_model_name_or_path", "builtin:tiny-anima", "--max_train_steps", "2",
            "--save_every_n_steps", "1", "--save_state", "--logging_dir", str(root / "logs"), *FULL_BF16]
    assert train_network.main(common(root / "out", data, *args), script=SCRIPT) == 0
    return root, data, args


def test_the_checkpoint_has_upstreams_keys_and_the_frozen_group_is_unchanged(fine_tuned):
    root, _, _ = fine_tuned
    saved = load_file(root / "out" / "model.safetensors")
    assert set(saved) == {f"net.{key}" for key in upstream_tiny_keys()}
    assert {tensor.dtype for tensor in saved.values()} == {torch.bfloat16}  # as trained (no --save_precision)
    start = {f"net.{key}": value.bfloat16() for key, value in start_dit().state_dict().items()}
    modulation = [key for key in saved if "adaln_modulation" in key and not key.startswith("net.llm_adapter.")]
    assert len(modulation) == 14 and all(torch.equal(saved[key], start[key]) for key in modulation)
    changed = {key.split(".")[1] for key in saved if key not in modulation and not torch.equal(saved[key], start[key])}
    assert {"x_embedder", "blocks", "llm_adapter", "final_layer", "t_embedder"} <= changed


def test_checkpoint_metadata_is_upstreams_modelspec(fine_tuned):
    root, _, _ = fine_tuned
    with safe_open(str(root / "out" / "model.safetensors"), "pt") as f:
        meta = f.metadata()
    assert meta["modelspec.architecture"] == "anima-preview" and meta["format"] == "pt"
    assert meta["modelspec.implementation"] == "https://huggingface.co/circlestone-labs/Anima"
    assert meta["modelspec.resolution"] == "64x64" and meta["modelspec.title"] == "model"
    assert not [key for key in meta if key.startswith("ss_")]


def test_each_component_group_logs_its_rate(fine_tuned):
    root, _, _ = fine_tuned
    logged = {tag: values for tag, values in scalars(root / "logs").items() if tag.startswith("lr/")}
    assert sorted(logged) == ["lr/base", "lr/cross_attn", "lr/llm_adapter", "lr/mlp", "lr/self_attn"]
    assert [step for step, _ in logged["lr/self_attn"]] == [1, 2]
    assert logged["lr/self_attn"][0][1] == pytest.approx(1e-4) and logged["lr/mlp"][0][1] == pytest.approx(1e-3)


def test_resume_from_the_step_state_equals_the_uninterrupted_run(fine_tuned, tmp_path):
    root, data, args = fine_tuned
    resumed = [*args, "--resume", str(root / "out" / "model-step00000001-state")]
    assert train_network.main(common(tmp_path, data, *resumed), script=SCRIPT) == 0
    a, b = load_file(root / "out" / "model.safetensors"), load_file(tmp_path / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_checkpoint_trains_on_in_fp32_with_the_qwen3_and_vae_files(fine_tuned, tmp_path):
    """Without ``--full_bf16`` the DiT trains in fp32 (upstream's ``dit.to(torch.float32)``), so the checkpoint is
    fp32 without ``--save_precision``; the mod group stays frozen, the others move on."""
    from library.families.anima.tiny_files import ANIMA_FILES, write_tiny_anima

    root, data, _ = fine_tuned
    write_tiny_anima(tmp_path / "tiny")
    before = load_file(root / "out" / "model.safetensors")
    argv = ["--pretrained_model_name_or_path", str(root / "out" / "model.safetensors"), "--max_train_steps", "1",
            "--mixed_precision", "bf16", "--qwen3", str(tmp_path / "tiny" / ANIMA_FILES[1]),
            "--vae", str(tmp_path / "tiny" / ANIMA_FILES[2])]
    assert train_network.main(common(tmp_path / "out", data, *argv), script=SCRIPT) == 0
    after = load_file(tmp_path / "out" / "model.safetensors")
    assert after.keys() == before.keys() and {tensor.dtype for tensor in after.values()} == {torch.float32}
    moved = {key for key in before if not torch.equal(after[key].bfloat16(), before[key])}
    assert moved and not any("adaln_modulation" in key and "llm_adapter" not in key for key in moved)
    assert len(moved) > len(before) // 2


def four_block_files(folder: Path) -> list[str]:
    """``--pretrained_model_name_or_path``, ``--qwen3`` and ``--vae`` of the tiny Anima with four DiT blocks."""
    from library.families.anima.builtin import TINY_BUILTIN
    from library.families.anima.model import AnimaTransformer
    from library.families.anima.tiny_files import ANIMA_FILES, write_tiny_anima
    from library.families.model_files import CONFIG_METADATA_KEY

    write_tiny_anima(folder)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        dit = AnimaTransformer(replace(TINY_BUILTIN, num_blocks=4))
    state = {f"net.{key}": value.detach().contiguous() for key, value in dit.state_dict().items()}
    save_file(state, str(folder / ANIMA_FILES[0]), metadata={CONFIG_METADATA_KEY: json.dumps(asdict(dit.params))})
    return ["--pretrained_model_name_or_path", str(folder / ANIMA_FILES[0]), "--qwen3", str(folder / ANIMA_FILES[1]),
            "--vae", str(folder / ANIMA_FILES[2])]


def test_swapping_blocks_trains_the_weights_of_no_swapping(tmp_path, monkeypatch):
    from library.families.block_swap import BlockSwap

    moves: list = []
    monkeypatch.setattr(BlockSwap, "record", lambda self, move: moves.append(move))
    data = images(tmp_path / "data")
    argv = [*four_block_files(tmp_path / "files"), "--max_train_steps", "2", *FULL_BF16]
    assert train_network.main(common(tmp_path / "plain", data, *argv), script=SCRIPT) == 0
    assert moves == []
    assert train_network.main(common(tmp_path / "swap", data, *argv, "--blocks_to_swap", "2"), script=SCRIPT) == 0
    assert {move.phase for move in moves} >= {"forward", "backward"}
    plain, swapped = (load_file(tmp_path / run / "model.safetensors") for run in ("plain", "swap"))
    assert plain.keys() == swapped.keys() and all(torch.equal(plain[k], swapped[k]) for k in plain)
    # the swapped blocks (the last two) trained: their Linear weights left the start's values (the norms' scales at
    # --self_attn_lr 1e-4 may keep theirs: bf16 steps of 2^-8 near 1)
    start = load_file(argv[1])
    moved = [k for k in start if k.startswith(("net.blocks.2.", "net.blocks.3."))
             and k.endswith(("_proj.weight", "mlp.layer1.weight", "mlp.layer2.weight"))]
    assert moved and all(not torch.equal(start[k].to(swapped[k].dtype), swapped[k]) for k in moved)
