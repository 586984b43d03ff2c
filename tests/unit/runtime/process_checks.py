"""Checks of ``library/runtime/processes.py`` run in each of 2 processes (torchrun, gloo) by ``test_processes.py``.

Each process writes ``<out>/rank<r>.json``: for every check its observations (values, exceptions, exit codes); the
test compares them across processes and with hand-computed values. One process group serves all checks (made here,
adopted by ``processes.start``), so one launch runs them all.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from library.base.errors import Stopped, TrainingDiverged, UserError
from library.config.distributed import DistributedConfig
from library.data.cache_progress import CacheProgress
from library.runtime import processes, save_gate
from library.train.position import Position, SaveHooks

torch.set_num_threads(1)
dist.init_process_group("gloo")
RANK = dist.get_rank()
results: dict[str, object] = {}


def start_processes() -> processes.Processes:
    return processes.start(DistributedConfig())


def outcome(body) -> dict[str, object]:
    """Run ``body`` inside a Processes context; what came out of it."""
    try:
        with start_processes() as p:
            value = body(p)
    except Stopped as exc:
        return {"stopped": exc.exit_code, "lines": exc.lines}
    except Exception as exc:  # noqa: BLE001 (the check records whatever came out)
        return {"raised": type(exc).__name__, "message": str(exc)}
    return {"value": value}


def check(name):
    def register(body):
        results[name] = body()
        return body
    return register


@check("seed")
def _():
    p = start_processes()
    return {"drawn": p.decide_seed(None), "given": p.decide_seed(1234), "process_seed": p.process_seed(7)}


@check("fp32_mean")
def _():
    p = start_processes()
    both = torch.nn.Parameter(torch.zeros(3))
    only_rank0 = torch.nn.Parameter(torch.zeros(2))
    nowhere = torch.nn.Parameter(torch.zeros(2))
    both.grad = torch.tensor([1.0, 2.0, 3.0]) * (RANK + 1)  # rank 0: 1,2,3; rank 1: 2,4,6 -> mean 1.5,3,4.5
    if RANK == 0:
        only_rank0.grad = torch.tensor([4.0, -2.0])  # mean with rank 1's zeros: 2, -1
    reducer = p.gradient_reducer([both, only_rank0, nowhere], seed=5)
    finite = reducer.reduce(torch.tensor(RANK == 0))  # rank 1's loss was not finite
    finite_none = reducer.reduce(None)  # no micro-batch: finite
    return {"both": both.grad.tolist(), "only_rank0": only_rank0.grad.tolist(), "nowhere": nowhere.grad,
            "finite": bool(finite), "finite_none": bool(finite_none), "reductions": reducer.state_dict()["reductions"]}


@check("bf16_exact")
def _():
    p = start_processes()
    param = torch.nn.Parameter(torch.zeros(64, dtype=torch.bfloat16))
    # both exact in bf16 (spacing 2^-7 above 1); so is their mean 1 + 2^-7: rounding must keep it
    param.grad = torch.full((64,), 1.0 if RANK == 0 else 1.0 + 2**-6, dtype=torch.bfloat16)
    p.gradient_reducer([param], seed=11).reduce(torch.tensor(True))
    return {"unique": param.grad.float().unique().tolist(), "dtype": str(param.grad.dtype)}


@check("bf16_stochastic")
def _():
    p = start_processes()
    n = 1 << 14
    param = torch.nn.Parameter(torch.zeros(n, dtype=torch.bfloat16))
    # rank 0 sends 1 - 2^-8, rank 1 sends 1 + 2^-6 (both exact in bf16); their fp32 mean 1 + 3 * 2^-9 lies 3/4 of the
    # way from 1 to the next bf16 value 1 + 2^-7: round-to-nearest gives 1 + 2^-7 everywhere, stochastic rounding
    # 1 + 2^-7 with probability 3/4 and 1 otherwise
    param.grad = torch.full((n,), 1.0 - 2**-8 if RANK == 0 else 1.0 + 2**-6, dtype=torch.bfloat16)
    reducer = p.gradient_reducer([param], seed=11)
    reducer.reduce(torch.tensor(True))
    values = param.grad.float()
    return {"mean": values.mean().item(), "unique": sorted(values.unique().tolist()),
            "digest": save_gate.fingerprint([param.grad]), "dtype": str(param.grad.dtype)}


@check("broadcast")
def _():
    p = start_processes()
    weights = [torch.full((4,), float(RANK + 1)), torch.full((2, 2), 10.0 * (RANK + 1), dtype=torch.bfloat16)]
    p.broadcast_from_main(weights)
    return [w.float().tolist() for w in weights]


@check("user_error_on_rank1")
def _():
    def body(p):
        if RANK == 1:
            raise UserError("data.toml: images/broken.png cannot be read", "fix or remove it")
        p.sync()
        return "not stopped"
    return outcome(body)


@check("crash_on_rank1")
def _():
    def body(p):
        if RANK == 1:
            raise RuntimeError("out of memory")
        p.sync()
        return "not stopped"
    return outcome(body)


@check("diverged_everywhere")
def _():
    def body(p):
        raise TrainingDiverged("3 updates in a row had a non-finite loss")
    return outcome(body)


@check("signal_before_sync")
def _():
    def body(p):
        if RANK == 1:
            with p._signals.deferred():  # as if the signal came during the previous collective
                os.kill(os.getpid(), signal.SIGTERM)
                p.sync()
        else:
            p.sync()
        return "not stopped"
    return outcome(body)


@check("signal_outside_sync")
def _():
    def body(p):
        if RANK == 0:
            os.kill(os.getpid(), signal.SIGTERM)  # raises KeyboardInterrupt here
        p.sync()
        return "not stopped"
    return outcome(body)


def caching(p: processes.Processes, batches: int, encoded: list, interrupt: bool = False) -> str:
    """A process's share of a cache as ``library/data/encode_caches.py`` runs it: ``batches`` batches through
    ``CacheProgress.watch`` (a sync point before each), then the barrier after the share; ``interrupt``: SIGTERM to
    itself while its first batch is encoded."""
    def encode(batch):
        encoded.append(batch[0])
        if interrupt:
            os.kill(os.getpid(), signal.SIGTERM)  # raises KeyboardInterrupt here
        return batch

    watched = CacheProgress(step=p.caching_step).watch(encode)
    for index in range(batches):
        watched([index])
    p.caching_done()
    p.sync()
    return "done"


@check("caching_unequal_shares")
def _():
    encoded: list[int] = []
    return {**outcome(lambda p: caching(p, 1 if RANK == 0 else 4, encoded)), "encoded": encoded}


@check("caching_interrupted")
def _():
    encoded: list[int] = []
    return {**outcome(lambda p: caching(p, 1 if RANK == 0 else 6, encoded, interrupt=RANK == 0)), "encoded": encoded}


@dataclass
class Progress:
    epoch: int = 3
    step: int = 0
    max_train_steps: int = 10
    first_batch: int = 0


@check("sharded_sampler")
def _():
    from library.data.batches import EpochSampler

    p = start_processes()
    progress = Progress()
    sampler = p.shard(EpochSampler(progress, 5))
    first = [(k.epoch, k.position) for k in sampler]
    progress.first_batch = 2
    resumed = [k.position for k in sampler]
    return {"length": len(sampler), "keys": first, "resumed": resumed}


@check("saves")
def _():
    p = start_processes()
    weights = [torch.full((3,), 1.5), torch.full((2,), 0.25, dtype=torch.bfloat16)]
    written = []
    hooks = SaveHooks(2, None, lambda pos: written.append(("step", pos.step)),
                      lambda pos: written.append(("epoch", pos.epoch)),
                      lambda pos: written.append(("final", pos.step)))
    gated = p.gate_saves(hooks, weights, lambda: {"torch": torch.full((4,), RANK, dtype=torch.uint8),
                                                  "python": (3, (RANK, 2), None)})
    gated.step_save(Position(0, 2, 4))
    same = [r["torch"].tolist() for r in p.rank_rngs], [r["python"] for r in p.rank_rngs]
    weights[0][1] = 7.0 + RANK  # the replicas drift apart: the main process's weights are sent to all
    gated.final_save(Position(1, 3, 0))
    return {"written": written, "rank_rngs": same, "after_drift": weights[0].tolist()}


@check("options")
def _():
    info = processes.ProcessInfo(rank=RANK, world_size=2)
    return processes.describe_options(DistributedConfig(ddp_timeout=5, ddp_gradient_as_bucket_view=True,
                                                          ddp_static_graph=True), info)


with open(os.path.join(sys.argv[1], f"rank{RANK}.json"), "w") as f:
    json.dump(results, f, default=str)
dist.destroy_process_group()
