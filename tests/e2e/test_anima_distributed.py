"""``anima_train_network.py`` and ``anima_train.py`` on 2 processes (torchrun, gloo, CPU), as
``test_flux_distributed.py`` runs FLUX.1: the shared machinery (gradient averaging, caches split between processes,
saving on the main process, exact resume, block swapping, the fused backward pass) with Anima's model.

One launch of ``tests/e2e/ddp_driver.py`` (its ``run_one`` for each run of the plan) runs the cases; each process
records its exit code and its network's (or DiT's) weights.

* ``bf16``: full bf16 + StochasticAdamW, accumulation 2, cached latents and text-encoder outputs,
  ``--network_train_unet_only``, 4 updates with the state saved after 2; ``bf16_resumed`` resumes from there on
  2 processes and ends as the uninterrupted run.
* ``swap`` / ``no_swap``: the LoRA with ``--blocks_to_swap 2`` on ``builtin:tiny-anima:blocks=4`` (gradient
  checkpointing), Qwen3's LoRA trained too: the same LoRA as without swapping.
* ``fine_tune_swap`` / ``fine_tune_no_swap``: ``anima_train.py`` (full bf16 StochasticAdamW, fused backward pass),
  where the swapped blocks' own weights are averaged and stepped inside backward: as without swapping, bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests import launching
from tests.e2e import ddp_driver
from tests.e2e.test_train_network import SAMPLES
from tests.launching import launch_env, torchrun

FULL_BF16_SR = ("--mixed_precision", "bf16", "--full_bf16", "--optimizer_type", "StochasticAdamW")
BF16_CACHED = (*FULL_BF16_SR, "--gradient_accumulation_steps", "2", "--cache_latents", "--cache_text_encoder_outputs",
               "--network_train_unet_only", "--max_train_steps", "4", "--save_every_n_steps", "2", "--save_state")
FOUR_BLOCKS = ("--pretrained_model_name_or_path", "builtin:tiny-anima:blocks=4")
SWAP = (*FOUR_BLOCKS, *FULL_BF16_SR, "--gradient_checkpointing", "--max_train_steps", "2")
FINE_TUNE_SWAP = (*FOUR_BLOCKS, *FULL_BF16_SR, "--fused_backward_pass", "--max_train_steps", "2")
RUNS = ("bf16", "bf16_resumed", "swap", "no_swap", "fine_tune_swap", "fine_tune_no_swap")


def anima_args(out: Path, *extra: str) -> list[str]:
    return ["--pretrained_model_name_or_path", "builtin:tiny-anima", "--train_data_dir", str(SAMPLES),
            "--caption_extension", ".txt", "--resolution", "64", "--output_dir", str(out), "--output_name", "lora",
            "--network_module", "networks.lora_anima", "--network_dim", "4", "--network_alpha", "2",
            "--learning_rate", "1e-3", "--train_batch_size", "2", "--seed", "1", "--max_data_loader_n_workers", "0",
            "--qwen3_max_token_length", "64", "--t5_max_token_length", "64", *extra]


def fine_tune(args: list[str]) -> list[str]:
    """The same run for ``anima_train.py``: the DiT's own weights, without the LoRA's flags."""
    lora = {"--network_module", "--network_dim", "--network_alpha"}
    return [arg for i, arg in enumerate(args) if arg not in lora and (i == 0 or args[i - 1] not in lora)]


def plan(out: Path) -> list[dict]:
    runs = {
        "bf16": anima_args(out / "bf16", *BF16_CACHED),
        "bf16_resumed": anima_args(out / "bf16_resumed", *BF16_CACHED, "--resume",
                                   str(out / "bf16" / "lora-step00000002-state")),
        "swap": anima_args(out / "swap", *SWAP, "--blocks_to_swap", "2"),
        "no_swap": anima_args(out / "no_swap", *SWAP),
        "fine_tune_swap": fine_tune(anima_args(out / "fine_tune_swap", *FINE_TUNE_SWAP, "--blocks_to_swap", "2")),
        "fine_tune_no_swap": fine_tune(anima_args(out / "fine_tune_no_swap", *FINE_TUNE_SWAP)),
    }
    return [{"name": name, "args": args, "family": "anima",
             "script": "anima_train.py" if name.startswith("fine_tune") else None} for name, args in runs.items()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("anima_ddp")
    plan_file, recorded = root / "plan.json", root / "recorded"
    plan_file.write_text(json.dumps(plan(root / "runs")))
    driver = str(Path(ddp_driver.__file__).resolve())
    done = launching.launch([torchrun(driver, str(plan_file), str(recorded))], launch_env(), RUNS,
                            "the launch of tests/e2e/ddp_driver.py for test_anima_distributed.py")
    complete = [n for n in RUNS if all((recorded / n / f"rank{r}.json").is_file() for r in range(2))]
    problem = done.problem(note=f"runs complete: {', '.join(complete) or 'none'}")
    failed = {} if problem is None else dict.fromkeys([n for n in RUNS if n not in complete], problem)
    return {"out": root / "runs", "recorded": recorded, "failed": failed}


def output(runs, name: str) -> Path:
    if name in runs["failed"]:
        pytest.fail(f"run {name!r} is incomplete: {runs['failed'][name]}", pytrace=False)
    return runs["out"] / name


def replicas(runs, name: str) -> tuple[list[int], list[dict[str, torch.Tensor]]]:
    output(runs, name)
    folder = runs["recorded"] / name
    return ([json.loads((folder / f"rank{r}.json").read_text())["exit"] for r in range(2)],
            [load_file(folder / f"rank{r}.safetensors") for r in range(2)])


def differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


@pytest.mark.parametrize("name", RUNS)
def test_both_processes_finish_with_bit_identical_bf16_weights(runs, name):
    codes, (first, second) = replicas(runs, name)
    assert codes == [0, 0]
    assert differing(first, second) == []
    assert {t.dtype for t in first.values() if t.is_floating_point() and t.dim() > 0} == {torch.bfloat16}


def test_only_the_main_process_writes(runs):
    folder = output(runs, "bf16")
    assert sorted(p.name for p in folder.iterdir()) == [
        "lora-state", "lora-step00000002-state", "lora-step00000002.safetensors", "lora-step00000004-state",
        "lora-step00000004.safetensors", "lora.safetensors"]
    saved = load_file(folder / "lora.safetensors")
    assert not any(k.startswith("lora_te") for k in saved)  # --network_train_unet_only
    assert differing(saved, replicas(runs, "bf16")[1][0]) == []


def test_resumed_on_two_processes_equals_uninterrupted(runs):
    whole = load_file(output(runs, "bf16") / "lora.safetensors")
    resumed = load_file(output(runs, "bf16_resumed") / "lora.safetensors")
    assert differing(whole, resumed) == []
    assert any(float(t.abs().max()) > 0 for k, t in whole.items() if k.endswith("lora_up.weight"))


def test_swapping_on_two_processes_trains_the_same_lora(runs):
    swapped, plain = (load_file(output(runs, name) / "lora.safetensors") for name in ("swap", "no_swap"))
    assert any(k.startswith("lora_te_") for k in plain) and any(k.startswith("lora_unet_blocks_3_") for k in plain)
    assert differing(plain, swapped) == []


def test_anima_train_swapping_on_two_processes_equals_no_swapping(runs):
    swapped, plain = (load_file(output(runs, name) / "lora.safetensors") for name in ("fine_tune_swap",
                                                                                      "fine_tune_no_swap"))
    assert any(key.startswith("net.blocks.3.") for key in swapped)  # the DiT's own weights
    assert differing(swapped, plain) == []

