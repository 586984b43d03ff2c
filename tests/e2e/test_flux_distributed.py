"""``flux_train_network.py`` on 2 processes (torchrun, gloo, CPU), as ``test_distributed_training.py`` runs SD/SDXL.

One launch of this file as a script (``drive``: ``tests/e2e/ddp_driver.run_one`` for each run of a plan, with the
FLUX noise injection below) runs the cases; each process records its exit code and its network's weights. Its
time limit scales with the runs it holds (``tests/launching.py``: ``SD_TEST_LAUNCH_BUDGET_S`` per start and per
run); a failed launch fails the tests of the runs it did not complete.

* ``equivalence``: the SD tests' case (two images, batch 1, SGD, fp32; see ``test_distributed_training.py``) on
  ``builtin:tiny-flux``. ``noise_by_image`` keys each image's noise and timestep draw by its file name and epoch;
  FLUX's objective draws both from its own generator (``library/families/flux/objective.py``), so
  ``flux_noise_by_image`` puts the per-image draws in its place. The 2-process run equals one process accumulating
  two batches of one bit for bit, and one process with a batch of two after the first update within fp32 rounding.
* ``bf16``: full bf16 + StochasticAdamW, accumulation 2, cached latents and text-encoder outputs,
  ``--network_train_unet_only``, 4 updates with the state saved after 2; ``bf16_resumed`` resumes from there on
  2 processes and ends as the uninterrupted run.
* ``fine_tune_fused``: ``flux_train.py`` (the transformer's own weights) with ``--fused_backward_pass`` and SGD in
  fp32, no clipping, two images of batch 1: each span averaged over the processes inside backward equals one
  process accumulating two bit for bit.
* ``swap`` / ``no_swap``: ``--blocks_to_swap 5`` on the tiny FLUX with 4 double and 8 single blocks (fp8 base,
  gradient checkpointing), which upstream allows with DDP; the transformer's LoRA comes out as without swapping.
* ``fine_tune_swap`` / ``fine_tune_no_swap``: the same for ``flux_train.py`` (full bf16 StochasticAdamW, fused
  backward pass), where the swapped blocks' own weights are averaged and stepped inside backward: as without
  swapping, bit for bit.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import library.families.flux.objective as flux_objective  # noqa: E402
import train_network  # noqa: E402
from library.families.flux.flow_timesteps import (  # noqa: E402
    TimestepDraws,
    draw_timestep_randoms,
    noisy_model_input_and_timesteps,
)
from tests import launching  # noqa: E402
from tests.e2e import ddp_driver  # noqa: E402
from tests.e2e.test_distributed_training import EQUIVALENCE, two_images  # noqa: E402
from tests.e2e.test_train_network import SAMPLES  # noqa: E402
from tests.launching import launch_env, torchrun  # noqa: E402

FULL_BF16_SR = ("--mixed_precision", "bf16", "--full_bf16", "--optimizer_type", "StochasticAdamW")
BF16_CACHED = (*FULL_BF16_SR, "--gradient_accumulation_steps", "2", "--cache_latents", "--cache_text_encoder_outputs",
               "--network_train_unet_only", "--max_train_steps", "4", "--save_every_n_steps", "2", "--save_state")
SWAP = ("--pretrained_model_name_or_path", "builtin:tiny-flux:double=4,single=8", *FULL_BF16_SR, "--fp8_base",
        "--network_train_unet_only", "--gradient_checkpointing", "--max_train_steps", "2")
FINE_TUNE_FUSED = ("--optimizer_type", "SGD", "--max_train_steps", "3", "--save_every_n_steps", "1",
                   "--max_grad_norm", "0", "--fused_backward_pass", "--train_batch_size", "1")
FINE_TUNE_SWAP = ("--pretrained_model_name_or_path", "builtin:tiny-flux:double=4,single=8", *FULL_BF16_SR,
                  "--fused_backward_pass", "--max_train_steps", "2")
LAUNCHES = {"all": ("equivalence", "bf16", "bf16_resumed", "swap", "no_swap", "fine_tune_fused", "fine_tune_swap",
                    "fine_tune_no_swap")}  # one start


def flux_fine_tune(args: list[str]) -> list[str]:
    """The same run for ``flux_train.py``: the transformer's own weights, without the LoRA's flags, at a learning
    rate that suits them."""
    lora = {"--network_module", "--network_dim", "--network_alpha", "--learning_rate"}
    kept = [arg for i, arg in enumerate(args) if arg not in lora and (i == 0 or args[i - 1] not in lora)]
    return [*kept, "--learning_rate", "1e-3"]


def flux_args(out: Path, *extra: str, data: Path = SAMPLES) -> list[str]:
    return ["--pretrained_model_name_or_path", "builtin:tiny-flux", "--train_data_dir", str(data),
            "--caption_extension", ".txt", "--resolution", "64", "--output_dir", str(out), "--output_name", "lora",
            "--network_module", "networks.lora_flux", "--network_dim", "4", "--network_alpha", "2",
            "--learning_rate", "1e-3", "--train_batch_size", "2", "--max_train_steps", "3", "--seed", "1",
            "--max_data_loader_n_workers", "0", *extra]


@contextlib.contextmanager
def flux_noise_by_image():
    """With ``ddp_driver``'s ``noise_by_image``: FLUX's noise and timestep draw of each image come from that image's
    generator (``ddp_driver._image_generators``: its file name and epoch), noise first; the process's generator still
    draws, unused."""
    current: dict[str, list[torch.Generator]] = {}
    original_generators = ddp_driver._image_generators
    original_sample = flux_objective.sample_noisy_model_input

    def recording(paths, call):
        current["generators"] = original_generators(paths, call)
        return current["generators"]

    def per_image(config, latents, noise, generator, dtype, schedule=None):
        assert not config.ip_noise_gamma, "flux_noise_by_image draws no input perturbation"
        draws = []
        for i, image_generator in enumerate(current["generators"]):
            noise[i:i + 1].copy_(torch.randn((1, *latents.shape[1:]), generator=image_generator,
                                             dtype=latents.dtype))
            draws.append(draw_timestep_randoms(config, latents[i:i + 1], image_generator, dtype).first)
        return noisy_model_input_and_timesteps(config, latents, noise, TimestepDraws(first=torch.cat(draws)), dtype,
                                               schedule)

    ddp_driver._image_generators, flux_objective.sample_noisy_model_input = recording, per_image
    try:
        yield
    finally:
        ddp_driver._image_generators, flux_objective.sample_noisy_model_input = original_generators, original_sample


def run_in_process(args: list[str], inject: dict, script: str | None = None) -> int:
    """One run in this process with the injections the 2-process runs have."""
    with flux_noise_by_image(), ddp_driver.patched(inject, ddp_driver.Recorder()):
        return train_network.main(args, family="flux", script=script)


def plan(root: Path, two: Path) -> dict[str, dict]:
    out = root / "runs"
    runs = {
        "equivalence": (flux_args(out / "equivalence", *EQUIVALENCE, "--train_batch_size", "1", data=two),
                        {"noise_by_image": True}),
        "bf16": (flux_args(out / "bf16", *BF16_CACHED, "--timestep_sampling", "sigmoid"), {}),
        "bf16_resumed": (flux_args(out / "bf16_resumed", *BF16_CACHED, "--timestep_sampling", "sigmoid", "--resume",
                                   str(out / "bf16" / "lora-step00000002-state")), {}),
        "swap": (flux_args(out / "swap", *SWAP, "--blocks_to_swap", "5"), {}),
        "no_swap": (flux_args(out / "no_swap", *SWAP), {}),
        "fine_tune_fused": (flux_fine_tune(flux_args(out / "fine_tune_fused", *FINE_TUNE_FUSED, data=two)),
                            {"noise_by_image": True}),
        "fine_tune_swap": (flux_fine_tune(flux_args(out / "fine_tune_swap", *FINE_TUNE_SWAP, "--blocks_to_swap", "5")),
                           {}),
        "fine_tune_no_swap": (flux_fine_tune(flux_args(out / "fine_tune_no_swap", *FINE_TUNE_SWAP)), {}),
    }
    scripts = dict.fromkeys(("fine_tune_fused", "fine_tune_swap", "fine_tune_no_swap"), "flux_train.py")
    return {name: {"name": name, "args": args, "inject": inject, "script": scripts.get(name)}
            for name, (args, inject) in runs.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("flux_ddp")
    two = two_images(root)
    items = plan(root, two)
    assert sorted(items) == sorted(name for names in LAUNCHES.values() for name in names), "LAUNCHES != plan"
    recorded_dir, failed = root / "recorded", {}
    for group, names in LAUNCHES.items():
        plan_file = root / f"plan-{group}.json"
        plan_file.write_text(json.dumps([items[name] for name in names]))
        done = launching.launch([torchrun(str(Path(__file__).resolve()), str(plan_file), str(recorded_dir))],
                                launch_env(), names, f"the launch {group!r} of tests/e2e/test_flux_distributed.py")
        complete = [n for n in names if all((recorded_dir / n / f"rank{r}.json").is_file() for r in range(2))]
        problem = done.problem(note=f"runs complete: {', '.join(complete) or 'none'}")
        if problem is not None:
            failed.update(dict.fromkeys([n for n in names if n not in complete], problem))
    return {"root": root, "two": two, "out": root / "runs", "recorded": recorded_dir, "failed": failed}


def output(runs, name: str) -> Path:
    if name in runs["failed"]:
        pytest.fail(f"run {name!r} is incomplete: {runs['failed'][name]}", pytrace=False)
    return runs["out"] / name


def exits(runs, name: str) -> list[int]:
    output(runs, name)
    return [json.loads((runs["recorded"] / name / f"rank{r}.json").read_text())["exit"] for r in range(2)]


def replicas(runs, name: str) -> list[dict[str, torch.Tensor]]:
    output(runs, name)
    return [load_file(runs["recorded"] / name / f"rank{r}.safetensors") for r in range(2)]


def differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


@pytest.mark.parametrize("name", ["equivalence", "bf16", "bf16_resumed", "swap", "no_swap", "fine_tune_swap",
                                  "fine_tune_no_swap"])
def test_both_processes_finish_with_bit_identical_weights(runs, name):
    assert exits(runs, name) == [0, 0]
    first, second = replicas(runs, name)
    assert differing(first, second) == []
    if name != "equivalence":
        assert {t.dtype for t in first.values()} == {torch.bfloat16}
        assert not any(k.startswith("lora_te") for k in first)  # --network_train_unet_only


def test_only_the_main_process_writes(runs):
    folder = output(runs, "bf16")
    assert sorted(p.name for p in folder.iterdir()) == [
        "lora-state", "lora-step00000002-state", "lora-step00000002.safetensors", "lora-step00000004-state",
        "lora-step00000004.safetensors", "lora.safetensors"]
    saved = load_file(folder / "lora.safetensors")
    assert differing(saved, replicas(runs, "bf16")[0]) == []


def test_resumed_on_two_processes_equals_uninterrupted(runs):
    whole = load_file(output(runs, "bf16") / "lora.safetensors")
    resumed = load_file(output(runs, "bf16_resumed") / "lora.safetensors")
    assert differing(whole, resumed) == []
    assert any(float(t.abs().max()) > 0 for k, t in whole.items() if k.endswith("lora_up.weight"))


def test_blocks_to_swap_on_two_processes_trains_the_same_lora(runs):
    swapped = load_file(output(runs, "swap") / "lora.safetensors")
    plain = load_file(output(runs, "no_swap") / "lora.safetensors")
    assert len(plain) == 3 * (4 * 10 + 8 * 3)
    assert differing(plain, swapped) == []


def test_flux_train_swapping_trained_blocks_on_two_processes_equals_no_swapping(runs):
    swapped, plain = (load_file(output(runs, name) / "lora.safetensors") for name in ("fine_tune_swap",
                                                                                      "fine_tune_no_swap"))
    assert any(key.startswith("single_blocks.7.") for key in swapped)  # the transformer's own weights
    assert differing(swapped, plain) == []


def test_two_processes_of_one_image_equal_one_process_of_two(runs, tmp_path):
    ours = output(runs, "equivalence")
    accumulating, batch_of_two = tmp_path / "accumulating", tmp_path / "batch_of_two"
    assert run_in_process(flux_args(accumulating, *EQUIVALENCE, "--train_batch_size", "1",
                                    "--gradient_accumulation_steps", "2", data=runs["two"]),
                          {"noise_by_image": True, "losses_per_epoch": 2}) == 0
    assert run_in_process(flux_args(batch_of_two, *EQUIVALENCE, "--train_batch_size", "2", "--max_train_steps", "1",
                                    data=runs["two"]), {"noise_by_image": True}) == 0
    for step in ("lora-step00000001", "lora-step00000002", "lora"):
        a, b = load_file(ours / f"{step}.safetensors"), load_file(accumulating / f"{step}.safetensors")
        assert differing(a, b) == [], step
    first, reference = load_file(ours / "lora-step00000001.safetensors"), load_file(batch_of_two / "lora.safetensors")
    moved = max(t.abs().max().item() for k, t in reference.items() if "lora_up" in k)
    assert moved > 1e-3  # lora_up starts at zero
    worst = max((first[k] - reference[k]).abs().max().item() for k in first)
    assert worst < 1e-6, f"largest difference {worst:.2e} (moved up to {moved:.2e})"


def test_flux_train_fused_on_two_processes_of_one_image_equals_one_process_accumulating_two(runs, tmp_path):
    """``flux_train.py --fused_backward_pass`` under torchrun: each span of the transformer's gradients averaged
    over the processes inside backward before it steps, as one process accumulating two micro-batches steps."""
    assert exits(runs, "fine_tune_fused") == [0, 0]
    first, second = replicas(runs, "fine_tune_fused")
    assert differing(first, second) == []
    ours, accumulating = output(runs, "fine_tune_fused"), tmp_path / "accumulating"
    args = flux_fine_tune(flux_args(accumulating, *FINE_TUNE_FUSED, "--gradient_accumulation_steps", "2",
                                    data=runs["two"]))
    assert run_in_process(args, {"noise_by_image": True, "losses_per_epoch": 2}, script="flux_train.py") == 0
    for step in ("lora-step00000001", "lora-step00000002", "lora"):
        a, b = load_file(ours / f"{step}.safetensors"), load_file(accumulating / f"{step}.safetensors")
        assert differing(a, b) == [], step
    start = load_file(ours / "lora-step00000001.safetensors")
    assert len(differing(start, load_file(ours / "lora.safetensors"))) > len(start) // 2  # later updates trained


def drive() -> None:
    """Under torchrun: every run of the plan file ``argv[1]``, recorded under ``argv[2]`` (``ddp_driver.run_one``)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s", stream=sys.__stderr__)
    dist.init_process_group("gloo")
    items, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    for item in items:
        started = time.monotonic()
        with flux_noise_by_image() if item["inject"].get("noise_by_image") else contextlib.nullcontext():
            ddp_driver.run_one(item["args"], item["inject"], out / item["name"], dist.get_rank(), "flux",
                               item["script"])
        print(f"test_flux_distributed: process {dist.get_rank()}: {item['name']} took "
              f"{time.monotonic() - started:.1f} s", file=sys.__stderr__, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    drive()
