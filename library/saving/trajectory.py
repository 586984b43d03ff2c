"""What defines a run's trajectory, stored in every state so that a ``--resume`` that would silently train something
else is refused with each difference named.

Compared: the seed (data order, noise and dropout streams), each dataset's images (file names per subset, sizes,
repeats, buckets) and batch size, the gradient accumulation, the optimizer with its options, the network module,
the number of processes (states saved before it was stored count as 1), and (from the saved tensors) the network's
modules and their shapes (``network_differences``). Not compared, so they may change as sd-scripts allows:
``--max_train_steps`` / ``--max_train_epochs`` (a longer run), learning rates, saving and logging options.
Captions are not compared either: a corrected caption does not change the order of the data.

The network settings that decide what the saved LoRA means are compared with the state's stored config
(``setting_differences``): ``--network_dim``, ``--network_alpha`` (unset is 1, as the network receives it), the trained
parts (``--network_train_unet_only`` / ``--network_train_text_encoder_only``) and every ``--network_args`` key but
``TRAINING_ONLY_ARGS``. A resume puts the modules' ``alpha`` tensors back from the state while the module scale comes
from the flags, so another alpha would train at one scale and write a file that records another; sd-scripts does not
check this. ``--network_dim`` is compared when both runs give it (unset is the module's own default, and the saved
tensors' shapes decide). ``--network_dropout`` and ``--scale_weight_norms`` act on training only and may change.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

EXAMPLES = 3
# --network_args read by the training only, which a resume may change as it may the learning rates: the dropouts
# (networks.lora, networks.lora_flux, LyCORIS), the LoRA+ ratios, the block and pattern LR weights (a weight of 0
# removes modules: the saved modules are then refused by ``network_differences``), FLUX's LoRA-GGPO (its norms are
# computed again after a resume) and its log verbosity. Every other key shapes or scales the modules.
TRAINING_ONLY_ARGS = frozenset({
    "dropout", "rank_dropout", "module_dropout", "loraplus_lr_ratio", "loraplus_unet_lr_ratio",
    "loraplus_text_encoder_lr_ratio", "down_lr_weight", "mid_lr_weight", "up_lr_weight", "block_lr_zero_threshold",
    "network_reg_lrs", "ggpo_beta", "ggpo_sigma", "verbose"})
NETWORK_HINT = ("a resume trains the saved modules as they are (their alpha comes back from the state); to go on from "
                "the LoRA file saved with the state under other network settings, start a new run without --resume "
                "with --network_weights (it loads the file's alpha tensors with its weights, as sd-scripts does: "
                "give the alphas it was saved with, or --dim_from_weights)")


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


def _same(old: Any, new: Any) -> bool:
    """Equal, or the same number written otherwise (``2`` and ``2.0``)."""
    if old == new:
        return True
    try:
        return float(old) == float(new)
    except (TypeError, ValueError):
        return False


def _args(items: Any) -> dict[str, str]:
    """``--network_args`` "key=value" items as the network reads them (split on the first "="), shaping keys only."""
    pairs = (item.split("=", 1) for item in (items if isinstance(items, list) else [])
             if isinstance(item, str) and "=" in item)
    return {key.strip(): value.strip() for key, value in pairs if key.strip() not in TRAINING_ONLY_ARGS}


def _parts(network: Mapping[str, Any], denoiser: str) -> str:
    if network.get("network_train_unet_only"):
        return f"the {denoiser} only"
    if network.get("network_train_text_encoder_only"):
        return "the text encoders only"
    return f"the {denoiser} and the text encoders"


def _alpha_line(saved: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    old, new = (1.0 if s.get("network_alpha") is None else s.get("network_alpha") for s in (saved, now))
    if _same(old, new):
        return []
    how = "leave out --network_alpha" if saved.get("network_alpha") is None else f"pass --network_alpha {old}"
    return [f"--network_alpha: {old} when saved, {new} now (the saved modules keep alpha {old}: the steps after "
            f"the resume would train at another scale than the LoRA file records); {how}"]


def setting_differences(saved: Mapping[str, Any], now: Mapping[str, Any], denoiser: str) -> list[str]:
    """One line per network setting (the config's ``network`` section) that changes what the saved LoRA means,
    each with the value to pass; see the module docstring for what is compared. ``denoiser``: how the family names
    its denoiser (``FamilySpec.denoiser_name``)."""
    out = []
    old_dim, new_dim = saved.get("network_dim"), now.get("network_dim")
    if old_dim is not None and new_dim is not None and not _same(old_dim, new_dim):
        out.append(f"--network_dim: {old_dim} when saved, {new_dim} now; pass --network_dim {old_dim}")
    out += _alpha_line(saved, now)
    if _parts(saved, denoiser) != _parts(now, denoiser):
        flag = next((f"pass --{key}" for key in ("network_train_unet_only", "network_train_text_encoder_only")
                     if saved.get(key)), "leave out both")
        out.append(f"--network_train_unet_only / --network_train_text_encoder_only: {_parts(saved, denoiser)} when "
                   f"saved, {_parts(now, denoiser)} now; {flag}")
    old_args, new_args = _args(saved.get("network_args")), _args(now.get("network_args"))
    for key in sorted(old_args.keys() | new_args.keys()):
        old, new = old_args.get(key), new_args.get(key)
        if old is None or new is None or not _same(old, new):
            how = f"leave out {key}" if old is None else f"pass {key}={old}"
            shown = ["not given" if value is None else value for value in (old, new)]
            out.append(f"--network_args {key}: {shown[0]} when saved, {shown[1]} now; {how}")
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
