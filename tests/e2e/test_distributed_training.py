"""The real trainer on 2 processes (torchrun, gloo, CPU) and on 2 "machines" of 2 processes each (localhost).

One launch of ``tests/e2e/ddp_driver.py`` (``LAUNCHES``) runs the 2-process cases in turn (see its docstring for the
injections); each process records its exit code, what it printed and its network's weights. The launch has a time
limit that scales with the runs it holds (``tests/launching.py``: ``SD_TEST_LAUNCH_BUDGET_S`` per start and per run),
so a hang fails the tests instead of blocking the suite while a busy machine only slows them; a failed launch fails
the tests of the runs it did not complete, not the others.

The equivalence case: 2 images, 1 repeat, no augmentation. In one process with batch 2 an epoch is one batch holding
both images; in one process with batch 1 and 2 accumulation steps it is two batches of one image, summed into one
update; in 2 processes with batch 1 it is 2 batches, one per process. So every update of each run averages the
gradients of the same two images (their order does not change the mean), and with their noise and timestep keyed by
image and epoch (``noise_by_image``) and latents taken as the VAE distribution's mean, all runs see the same inputs.
The 2-process run equals the accumulating one bit for bit (a/2 + b/2 and (a + b)/2 are the same fp32 number), and
the batch-2 one within fp32 rounding after the first update. Later updates are not compared with batch 2: on the
tiny random model the gradients of a batch of 2 and of two batches of 1 differ by about 3e-4 (relative norm, fp32,
measured on its UNet and text encoder alone) and the next updates amplify it.
"""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import train_network
from tests import launching
from tests.e2e import ddp_driver
from tests.e2e.test_train_network import SAMPLES, train_args
from tests.launching import ROOT, launch_env, torchrun

FULL_BF16 = ("--mixed_precision", "bf16", "--full_bf16")
RANDOM_FEATURES = ("--gradient_accumulation_steps", "2", "--network_dropout", "0.2", "--network_args",
                   "rank_dropout=0.2", "--flip_aug", "--noise_offset", "0.05", "--max_train_steps", "4",
                   "--save_every_n_steps", "2", "--save_state")
BF16_SR = (*FULL_BF16, "--optimizer_type", "StochasticAdamW", "--gradient_accumulation_steps", "2",
           "--max_train_steps", "4", "--save_every_n_steps", "2", "--save_state")
# plain SGD: AdamW's first steps turn the rounding noise of near-zero gradient elements into full-size updates
EQUIVALENCE = ("--optimizer_type", "torch.optim.SGD", "--learning_rate", "1.0", "--max_train_steps", "3",
               "--save_every_n_steps", "1")
# the fused backward pass clips each tensor (unfused: the whole norm), so compared without clipping; the registry's
# SGD steps a span at a time
FUSED = ("--optimizer_type", "SGD", "--fused_backward_pass")
FUSED_EQUIVALENCE = ("--optimizer_type", "SGD", "--learning_rate", "1.0", "--max_train_steps", "3",
                     "--save_every_n_steps", "1", "--max_grad_norm", "0", "--fused_backward_pass")


def two_images(root: Path) -> Path:
    folder = root / "two" / "1_two"
    folder.mkdir(parents=True)
    for source in sorted((SAMPLES / "10_shapes").iterdir())[:4]:  # 2 images and their captions
        shutil.copy(source, folder / source.name)
    return root / "two"


def fine_tune(args: list[str]) -> list[str]:
    """The same run for ``fine_tune.py``: the U-Net and the text encoder, without the LoRA's flags, at a learning rate
    that suits the model's own weights, saved as one ``.safetensors`` file."""
    lora = {"--network_module", "--network_dim", "--network_alpha", "--learning_rate"}
    kept = [arg for i, arg in enumerate(args) if arg not in lora and (i == 0 or args[i - 1] not in lora)]
    return [*kept, "--train_text_encoder", "--learning_rate", "1e-3", "--save_model_as", "safetensors"]


def sdxl(args: list[str]) -> list[str]:
    """The same run for ``sdxl_train_network.py`` on the tiny SDXL."""
    return ["builtin:tiny-sdxl" if arg == "builtin:tiny-sd15" else arg for arg in args]


SDXL_CACHED = (*FULL_BF16, "--optimizer_type", "StochasticAdamW", "--network_train_unet_only",
               "--cache_latents_to_disk", "--cache_text_encoder_outputs_to_disk", "--max_train_steps", "2")


def plan(root: Path, two: Path) -> list[dict]:
    out = root / "runs"
    cached = root / "cached"
    shutil.copytree(SAMPLES, cached)  # the disk cache is written beside the images
    sdxl_cached = root / "sdxl_cached"
    shutil.copytree(SAMPLES, sdxl_cached)
    prompts = root / "prompts.txt"
    prompts.write_text("a red square --w 64 --h 64 --d 1 --s 2\n", encoding="utf-8")
    runs = [
        ("equivalence", train_args(out / "equivalence", *EQUIVALENCE, "--train_batch_size", "1", data=two),
         {"noise_by_image": True}),
        ("fp32", train_args(out / "fp32", *RANDOM_FEATURES), {}),
        # calls 0-3 are the micro-batches of updates 1 and 2 (state saved after 2); call 5 is inside update 3
        ("fp32_interrupted", train_args(out / "fp32_interrupted", *RANDOM_FEATURES),
         {"rank": 1, "calls": [5], "what": "sigterm"}),
        ("fp32_resumed", train_args(out / "fp32_resumed", *RANDOM_FEATURES, "--resume",
                                    str(out / "fp32_interrupted" / "lora-step00000002-state")), {}),
        ("bf16", train_args(out / "bf16", *BF16_SR), {}),
        ("bf16_resumed", train_args(out / "bf16_resumed", *BF16_SR, "--resume",
                                    str(out / "bf16" / "lora-step00000002-state")), {}),
        ("nan_skip", train_args(out / "nan_skip"), {"rank": 1, "calls": [1], "what": "nan"}),
        ("nan_stop", train_args(out / "nan_stop", "--max_nan_steps", "2", "--max_train_steps", "5"),
         {"rank": 1, "calls": [1, 2, 3, 4], "what": "nan"}),
        ("user_error", train_args(out / "user_error"), {"rank": 1, "calls": [1], "what": "user_error"}),
        ("bad_input", train_args(out / "bad_input", data=root / "missing"), {}),
        ("fused_equivalence", train_args(out / "fused_equivalence", *FUSED_EQUIVALENCE, "--train_batch_size", "1",
                                         data=two), {"noise_by_image": True}),
        ("fused_nan_skip", train_args(out / "fused_nan_skip", *FUSED), {"rank": 1, "calls": [1], "what": "nan"}),
        ("fused_user_error", train_args(out / "fused_user_error", *FUSED),
         {"rank": 1, "calls": [1], "what": "user_error"}),
        ("fused_bf16", train_args(out / "fused_bf16", *FULL_BF16, "--optimizer_type", "Adafactor",
                                  "--fused_backward_pass", "--gradient_accumulation_steps", "2", "--network_dropout",
                                  "0.2", "--max_train_steps", "2"), {}),
        ("disk_cache", train_args(out / "disk_cache", "--cache_latents_to_disk", "--max_train_steps", "2",
                                  data=cached), {}),
        ("syncs", train_args(out / "syncs", *FULL_BF16, "--optimizer_type", "StochasticAdamW", "--max_grad_norm",
                             "1", "--gradient_accumulation_steps", "2", "--max_train_steps", "3"),
         {"count_syncs": True}),
        ("sample_validate", train_args(out / "sample_validate", "--max_train_steps", "2", "--sample_prompts",
                                       str(prompts), "--sample_every_n_steps", "1", "--validation_split", "0.25",
                                       "--validate_every_n_steps", "1", "--logging_dir", str(root / "logs")), {}),
    ]
    sdxl_runs = [
        ("sdxl_equivalence", sdxl(train_args(out / "sdxl_equivalence", *EQUIVALENCE, "--train_batch_size", "1",
                                             data=two)), {"noise_by_image": True}),
        ("sdxl_cached", sdxl(train_args(out / "sdxl_cached", *SDXL_CACHED, data=sdxl_cached)), {}),
    ]
    fine_tune_run = {"name": "fine_tune_equivalence", "script": "fine_tune.py", "inject": {"noise_by_image": True},
                     "args": fine_tune(train_args(out / "fine_tune_equivalence", *EQUIVALENCE, "--train_batch_size",
                                                  "1", data=two))}
    return ([{"name": name, "args": args, "inject": inject} for name, args, inject in runs]
            + [{"name": name, "args": args, "inject": inject, "family": "sdxl"} for name, args, inject in sdxl_runs]
            + [fine_tune_run])


# The runs of each launch of ddp_driver.py, in order (a resumed run after the one it resumes, in the same launch). One
# launch holds them all: a start (torchrun and 2 processes importing torch, diffusers and the trainer) costs about
# 10 s on 2 cores under load, a run of the tiny model 1-3 s, and the launch's limit grows with the runs it holds.
LAUNCHES = {
    "all": ("equivalence", "sdxl_equivalence", "fine_tune_equivalence", "nan_skip", "nan_stop", "user_error",
            "bad_input", "fused_equivalence", "fused_nan_skip", "fused_user_error", "fused_bf16", "fp32",
            "fp32_interrupted", "fp32_resumed", "bf16", "bf16_resumed", "disk_cache", "syncs", "sample_validate",
            "sdxl_cached"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ddp")
    two = two_images(root)
    items = {item["name"]: item for item in plan(root, two)}
    assert sorted(items) == sorted(name for names in LAUNCHES.values() for name in names), "LAUNCHES != plan"
    recorded_dir, logs, failed = root / "recorded", [], {}
    for group, names in LAUNCHES.items():
        plan_file = root / f"plan-{group}.json"
        plan_file.write_text(json.dumps([items[name] for name in names]))
        driver = str(ROOT / "tests" / "e2e" / "ddp_driver.py")
        done = launching.launch([torchrun(driver, str(plan_file), str(recorded_dir))],
                                launch_env(), names, f"the launch {group!r} of tests/e2e/ddp_driver.py")
        logs.append(done.output)
        complete = [n for n in names if all((recorded_dir / n / f"rank{r}.json").is_file() for r in range(2))]
        rest = [name for name in names if name not in complete]
        problem = done.problem(note=f"runs complete: {', '.join(complete) or 'none'}; running when it ended: "
                                    f"{', '.join(rest[:1]) or 'none'}; not started: {', '.join(rest[1:]) or 'none'}")
        if problem is not None:
            failed.update(dict.fromkeys(rest, problem))
    return {"root": root, "two": two, "out": root / "runs", "recorded": recorded_dir, "log": "".join(logs),
            "failed": failed}


def output(runs, name: str) -> Path:
    """The run's output folder; if its launch ended before the run was complete, the test fails with why."""
    if name in runs["failed"]:
        pytest.fail(f"run {name!r} is incomplete: {runs['failed'][name]}", pytrace=False)
    return runs["out"] / name


def recorded(runs, name: str) -> list[dict]:
    """Per process: exit code, applied updates, and the lines ``train_network.main`` printed for the user (errors,
    interruptions; not the log)."""
    output(runs, name)
    records = [json.loads((runs["recorded"] / name / f"rank{r}.json").read_text()) for r in range(2)]
    for record in records:
        record["stderr"] = [line for line in record["stderr"] if line.startswith(("error", "interrupted"))]
    return records


def replicas(runs, name: str) -> list[dict[str, torch.Tensor]]:
    output(runs, name)
    return [load_file(runs["recorded"] / name / f"rank{r}.safetensors") for r in range(2)]


def test_two_processes_of_one_image_equal_one_process_of_two(runs, tmp_path):
    ours = output(runs, "equivalence")
    accumulating, batch_of_two = tmp_path / "accumulating", tmp_path / "batch_of_two"
    with ddp_driver.patched({"noise_by_image": True, "losses_per_epoch": 2}, ddp_driver.Recorder()):
        assert train_network.main(train_args(accumulating, *EQUIVALENCE, "--train_batch_size", "1",
                                             "--gradient_accumulation_steps", "2", data=runs["two"])) == 0
    with ddp_driver.patched({"noise_by_image": True}, ddp_driver.Recorder()):
        assert train_network.main(train_args(batch_of_two, *EQUIVALENCE, "--train_batch_size", "2",
                                             "--max_train_steps", "1", data=runs["two"])) == 0
    for step in ("lora-step00000001", "lora-step00000002", "lora"):
        a, b = load_file(ours / f"{step}.safetensors"), load_file(accumulating / f"{step}.safetensors")
        assert a.keys() == b.keys() and not [k for k in a if not torch.equal(a[k], b[k])], step
    first, reference = load_file(ours / "lora-step00000001.safetensors"), load_file(batch_of_two / "lora.safetensors")
    assert first.keys() == reference.keys()
    moved = max(t.abs().max().item() for k, t in reference.items() if "lora_up" in k)
    assert moved > 1e-3  # lora_up starts at zero
    worst = max((first[k] - reference[k]).abs().max().item() for k in first)
    # A batch of two and two batches of one take other fp32 kernels (the CPU's convolution algorithm depends on the
    # batch size and on the instruction set): equal up to their rounding, about 1e-4 of how far the LoRA moved on an
    # AVX2-only CPU; a wrong reduction (a sum for a mean, a missing process) is off by the whole move.
    assert worst < 1e-3 * moved, f"largest difference {worst:.2e} (moved up to {moved:.2e})"


@pytest.mark.parametrize("name", ["fp32", "bf16", "bf16_resumed", "nan_skip", "equivalence", "sdxl_equivalence",
                                  "sdxl_cached", "fine_tune_equivalence", "fused_equivalence", "fused_bf16",
                                  "fused_nan_skip"])
def test_every_process_ends_with_bit_identical_weights(runs, name):
    first, second = replicas(runs, name)
    assert first.keys() == second.keys()
    assert not [k for k in first if not torch.equal(first[k], second[k])]
    if name.startswith("bf16"):
        assert {t.dtype for k, t in first.items() if "lora" in k} == {torch.bfloat16}


@pytest.mark.parametrize("whole,resumed", [("fp32", "fp32_resumed"), ("bf16", "bf16_resumed")])
def test_resumed_on_two_processes_equals_uninterrupted(runs, whole, resumed):
    a = load_file(output(runs, whole) / "lora.safetensors")
    b = load_file(output(runs, resumed) / "lora.safetensors")
    assert not [k for k in a if not torch.equal(a[k], b[k])]


def test_sigterm_on_one_process_stops_both_with_the_checkpoint_intact(runs):
    main, other = recorded(runs, "fp32_interrupted")
    assert (main["exit"], other["exit"]) == (130, 130)
    folder = runs["out"] / "fp32_interrupted"
    saved = folder / "lora-step00000002.safetensors"
    assert main["stderr"] == [f"interrupted (process 1): the last saved checkpoint, {saved}, is intact"]
    assert other["stderr"] == []
    assert sorted(p.name for p in folder.iterdir()) == ["lora-step00000002-state", "lora-step00000002.safetensors"]


@pytest.mark.parametrize("name", ["nan_skip", "fused_nan_skip"])
def test_a_nan_on_one_process_skips_the_update_on_both(runs, name):
    """Fused: the NaN loss of process 1 reaches process 0 in each span's averaging, which masks every step."""
    for record in recorded(runs, name):
        assert record["exit"] == 0
        assert record["applied"] == [True, False, True]


def test_max_nan_steps_stops_both_with_exit_3(runs):
    main, other = recorded(runs, "nan_stop")
    assert (main["exit"], other["exit"]) == (3, 3)
    assert main["applied"] == other["applied"] == [True, False]  # the third update raised
    assert len(main["stderr"]) == 1 and main["stderr"][0].startswith("error: 2 updates in a row")
    assert other["stderr"] == []
    assert (runs["out"] / "nan_stop" / "lora.safetensors").is_file()  # the last good weights


@pytest.mark.parametrize("name", ["user_error", "fused_user_error"])
def test_a_user_error_on_one_process_exits_2_everywhere_printed_once(runs, name):
    """Fused: process 0 meets process 1's failure at the sync point of a span's averaging, inside backward."""
    main, other = recorded(runs, name)
    assert (main["exit"], other["exit"]) == (2, 2)
    assert len(main["stderr"]) == 1 and main["stderr"][0].startswith("error: process 1: ")
    assert main["stderr"][0].endswith("cannot be decoded (injected)")
    assert other["stderr"] == []
    assert not (runs["out"] / name / "lora.safetensors").exists()


def test_only_the_main_process_writes_and_metadata_counts_its_share(runs):
    folder = output(runs, "fp32")
    assert sorted(p.name for p in folder.iterdir()) == [
        "lora-state", "lora-step00000002-state", "lora-step00000002.safetensors", "lora-step00000004-state",
        "lora-step00000004.safetensors", "lora.safetensors"]
    with safe_open(folder / "lora.safetensors", "pt") as f:
        meta = f.metadata()
    # 80 images with repeats / batch 2 = 40 batches, 20 per process; 4 steps of ceil(20 / 2) = 10 per epoch
    assert (meta["ss_num_batches_per_epoch"], meta["ss_num_epochs"], meta["ss_steps"]) == ("20", "1", "4")
    assert meta["ss_total_batch_size"] == "8"  # batch 2 x accumulation 2 x processes 2
    state = json.loads((folder / "lora-state" / "train_state.json").read_text())
    assert state["trajectory"]["num_processes"] == 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_machines_of_two_processes_train_and_write_once(tmp_path):
    out = tmp_path / "out"
    port = str(free_port())
    command = [*train_args(out, "--max_train_steps", "2", "--train_batch_size", "1")]
    done = launching.launch([torchrun(str(ROOT / "train_network.py"), *command, extra=(
        "--nnodes", "2", "--node_rank", str(rank), "--master_addr", "127.0.0.1", "--master_port", port))
        for rank in (0, 1)], launch_env(), ["two machines, 2 steps"], "the 2 machines' torchruns")
    if done.timed_out:
        pytest.fail(done.problem(tail=3000), pytrace=False)
    nodes, outputs = done.processes, done.outputs
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    assert sum(o.count("saved ") for o in outputs) == 1
    assert "4 processes on 2 machine(s)" in outputs[0]
    assert sorted(p.name for p in out.iterdir()) == ["lora.safetensors"]
    with safe_open(out / "lora.safetensors", "pt") as f:
        meta = f.metadata()
    # 80 batches of 1 over 4 processes: 20 each (sd-scripts' len(train_dataloader)); batch 1 x 4 processes
    assert (meta["ss_num_batches_per_epoch"], meta["ss_total_batch_size"], meta["ss_steps"]) == ("20", "4", "2")


def test_input_errors_of_every_process_are_printed_once(runs):
    for name, needle in (("bad_input", "missing"),):
        main, other = recorded(runs, name)
        assert (main["exit"], other["exit"]) == (2, 2), name
        assert main["stderr"] and all(line.startswith("error: ") for line in main["stderr"]), name
        assert any(needle in line for line in main["stderr"]), name
        assert other["stderr"] == [], name
        assert not (runs["out"] / name).exists() or not any((runs["out"] / name).iterdir()), name


def test_the_disk_latent_cache_is_shared_out_between_the_processes(runs):
    main, other = recorded(runs, "disk_cache")
    assert (main["exit"], other["exit"]) == (0, 0)
    images = sorted((runs["root"] / "cached" / "10_shapes").glob("*.png"))
    assert len(list((runs["root"] / "cached" / "10_shapes").glob("*_sd.npz"))) == len(images) == 8
    # sd-scripts' rule: image i is encoded by process i mod 2; the main process logs its share
    assert "caching latents: 4 to encode, 0 reused from disk (this process's share)" in runs["log"]
    first, second = replicas(runs, "disk_cache")
    assert not [k for k in first if not torch.equal(first[k], second[k])]


def equals_one_process_accumulating_two(runs, name: str, tmp_path, adapt, **script) -> dict[str, torch.Tensor]:
    """The 2-process run ``name`` equals one process accumulating two, bit for bit at every step (``adapt``: the
    arguments of its script; ``script``: ``train_network.main``'s family / script); its last file."""
    ours, accumulating = output(runs, name), tmp_path / "accumulating"
    with ddp_driver.patched({"noise_by_image": True, "losses_per_epoch": 2}, ddp_driver.Recorder()):
        assert train_network.main(adapt(train_args(accumulating, *EQUIVALENCE, "--train_batch_size", "1",
                                                   "--gradient_accumulation_steps", "2", data=runs["two"])),
                                  **script) == 0
    for step in ("lora-step00000001", "lora-step00000002", "lora"):
        a = load_file(ours / f"{step}.safetensors")
        b = load_file(accumulating / f"{step}.safetensors")
        assert a.keys() == b.keys() and not [k for k in a if not torch.equal(a[k], b[k])], step
    return a


def test_sdxl_two_processes_of_one_image_equal_one_process_accumulating_two(runs, tmp_path):
    """sdxl_train_network.py under torchrun behaves as train_network.py (the equivalence case above)."""
    last = equals_one_process_accumulating_two(runs, "sdxl_equivalence", tmp_path, sdxl, family="sdxl")
    assert any(k.startswith("lora_unet_input_blocks_") for k in last)


def test_fine_tune_on_two_processes_of_one_image_equals_one_process_accumulating_two(runs, tmp_path):
    """``fine_tune.py`` under torchrun: the whole U-Net's and text encoder's gradients averaged over the processes
    (the equivalence case above, for the model's own weights)."""
    last = equals_one_process_accumulating_two(runs, "fine_tune_equivalence", tmp_path, fine_tune,
                                               script="fine_tune.py")
    first = load_file(output(runs, "fine_tune_equivalence") / "lora-step00000001.safetensors")
    assert sum(not torch.equal(first[k], last[k]) for k in first) > len(first) // 2  # updates 2 and 3 trained


def test_fused_backward_on_two_processes_of_one_image_equals_one_process_accumulating_two(runs, tmp_path):
    """``--fused_backward_pass`` under torchrun: each span averaged over the processes inside backward before it
    steps equals the unfused single process summing the two images (fp32, no clipping), bit for bit."""
    def unfused(args: list[str]) -> list[str]:
        return [*args, "--optimizer_type", "SGD", "--max_grad_norm", "0"]

    last = equals_one_process_accumulating_two(runs, "fused_equivalence", tmp_path, unfused)
    first = load_file(output(runs, "fused_equivalence") / "lora-step00000001.safetensors")
    assert sum(not torch.equal(first[k], last[k]) for k in first) > len(first) // 2  # updates 2 and 3 trained


def test_sdxl_disk_caches_are_shared_out_and_written_once(runs):
    main, other = recorded(runs, "sdxl_cached")
    assert (main["exit"], other["exit"]) == (0, 0)
    folder = runs["root"] / "sdxl_cached" / "10_shapes"
    images = sorted(folder.glob("*.png"))
    assert len(list(folder.glob("*_te_outputs.npz"))) == len(list(folder.glob("*_sdxl.npz"))) == len(images) == 8
    # sd-scripts' rule for both caches: image i is encoded by process i mod 2
    assert "caching text encoder outputs: 4 to encode, 0 reused from disk (this process's share)" in runs["log"]
    assert sorted(p.name for p in (runs["out"] / "sdxl_cached").iterdir()) == ["lora.safetensors"]


def test_sample_images_and_logs_are_written_once_and_validation_agrees(runs):
    main, other = recorded(runs, "sample_validate")
    assert (main["exit"], other["exit"]) == (0, 0)
    samples = sorted(p.name for p in (runs["out"] / "sample_validate" / "sample").iterdir())
    assert len(samples) == 2 and all(name.endswith(".png") for name in samples)  # 1 prompt x 2 steps, not x 2
    assert len(list((runs["root"] / "logs").iterdir())) == 1  # one TensorBoard run folder
    losses = [line for line in runs["log"].splitlines() if "validation loss at step" in line]
    assert len(losses) == 2  # logged by the main process only
    first, second = replicas(runs, "sample_validate")
    assert not [k for k in first if not torch.equal(first[k], second[k])]


def test_one_plain_process_makes_no_process_group(tmp_path, monkeypatch):
    """``python train_network.py`` without torchrun's environment trains as it did before several processes existed:
    nothing of ``torch.distributed`` is called, not even to form a group of one."""
    import torch.distributed as dist

    def refuse(name):
        def call(*args, **kwargs):
            raise AssertionError(f"torch.distributed.{name} called in a single process")
        return call

    for name in ("init_process_group", "new_group", "all_reduce", "all_gather", "broadcast", "barrier"):
        monkeypatch.setattr(dist, name, refuse(name))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert train_network.main(train_args(tmp_path, "--max_train_steps", "2", "--gradient_accumulation_steps", "2",
                                         "--save_every_n_steps", "1", "--save_state", "--cache_latents")) == 0
    assert not dist.is_initialized()
    assert (tmp_path / "lora-step00000001-state").is_dir() and (tmp_path / "lora.safetensors").is_file()


def test_no_host_sync_per_micro_batch_and_one_per_update_on_two_processes(runs):
    """As ``test_loop_syncs.py`` in one process: the reduction reads nothing from the device (its status exchange
    and presence counts are host integers); the summed finite flag is read with the update's one read."""
    for record in recorded(runs, "syncs"):
        assert record["exit"] == 0
        assert len(record["window_syncs"]) == 3 and len(record["micro_syncs"]) == 6
        assert all(found == [] for found in record["micro_syncs"]), record["micro_syncs"]
        assert all(len(found) <= 1 for found in record["window_syncs"]), record["window_syncs"]
