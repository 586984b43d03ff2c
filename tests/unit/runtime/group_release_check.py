"""Run in each of 2 processes (torchrun, gloo) by ``test_processes.py``: a process group that ``processes.start``
made is gone, its threads with it, when the run's context ends, although the trainer's later imports (diffusers
imports ``torch._dynamo``, which imports ``torch.distributed.nn``) happen while it is open. Writes
``<out>/rank<r>.json``: the names of this process's threads that belong to gloo, before the end and after it."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from library.config.distributed import DistributedConfig
from library.runtime import processes


def gloo_threads() -> list[str]:
    """Gloo names its threads (``gloo_tcp_loop``, ``pt_gloo_runloop``); Linux lists a process's threads in /proc."""
    names = []
    for task in Path("/proc/self/task").iterdir():
        name = (task / "comm").read_text().strip()
        if "gloo" in name:
            names.append(name)
    return sorted(names)


torch.set_num_threads(1)
with processes.start(DistributedConfig()) as p:
    p.sync()
    import torch._dynamo  # noqa: F401  (what the trainer's first model import brings in)

    while_open = gloo_threads()
    rank = p.rank
after = gloo_threads()
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump({"while_open": while_open, "after": after}, f)
