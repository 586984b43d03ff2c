"""``library/runtime/processes.py``: the data shard against accelerate's own sampler, and its collectives,
decisions and failure handling in 2 processes (torchrun, gloo; ``process_checks.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from accelerate.data_loader import BatchSamplerShard
from torch.utils.data import BatchSampler

from library.base.errors import UserError
from library.runtime import processes
from tests import launching
from tests.launching import ROOT, launch_env, torchrun


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_each_process_gets_the_batches_accelerate_deals_it(world):
    for batches in range(1, 10):
        shares = []
        for rank in range(world):
            reference = BatchSamplerShard(BatchSampler(range(batches), batch_size=1, drop_last=False),
                                          num_processes=world, process_index=rank, split_batches=False,
                                          even_batches=True)
            expected = [index for batch in reference for index in batch]
            ours = [processes.shard_position(local, batches, rank, world)
                    for local in range(processes.shard_length(batches, world))]
            assert ours == expected, (batches, world, rank)
            shares.append(ours)
        assert {len(share) for share in shares} == {-(-batches // world)}
        assert set().union(*shares) == set(range(batches))


def test_process_info_from_the_environment():
    assert processes.ProcessInfo.from_env({}) == processes.ProcessInfo()
    info = processes.ProcessInfo.from_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                                             "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1"})
    assert (info.rank, info.world_size, info.local_rank, info.node_rank, info.is_main, info.distributed) == \
        (3, 4, 1, 1, False, True)
    for env in ({"RANK": "2", "WORLD_SIZE": "2"}, {"WORLD_SIZE": "two"}):
        with pytest.raises(UserError, match="torchrun"):
            processes.ProcessInfo.from_env(env)


def test_a_single_process_starts_nothing():
    from library.config.distributed import DistributedConfig

    group = processes.start(DistributedConfig(), env={})
    assert not group.distributed and group.is_main
    assert group.decide_seed(5) == 5
    assert group.process_seed(5) == 5
    sampler = object()
    assert group.shard(sampler) is sampler
    reducer = group.gradient_reducer([], seed=0)
    flag = torch.tensor(False)
    assert reducer.reduce(flag) is flag
    assert processes.describe_options(DistributedConfig(ddp_timeout=3), group.info) == [
        "--ddp_timeout: no effect in a single process (no process group)"]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("distributed")
    # all the checks together count as one run of the limit (tests/launching.py): they take less than one training run
    done = launching.launch([torchrun(str(ROOT / "tests" / "unit" / "runtime" / "process_checks.py"), str(out))],
                            launch_env(), ["every check of process_checks.py"],
                            "the launch of tests/unit/runtime/process_checks.py")
    problem = done.problem(tail=3000)
    assert problem is None, problem
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


def test_seed_is_the_main_process_draw_and_each_process_adds_its_rank(ranks):
    first, second = (r["seed"] for r in ranks)
    assert first["drawn"] == second["drawn"]
    assert first["given"] == second["given"] == 1234
    assert (first["process_seed"], second["process_seed"]) == (7, 8)


def test_fp32_mean_zero_fills_missing_gradients_and_shares_the_loss_flag(ranks):
    for r in ranks:
        got = r["fp32_mean"]
        assert got["both"] == [1.5, 3.0, 4.5]  # (g + 2g) / 2
        assert got["only_rank0"] == [2.0, -1.0]  # rank 0's gradient with rank 1's zeros, halved
        assert got["nowhere"] is None
        assert got["finite"] is False  # rank 1's loss was not finite: no process updates
        assert got["finite_none"] is True  # no micro-batch on any process: finite
        assert got["reductions"] == 2


def test_bf16_mean_is_rounded_stochastically_and_identically_on_every_process(ranks):
    for r in ranks:
        assert r["bf16_exact"] == {"unique": [1.0 + 2**-7], "dtype": "torch.bfloat16"}
        got = r["bf16_stochastic"]
        assert got["dtype"] == "torch.bfloat16"
        assert got["unique"] == [1.0, 1.0 + 2**-7]
        # the exact mean 1 + 3 * 2^-9; round-to-nearest would give 1 + 2^-7 = 1.0078 everywhere; the standard
        # error of the mean of 2^14 draws is 2^-7 * sqrt(3/16) / 128 = 2.7e-5
        assert abs(got["mean"] - (1 + 3 * 2**-9)) < 2e-4
    assert ranks[0]["bf16_stochastic"]["digest"] == ranks[1]["bf16_stochastic"]["digest"]


def test_broadcast_sends_the_main_process_weights(ranks):
    for r in ranks:
        assert r["broadcast"] == [[1.0] * 4, [[10.0, 10.0], [10.0, 10.0]]]


def test_a_user_error_on_one_process_stops_both_printed_once_by_the_main_process(ranks):
    main, other = (r["user_error_on_rank1"] for r in ranks)
    assert main == {"stopped": 2, "lines": ["error: process 1: data.toml: images/broken.png cannot be read",
                                            "error: process 1: fix or remove it"]}
    assert other == {"stopped": 2, "lines": []}


def test_a_crash_keeps_its_traceback_where_it_happened(ranks):
    main, other = (r["crash_on_rank1"] for r in ranks)
    assert main["stopped"] == 1 and "process 1: RuntimeError: out of memory" in main["lines"][0]
    assert other == {"raised": "RuntimeError", "message": "out of memory"}


def test_a_global_stop_is_printed_once(ranks):
    main, other = (r["diverged_everywhere"] for r in ranks)
    assert main == {"stopped": 3, "lines": ["error: 3 updates in a row had a non-finite loss"]}
    assert other == {"stopped": 3, "lines": []}


def test_sigterm_on_one_process_stops_both_with_130(ranks):
    for check, where in (("signal_before_sync", " (process 1)"), ("signal_outside_sync", "")):
        main, other = (r[check] for r in ranks)
        assert main == {"stopped": 130, "lines": [f"interrupted{where}: nothing was saved by this run"]}
        assert other == {"stopped": 130, "lines": []}


def test_processes_with_unequal_cache_shares_leave_caching_together(ranks):
    main, other = (r["caching_unequal_shares"] for r in ranks)
    assert main == {"value": "done", "encoded": [0]} and other == {"value": "done", "encoded": [0, 1, 2, 3]}


def test_an_interruption_while_caching_stops_the_other_process_at_its_next_batch(ranks):
    main, other = (r["caching_interrupted"] for r in ranks)
    assert main == {"stopped": 130, "lines": ["interrupted: nothing was saved by this run"], "encoded": [0]}
    assert other == {"stopped": 130, "lines": [], "encoded": [0]}  # not its 6 batches


def test_sharded_sampler_deals_positions_and_resumes_at_the_process_batch(ranks):
    main, other = (r["sharded_sampler"] for r in ranks)
    assert main["length"] == other["length"] == 3  # ceil(5 / 2)
    assert main["keys"] == [[3, 0], [3, 2], [3, 4]]
    assert other["keys"] == [[3, 1], [3, 3], [3, 0]]  # the last round is filled with the epoch's first batch
    assert (main["resumed"], other["resumed"]) == ([4], [0])


def test_saves_run_on_the_main_process_with_every_process_random_state(ranks):
    main, other = (r["saves"] for r in ranks)
    assert main["written"] == [["step", 2], ["final", 3]] and other["written"] == []
    assert main["rank_rngs"] == [[[1, 1, 1, 1]], [[3, [1, 2], None]]]  # rank 1's state (tuples come back as lists)
    assert main["after_drift"] == other["after_drift"] == [1.5, 7.0, 1.5]  # re-synced from the main process


def test_ddp_flags_say_what_they_do_here(ranks):
    lines = ranks[0]["options"]
    assert len(lines) == 1 and lines[0].startswith("--ddp_static_graph: no effect here")


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="lists the threads of a process as Linux does")
def test_the_group_a_run_started_is_gone_with_its_threads_when_the_run_ends(tmp_path):
    """A group that outlived its run kept gloo's threads running into the interpreter's exit, where they could abort
    a process that trained and saved (SIGABRT, "terminate called without an active exception")."""
    done = launching.launch([torchrun(str(ROOT / "tests" / "unit" / "runtime" / "group_release_check.py"),
                                      str(tmp_path))], launch_env(), ["group_release_check.py"],
                            "the launch of tests/unit/runtime/group_release_check.py")
    problem = done.problem(tail=3000)
    assert problem is None, problem
    for rank in range(2):
        threads = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert threads["while_open"], "no gloo thread seen while the group was open: nothing was checked"
        assert threads["after"] == [], rank


def test_an_interrupted_single_process_says_what_the_run_saved(tmp_path):
    from library.base.errors import Stopped
    from library.config.distributed import DistributedConfig

    earlier, saved = tmp_path / "lora.safetensors", tmp_path / "lora-step00000010.safetensors"
    cases = ((None, None, "interrupted: nothing was saved by this run"),
             (None, earlier, f"interrupted: nothing was saved by this run; {earlier} from before this run is left "
                             "as it was"),
             (saved, earlier, f"interrupted: the last saved checkpoint, {saved}, is intact"))
    for checkpoint, before, line in cases:
        group = processes.start(DistributedConfig(), env={})
        group.checkpoint, group.earlier = (lambda c=checkpoint: c), (lambda b=before: b)
        try:
            with group:
                raise KeyboardInterrupt
        except Stopped as stopped:
            got = (stopped.exit_code, stopped.lines)
        except KeyboardInterrupt:  # caught here, not by pytest, which would end the session
            got = "KeyboardInterrupt, with the trainer's generic line"
        assert got == (130, [line])
