"""What defines a run's trajectory, stored in every state so that a ``--resume`` that would silently train something
else is refused with each difference named.

Compared: the seed (data order, noise and dropout streams), each dataset's images (file names per subset, sizes,
repeats, buckets) and batch size, the gradient accumulation, the optimizer with its options, the network module,
the number of processes (states saved before it was stored count as 1), and (from the saved tensors) the network's
modules and their shapes (``network_differences``). Not compared, so they may change as sd-scripts allows:
``--max_train_steps`` / ``--max_train_epochs`` (a longer run), learning rates, saving and logging options.
Captions are not compared either: a corrected caption does not change the order of the data.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

EXAMPLES = 3


def dataset_fingerprint(datasets) -> list[dict[str, Any]]:
    """Per dataset: batch size, image counts and a digest of (subset, file name, size, repeats, bucket) in order."""
    out = []
    for ds in datasets:
        digest = hashlib.sha256()
        for item in ds.items:
            bucket = item.choice.bucket if item.choice is not None else None
            digest.update(f"{item.subset_index}\0{Path(item.path).name}\0{item.size}\0{item.repeats}\0{bucket}\n"
                          .encode())
        out.append({"batch_size": ds.spec.batch_size, "images": len(ds.items),
                    "images_with_repeats": sum(item.repeats for item in ds.items), "digest": digest.hexdigest()})
    return out


def optimizer_label(name: str, options: Mapping[str, Any]) -> str:
    return f"{name}({', '.join(f'{k}={options[k]!r}' for k in sorted(options))})"


def trajectory(*, seed: int, datasets, gradient_accumulation_steps: int, optimizer: str,
               network_module: str, num_processes: int = 1) -> dict[str, Any]:
    return {"seed": seed, "datasets": dataset_fingerprint(datasets),
            "gradient_accumulation_steps": gradient_accumulation_steps, "optimizer": optimizer,
            "network_module": network_module, "num_processes": num_processes}


def _describe(ds: Mapping[str, Any]) -> str:
    return f"{ds['images']} images ({ds['images_with_repeats']} with repeats), batch size {ds['batch_size']}"


def differences(saved: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """One line per difference between two ``trajectory`` records."""
    out = []
    for key, flag in (("seed", "--seed"), ("gradient_accumulation_steps", "--gradient_accumulation_steps"),
                      ("optimizer", "--optimizer_type / --optimizer_args"), ("network_module", "--network_module")):
        if saved.get(key) != now.get(key):
            out.append(f"{flag}: {saved.get(key)} when saved, {now.get(key)} now")
    processes = saved.get("num_processes", 1), now.get("num_processes", 1)  # states before it: 1 process
    if processes[0] != processes[1]:
        out.append(f"processes (accelerate launch --num_processes / torchrun --nproc_per_node x --nnodes): "
                   f"{processes[0]} when saved, {processes[1]} now; each process's data share and random state are "
                   "in the state")
    before, after = list(saved.get("datasets", [])), list(now.get("datasets", []))
    if len(before) != len(after):
        out.append(f"datasets: {len(before)} when saved, {len(after)} now")
    for index, (old, new) in enumerate(zip(before, after, strict=False)):
        if old == new:
            continue
        if _describe(old) != _describe(new):
            out.append(f"dataset {index}: {_describe(old)} when saved, {_describe(new)} now")
        else:
            out.append(f"dataset {index}: the same counts, but other images, sizes, repeats or buckets")
    return out


def network_differences(saved: Mapping[str, torch.Tensor], now: Mapping[str, torch.Tensor]) -> list[str]:
    """The modules missing, added or reshaped (rank, conv kernel) between the saved network and this one."""

    def modules(state: Mapping[str, torch.Tensor]) -> dict[str, dict[str, tuple[int, ...]]]:
        out: dict[str, dict[str, tuple[int, ...]]] = {}
        for key, tensor in state.items():
            module, _, leaf = key.partition(".")
            out.setdefault(module, {})[leaf] = tuple(tensor.shape)
        return out

    old, new = modules(saved), modules(now)
    lines = []
    for names, what in ((sorted(set(old) - set(new)), "saved modules are not in this network"),
                        (sorted(set(new) - set(old)), "modules of this network are not in the state")):
        if names:
            lines.append(f"network: {len(names)} {what} (e.g. {', '.join(names[:EXAMPLES])})")
    reshaped = [name for name in sorted(set(old) & set(new)) if old[name] != new[name]]
    if reshaped:
        name = reshaped[0]
        lines.append(f"network: {len(reshaped)} modules have other shapes (e.g. {name}: {old[name]} when saved, "
                     f"{new[name]} now; --network_dim / --network_args changed?)")
    return lines
