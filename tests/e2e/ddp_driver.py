"""Runs the real ``train_network.main`` several times in each of the processes torchrun started, for
``test_distributed_training.py``; also imported there for the single-process reference of the same patches.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/e2e/ddp_driver.py PLAN.json OUT

``PLAN.json`` lists runs ``{"name", "args", "inject"}`` (``"family": "sdxl"``: ``sdxl_train_network.py``;
``"script"``: a full fine-tuning script of the family, e.g. ``fine_tune.py``). For each run every process writes
``OUT/<name>/rank<r>.json`` (exit code, the lines it printed on stderr, which updates were applied) and
``rank<r>.safetensors`` (its network's weights at the end, or a full fine-tuning's trained parts, its
``TrainedModel``; the JSON is written last, so a run that has both is complete) and logs how long the run took. One
process group (made here, adopted by ``library/runtime/processes.py``) serves all runs of the plan;
``test_distributed_training.py`` splits its runs into a few plans, one launch each, each with its own time limit
(``tests/launching.py``).

Injections (``inject``): ``{"rank": r, "calls": [i, ...], "what": "nan" | "user_error" | "sigterm"}`` makes the
``i``-th loss computation (0-based, counted per process and run) of process ``r`` return NaN, raise a UserError, or
send the process SIGTERM; ``"count_syncs": true`` records the host syncs of each micro-batch and update window
(``tests/e2e/test_loop_syncs.py``); ``"noise_by_image": true`` draws each image's noise and timestep from a generator
keyed
by its file name and the loss computation's index (the epoch, when each process computes one loss per epoch), and
encodes latents as the VAE distribution's mean, so that a batch of two images in one process and one image in each
of two processes see the same inputs.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import library.objectives.ddpm  # noqa: E402
import library.runtime.run  # noqa: E402
import train_network  # noqa: E402
from library.base.errors import UserError  # noqa: E402
from library.train import full_model, network_setup  # noqa: E402


class Recorder:
    """What one run left behind in this process: its network and the updates' outcomes."""

    def __init__(self) -> None:
        self.network = None
        self.applied: list[bool] = []


def _image_generators(paths: list[str], call: int) -> list[torch.Generator]:
    """One generator per image of the batch, keyed by its file name and the process's loss computation count."""
    generators = []
    for path in paths:
        digest = hashlib.sha256(f"{Path(path).name}:{call}".encode()).digest()
        generators.append(torch.Generator().manual_seed(int.from_bytes(digest[:7], "little")))
    return generators


@contextlib.contextmanager
def patched(inject: dict, recorder: Recorder):
    """The run's patches (see the module docstring), undone afterwards."""
    originals = {"BatchLoss": library.runtime.run.BatchLoss, "make_updater": library.runtime.run.make_updater,
                 "build_network": network_setup.build_network, "load_and_unfreeze": full_model.load_and_unfreeze,
                 "sample_noise": library.objectives.ddpm.sample_noise,
                 "sample_timesteps": library.objectives.ddpm.sample_timesteps}
    rank = int(os.environ.get("RANK", "0"))
    calls = {"n": 0}
    current: dict[str, list[torch.Generator]] = {}

    class InjectingLoss(originals["BatchLoss"]):
        def latents(self, batch):
            if not inject.get("noise_by_image") or "latents" in batch:
                return super().latents(batch)
            with torch.no_grad():
                images = batch["images"].to(self.device, self.policy.vae_dtype)
                return self.model.vae.encode(images).latent_dist.mean.float() * self.model.vae.config.scaling_factor

        def __call__(self, batch):
            index, calls["n"] = calls["n"], calls["n"] + 1
            if inject.get("rank") == rank and index in inject.get("calls", []):
                if inject["what"] == "sigterm":
                    os.kill(os.getpid(), signal.SIGTERM)
                elif inject["what"] == "user_error":
                    raise UserError(f"{batch['image_paths'][0]}: cannot be decoded (injected)")
            if inject.get("noise_by_image"):
                current["generators"] = _image_generators(batch["image_paths"],
                                                          index // inject.get("losses_per_epoch", 1))
            loss = super().__call__(batch)
            if inject.get("rank") == rank and index in inject.get("calls", []) and inject["what"] == "nan":
                return loss * float("nan")
            return loss

    def recording_updater(*args, **kwargs):
        updater = originals["make_updater"](*args, **kwargs)
        update = updater.update

        def recorded_update():
            result = update()
            recorder.applied.append(result.applied)
            return result

        updater.update = recorded_update
        return updater

    def build_network(*args, **kwargs):
        recorder.network, train_te = originals["build_network"](*args, **kwargs)
        return recorder.network, train_te

    def load_and_unfreeze(*args, **kwargs):
        model, recorder.network, train_te = originals["load_and_unfreeze"](*args, **kwargs)
        return model, recorder.network, train_te

    def noise(latents, cfg, generator, *args):
        return torch.cat([torch.randn((1, *latents.shape[1:]), generator=g) for g in current["generators"]])

    def timesteps(batch_size, cfg, generator, device, *args):
        return torch.cat([torch.randint(0, 1000, (1,), generator=g) for g in current["generators"]]).to(device)

    library.runtime.run.BatchLoss, library.runtime.run.make_updater = InjectingLoss, recording_updater
    network_setup.build_network, full_model.load_and_unfreeze = build_network, load_and_unfreeze
    if inject.get("noise_by_image"):
        library.objectives.ddpm.sample_noise, library.objectives.ddpm.sample_timesteps = noise, timesteps
    try:
        yield
    finally:
        library.runtime.run.BatchLoss = originals["BatchLoss"]
        library.runtime.run.make_updater = originals["make_updater"]
        network_setup.build_network = originals["build_network"]
        full_model.load_and_unfreeze = originals["load_and_unfreeze"]
        library.objectives.ddpm.sample_noise = originals["sample_noise"]
        library.objectives.ddpm.sample_timesteps = originals["sample_timesteps"]


def run_one(args: list[str], inject: dict, out: Path, rank: int, family: str = "sd", script: str | None = None
            ) -> None:
    """One ``train_network.main`` run; writes what this process saw."""
    import pytest
    from safetensors.torch import save_file

    from tests.e2e.test_loop_syncs import counting

    recorder = Recorder()
    stderr = io.StringIO()
    record: dict = {}
    with contextlib.ExitStack() as stack:
        if inject.get("count_syncs"):
            micro, windows = stack.enter_context(counting(stack.enter_context(pytest.MonkeyPatch.context())))
            record = {"micro_syncs": micro, "window_syncs": windows}
        stack.enter_context(patched(inject, recorder))
        stack.enter_context(contextlib.redirect_stderr(stderr))
        code = train_network.main(args, family=family, script=script)
    out.mkdir(parents=True, exist_ok=True)
    if recorder.network is not None:
        weights = {k: v.detach().cpu().contiguous() for k, v in recorder.network.state_dict().items()}
        save_file(weights, str(out / f"rank{rank}.safetensors"))
    # written last: a run whose processes both wrote it is complete, even if its launch failed later
    (out / f"rank{rank}.json").write_text(json.dumps({"exit": code, "stderr": stderr.getvalue().splitlines(),
                                                      "applied": recorder.applied, **record}))


def main() -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s", stream=sys.__stderr__)
    dist.init_process_group("gloo")
    plan, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    for number, item in enumerate(plan, 1):
        started = time.monotonic()
        run_one(item["args"], item.get("inject", {}), out / item["name"], dist.get_rank(), item.get("family", "sd"),
                item.get("script"))
        print(f"ddp_driver: process {dist.get_rank()}: run {number} of {len(plan)} ({item['name']}) took "
              f"{time.monotonic() - started:.1f} s", file=sys.__stderr__, flush=True)  # not the trainer's logging
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
