"""Multi-process overhead on the CPU: the per-update gradient reduction, and a whole step, 1 vs 2 processes (gloo).

1. ``GradientReducer.reduce`` in 2 processes (torchrun, gloo, one thread each) on 384 tensors of 6.78 M elements
   ([16, 1104] and [1104, 16]: the size of an SD1.5 rank-16 LoRA), fp32 and bf16 (the stochastic round-back), with
   its parts: the status exchange alone and the bare all-reduce of the flat buffer. Median of ``--runs`` updates.
2. The trainer on ``builtin:tiny-sd15`` (64 px, batch 1 per process, ``--steps`` updates): seconds per step of one
   process and of 2 processes (the trainer's own figure; with 2 processes each process has one of the 2 cores), as the
   median of ``--repeats`` runs. Each of the 2 processes does the work of the single one, so the difference is what the
   processes cost: the reduction, the sync points and the sharing of the cores' caches and memory bandwidth.

    OMP_NUM_THREADS=1 .venv/bin/python bench/distributed.py --runs 20 --steps 20 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import ROOT, machine, reproduce_command

sys.path.insert(0, str(ROOT))

MODULES, RANK, WIDTH = 192, 16, 1104


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": str(ROOT)}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def _torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *args]


def reduction_worker(runs: int, out: Path) -> None:
    """Inside torchrun: time the parts of one update's reduction."""
    import torch.distributed as dist

    from library.config.distributed import DistributedConfig
    from library.runtime import processes as process_group

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    processes = process_group.start(DistributedConfig())
    generator = torch.Generator().manual_seed(dist.get_rank())
    rows = {}
    for dtype in (torch.float32, torch.bfloat16):
        params = []
        for _ in range(MODULES):
            params += [torch.nn.Parameter(torch.zeros(RANK, WIDTH, dtype=dtype)),
                       torch.nn.Parameter(torch.zeros(WIDTH, RANK, dtype=dtype))]
        reducer = processes.gradient_reducer(params, seed=1)
        flat = torch.zeros(sum(p.numel() for p in params) + 1)
        timings = {"reduce": [], "status exchange": [], "all-reduce of the buffer": []}
        for _ in range(runs + 2):  # the first two warm up
            for p in params:
                p.grad = torch.randn(p.shape, generator=generator).to(dtype)
            dist.barrier()
            start = time.perf_counter()
            reducer.reduce(torch.tensor(True))
            timings["reduce"].append(time.perf_counter() - start)
            dist.barrier()
            start = time.perf_counter()
            processes.sync()
            timings["status exchange"].append(time.perf_counter() - start)
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(flat)
            timings["all-reduce of the buffer"].append(time.perf_counter() - start)
        rows[str(dtype).removeprefix("torch.")] = {k: statistics.median(v[2:]) * 1000 for k, v in timings.items()}
    if dist.get_rank() == 0:
        out.write_text(json.dumps({"elements": sum(p.numel() for p in params), "tensors": len(params),
                                   "rows": rows}))
    dist.destroy_process_group()


def step_seconds(command: list[str], folder: Path) -> float:
    done = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=900, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(done.stdout[-2000:] + done.stderr[-2000:])
    match = re.search(r"\(([0-9.]+) s/step\)", done.stdout)
    if match is None:
        raise SystemExit(f"no s/step in the output:\n{done.stdout[-2000:]}")
    return float(match.group(1))


def trainer_args(out: Path, steps: int) -> list[str]:
    return [str(ROOT / "train_network.py"), "--pretrained_model_name_or_path", "builtin:tiny-sd15",
            "--train_data_dir", str(ROOT / "configs" / "sample_data"), "--caption_extension", ".txt",
            "--resolution", "64", "--output_dir", str(out), "--output_name", "lora", "--network_module",
            "networks.lora", "--network_dim", "4", "--train_batch_size", "1", "--max_train_steps", str(steps),
            "--seed", "1", "--max_data_loader_n_workers", "0"]


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        reduction_worker(int(sys.argv[2]), Path(sys.argv[3]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="updates timed per reduction row (median)")
    parser.add_argument("--steps", type=int, default=20, help="updates per trainer run")
    parser.add_argument("--repeats", type=int, default=3, help="trainer runs per process count (median)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "reduction.json"
        subprocess.run(_torchrun(str(Path(__file__).resolve()), "--worker", str(args.runs), str(result)),
                       env=_env(), check=True, timeout=900, capture_output=True)
        reduction = json.loads(result.read_text())
        single, double = [], []
        for repeat in range(args.repeats):
            single.append(step_seconds([sys.executable, *trainer_args(Path(tmp) / f"one{repeat}", args.steps)],
                                       Path(tmp)))
            double.append(step_seconds(_torchrun(*trainer_args(Path(tmp) / f"two{repeat}", args.steps)), Path(tmp)))

    print(f"{machine()}; gloo, 1 thread per process")
    print(f"\n### Gradient reduction per update, 2 processes ({reduction['tensors']} tensors, "
          f"{reduction['elements'] / 1e6:.2f} M elements; median of {args.runs})\n")
    print("| dtype | reduce (all of it) ms | status exchange ms | all-reduce of the buffer ms |")
    print("|---|---|---|---|")
    for dtype, row in reduction["rows"].items():
        print(f"| {dtype} | {row['reduce']:.1f} | {row['status exchange']:.2f} | "
              f"{row['all-reduce of the buffer']:.1f} |")
    s1, s2 = statistics.median(single), statistics.median(double)
    print(f"\n### Trainer, builtin:tiny-sd15 at 64 px, batch 1 per process, {args.steps} updates "
          f"(median of {args.repeats} runs)\n")
    print("| processes | s/step | overhead per step |")
    print("|---|---|---|")
    print(f"| 1 | {s1:.3f} | |")
    print(f"| 2 | {s2:.3f} | {(s2 - s1) * 1000:+.0f} ms ({(s2 / s1 - 1) * 100:+.0f} %) |")
    print(f"\nruns: 1 process {', '.join(f'{v:.3f}' for v in single)}; 2 processes "
          f"{', '.join(f'{v:.3f}' for v in double)}")
    print(f"\n{reproduce_command('distributed.py')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
