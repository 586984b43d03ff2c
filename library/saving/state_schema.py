"""What a ``--save_state`` folder may hold: the one check of a state's types, bounds and inner consistency, applied
when it is read (``read_state``: before anything loads) and, for the optimizer tensors' shapes, which need the
run's parameters, when it is restored (``TrainingState.restore``: before the first step).

A state written by this trainer passes; a damaged or hand-edited one is refused (exit 2) with one line per problem
naming the file and the key, instead of a ``TypeError`` / ``KeyError`` / ``OverflowError`` while it is used, or a
``RuntimeError`` at the first step once the model has loaded. What is checked, beyond the JSON bounds of
``library/base/bounded.py``:

* ``train_state.json``: the position (epoch, step, batch), seeds and the trajectory record (``trajectory.py``) have
  their types; counts are whole numbers below 2**53, seeds below 2**64.
* ``state.safetensors``: the network is a dict of tensors; the optimizer's ``param_groups`` list
  their parameters once each and its ``state`` only those; learning rates (``lr``, ``initial_lr``, the scheduler's
  ``base_lrs`` / ``_last_lr``) are numbers in [0, float32 max] (the CLI's bound, ``library/config/ranges.py``);
  second moments (Adam's ``exp_avg_sq``, RMSprop's ``square_avg``, Adagrad's ``sum``, ...: means of squares) are not
  negative; a per-parameter ``step`` and the scheduler's ``last_epoch`` (ticked once per process per applied update,
  ``library/train/update/``) do not exceed the updates of the saved position (plus ``steps_beyond_position``, the
  steps a ``--resume`` with a lower ``--initial_step`` carried in); the random states have their forms.
* At restore: the tensors that optimizers keep one per element of their parameter (``exp_avg``, ``momentum_buffer``,
  ``ema``, ...) have the parameter's shape; any other state tensor with the parameter's element count has its shape
  or is flat (Prodigy's ``s``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

TRAIN_STATE = "train_state.json"
TENSORS = "state.safetensors"
MAX_COUNT = 2**53  # steps, epochs, batches: exact as floats and in int64
SEED_END = 2**64
FLOAT32_MAX = 3.4028234663852886e38
PARAM_SHAPED = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "sum", "square_avg",
                          "grad_avg", "acc_delta", "exp_inf", "ax", "prev", "ema", "ema_squared", "prev_grad"})
SECOND_MOMENTS = frozenset({"exp_avg_sq", "max_exp_avg_sq", "exp_avg_sq_row", "exp_avg_sq_col", "square_avg", "sum",
                            "acc_delta", "exp_inf", "ema_squared"})
LR_KEYS = ("lr", "initial_lr")
LOSS_SCALE_KEYS = frozenset({"scale", "growth_interval", "_good_steps"})
_TRAJECTORY = {"seed": "count", "gradient_accumulation_steps": "positive", "optimizer": "str", "network_module": "str"}
_DATASET = {"batch_size": "positive", "images": "count", "images_with_repeats": "count", "digest": "str"}


def _shown(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {str(value.dtype).removeprefix('torch.')} tensor of shape {list(value.shape)}"
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:60]}..."


def _number(value: Any) -> float | int | None:
    """A real number (a Python number or a one-element tensor), else None; bools are not numbers here."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex() and value.dtype != torch.bool:
        return value.item()
    return None


def _count(value: Any, where: str, end: int = MAX_COUNT, low: int = 0) -> list[str]:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value < end:
        return [f"{where} is {_shown(value)}, not a whole number from {low} to {end - 1}"]
    return []


def _kind(value: Any, kind: str, where: str) -> list[str]:
    if kind == "str":
        return [] if isinstance(value, str) else [f"{where} is {_shown(value)}, not text"]
    return _count(value, where, low=1 if kind == "positive" else 0)


def _fields(record: Any, kinds: Mapping[str, str], where: str) -> list[str]:
    if not isinstance(record, dict):
        return [f"{where} is {_shown(record)}, not an object"]
    return [line for key, kind in kinds.items() for line in _kind(record.get(key), kind, f"{where}.{key}")]


def _train_state(train_state: Mapping[str, Any], legacy: bool) -> list[str]:
    where = f"{TRAIN_STATE}: "
    if legacy:
        return _count(train_state.get("current_step"), where + "current_step")
    out = _fields(train_state.get("position"), {"epoch": "count", "step": "count", "batch": "count"},
                  where + "position")
    out += _count(train_state.get("seed"), where + "seed", SEED_END)
    out += _count(train_state.get("steps_beyond_position", 0), where + "steps_beyond_position")
    trajectory = train_state.get("trajectory")
    out += _fields(trajectory, _TRAJECTORY, where + "trajectory")
    if isinstance(trajectory, dict):
        out += _count(trajectory.get("num_processes", 1), where + "trajectory.num_processes", low=1)
        datasets = trajectory.get("datasets")
        if not isinstance(datasets, list):
            out.append(f"{where}trajectory.datasets is {_shown(datasets)}, not a list")
        else:
            for index, dataset in enumerate(datasets):
                out += _fields(dataset, _DATASET, f"{where}trajectory.datasets[{index}]")
    return out


def position_limits(train_state: Mapping[str, Any], legacy: bool) -> tuple[int, int]:
    """(updates, processes) of a checked ``train_state.json``: the most updates its optimizer and schedule can have
    applied, and the number of processes (the schedule's ticks per update)."""
    if legacy:
        return train_state["current_step"], 1
    return (train_state["position"]["step"] + train_state.get("steps_beyond_position", 0),
            train_state["trajectory"].get("num_processes", 1))


def _rate(value: Any, where: str) -> list[str]:
    """A learning rate, or None (Adafactor's relative step keeps ``lr`` None)."""
    if value is None:
        return []
    number = _number(value)
    if number is None or not 0 <= number <= FLOAT32_MAX:
        return [f"{where} is {_shown(value)}, not a learning rate from 0 to {FLOAT32_MAX:.4g} (float32's largest)"]
    return []


def _step_entry(entry: Mapping[str, Any], where: str, updates: int) -> list[str]:
    out = []
    if "step" in entry:
        step = _number(entry["step"])
        if step is None or not (math.isfinite(step) and 0 <= step <= updates):
            out.append(f"{where}.step is {_shown(entry['step'])}, but the state is {updates} update(s) in: an "
                       "optimizer steps at most once per update")
    moments = SECOND_MOMENTS & entry.keys()
    if "exp_avg_diff" in entry:  # dadaptation's DAdaptAdanIP stores its gradient-difference average as exp_avg_sq
        moments.discard("exp_avg_sq")
    for key in moments:
        value = entry[key]
        if isinstance(value, torch.Tensor) and value.is_floating_point() and bool((value < 0).any()):
            out.append(f"{where}.{key} holds negative values; it is a mean of squares, never negative")
    return out


def _optimizer(optimizer: Any, updates: int) -> list[str]:
    where = f"{TENSORS}: optimizer"
    if not isinstance(optimizer, dict):
        return [f"{where} is {_shown(optimizer)}, not an optimizer state"]
    groups, state = optimizer.get("param_groups"), optimizer.get("state", {})
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        return [f"{where}.param_groups is {_shown(groups)}, not a list of parameter groups"]
    out: list[str] = []
    ids: list[Any] = []
    for index, group in enumerate(groups):
        params = group.get("params")
        if not isinstance(params, list) or any(isinstance(p, bool) or not isinstance(p, int) for p in params):
            out.append(f"{where}.param_groups[{index}].params is {_shown(params)}, not a list of parameter indexes")
            continue
        ids += params
        out += [line for key in LR_KEYS if key in group
                for line in _rate(group[key], f"{where}.param_groups[{index}].{key}")]
        out += [f"{where}.param_groups[{index}].{key} is NaN" for key, value in group.items()
                if isinstance(value, float) and math.isnan(value)]
    if len(set(ids)) != len(ids):
        out.append(f"{where}.param_groups list a parameter index twice")
    if optimizer.get("stochastic_rounding") is not None:  # optimizers/wrapper.py: its seed and step counts
        out += _rounding(optimizer["stochastic_rounding"], len(ids), f"{where}.stochastic_rounding")
    if not isinstance(state, dict):
        return [*out, f"{where}.state is {_shown(state)}, not an object"]
    for key, entry in state.items():
        if key not in ids or not isinstance(entry, dict):
            out.append(f"{where}.state[{_shown(key)}] is not the state of a parameter of its param_groups")
            continue
        out += _step_entry(entry, f"{where}.state[{key}]", updates)
    return out


def _rounding(record: Any, params: int, where: str) -> list[str]:
    """The rounding wrapper's seed and its step count per parameter (``steps``; one ``step`` for all in states
    written before it counted per parameter)."""
    out = _counts(record, ("seed", "step"), where)
    steps = record.get("steps") if isinstance(record, dict) else None
    if steps is None:
        return out
    if not isinstance(steps, list) or len(steps) != params:
        return [*out, f"{where}.steps is {_shown(steps)}, not a list of {params} step counts (one per parameter)"]
    return out + [line for index, step in enumerate(steps) for line in _count(step, f"{where}.steps[{index}]")]


def _scheduler(scheduler: Any, ticks: int) -> list[str]:
    where = f"{TENSORS}: scheduler"
    if not isinstance(scheduler, dict):
        return [f"{where} is {_shown(scheduler)}, not a learning-rate scheduler state"]
    out = []
    if "last_epoch" in scheduler:
        out += _count(scheduler["last_epoch"], f"{where}.last_epoch (ticks: once per process per update)",
                      ticks + 1, low=-1)
    if "_step_count" in scheduler:
        out += _count(scheduler["_step_count"], f"{where}._step_count", ticks + 2)
    for key in ("base_lrs", "_last_lr"):
        rates = scheduler.get(key, [])
        if not isinstance(rates, list):
            out.append(f"{where}.{key} is {_shown(rates)}, not a list of learning rates")
            continue
        out += [line for index, rate in enumerate(rates) for line in _rate(rate, f"{where}.{key}[{index}]")]
    return out


def _generator(value: Any, where: str) -> list[str]:
    if not (isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.ndim == 1):
        return [f"{where} is {_shown(value)}, not a generator state (a 1-d uint8 tensor)"]
    return []


def _python_rng(value: Any, where: str) -> list[str]:
    """``random.getstate()``: (version 3, 624 words and the index, the cached Gaussian or None)."""
    ok = isinstance(value, (tuple, list)) and len(value) == 3 and value[0] == 3
    words = value[1] if ok else None
    ok = ok and isinstance(words, (tuple, list)) and len(words) == 625
    ok = ok and all(isinstance(w, int) and not isinstance(w, bool) and 0 <= w < 2**32 for w in words)
    ok = ok and words[-1] <= 624 and (value[2] is None or isinstance(value[2], float))
    return [] if ok else [f"{where} is not Python's random state (version 3, 625 words below 2**32, None or a float)"]


def _rng(rng: Any, where: str) -> list[str]:
    if not isinstance(rng, dict):
        return [f"{where} is {_shown(rng)}, not the random state of a process"]
    out = _generator(rng.get("torch"), f"{where}.torch") + _generator(rng.get("noise"), f"{where}.noise")
    for key in ("noise_host", "python"):
        if rng.get(key) is not None:
            out += (_python_rng if key == "python" else _generator)(rng[key], f"{where}.{key}")
    cuda = rng.get("cuda")
    if cuda is not None:
        states = cuda if isinstance(cuda, list) else [cuda]
        out += [line for index, state in enumerate(states) for line in _generator(state, f"{where}.cuda[{index}]")]
    if not isinstance(rng.get("noise_device", "cpu"), str):
        out.append(f"{where}.noise_device is {_shown(rng['noise_device'])}, not a device type")
    return out


def _counts(record: Any, names: tuple[str, ...], where: str) -> list[str]:
    """Seeds and counts of a small record (each below 2**64), those of ``names`` that it holds."""
    if not isinstance(record, dict):
        return [f"{where} is {_shown(record)}, not an object"]
    return [line for name in names if name in record for line in _count(record[name], f"{where}.{name}", SEED_END)]


def _small_states(objects: Mapping[str, Any]) -> list[str]:
    """The accumulator's and the gradient reduction's seeds and counts, the fp16 loss scale."""
    out = []
    for key, names in (("accumulation", ("seed", "windows")), ("gradient_reduce", ("seed", "reductions"))):
        if objects.get(key):
            out += _counts(objects[key], names, f"{TENSORS}: {key}")
    scale = objects.get("loss_scale")
    if scale:
        where = f"{TENSORS}: loss_scale"
        if not isinstance(scale, dict) or not scale.keys() <= LOSS_SCALE_KEYS:
            return [*out, f"{where} is {_shown(scale)}, not a loss scale ({', '.join(sorted(LOSS_SCALE_KEYS))})"]
        number = _number(scale.get("scale", 1.0))
        if number is None or not 1 <= number <= FLOAT32_MAX:
            out.append(f"{where}.scale is {_shown(scale.get('scale'))}, not a number from 1 to {FLOAT32_MAX:.4g}")
        out += _count(scale.get("growth_interval", 1), f"{where}.growth_interval", low=1)
        out += _count(scale.get("_good_steps", 0), f"{where}._good_steps")
    return out


def state_problems(train_state: Mapping[str, Any], objects: Mapping[str, Any], legacy: bool) -> list[str]:
    """Every problem of a state as read (``SavedState``'s parts), one line each naming the file and the key."""
    out = _train_state(train_state, legacy)
    network = objects.get("network")
    if not isinstance(network, dict) or not network or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in network.items()):
        out.append(f"{TENSORS}: network holds no LoRA weights (a dict of tensors); it is not a training state of "
                   "this trainer")
    if out:  # the limits below need a sound train_state.json
        return out
    updates, processes = position_limits(train_state, legacy)
    out += _optimizer(objects.get("optimizer"), updates) + _scheduler(objects.get("scheduler"), updates * processes)
    if legacy:
        return out + [line for key in ("rng", "noise_rng") if objects.get(key) is not None
                      for line in _generator(objects[key], f"state.pt: {key}")]
    out += _rng(objects.get("rng"), f"{TENSORS}: rng")
    others = objects.get("rng_other_processes", [])
    if not isinstance(others, list):
        others = [others]
    out += [line for index, rng in enumerate(others) for line in _rng(rng, f"{TENSORS}: rng_other_processes[{index}]")]
    return out + _small_states(objects)


def shape_problems(saved_optimizer: Mapping[str, Any], param_groups: Iterable[Mapping[str, Any]]) -> list[str]:
    """Optimizer state tensors whose shape does not fit their parameter, matched as ``Optimizer.load_state_dict``
    matches them (the saved groups' indexes, in order, to this optimizer's parameters)."""
    out = []
    state = saved_optimizer.get("state", {})
    for saved_group, group in zip(saved_optimizer["param_groups"], param_groups, strict=False):
        for index, param in zip(saved_group["params"], group["params"], strict=False):
            for key, value in (state.get(index) or {}).items():
                if not isinstance(value, torch.Tensor) or _fits(key, value, param):
                    continue
                out.append(f"{TENSORS}: optimizer.state[{index}].{key} has shape {list(value.shape)}, its parameter "
                           f"{list(param.shape)}")
    return out


def _fits(key: str, value: torch.Tensor, param: torch.Tensor) -> bool:
    if value.shape == param.shape:
        return True
    if key in PARAM_SHAPED:
        return False
    if value.numel() != param.numel() or value.ndim == 1:  # another statistic, or flat (Prodigy's "s")
        return True
    # a statistic over one dimension of a parameter with a dimension of size 1 (Adafactor's factored moments of a
    # 1x1 convolution's [out, in, 1, 1] weight are [out, in, 1])
    return any(value.shape == param.shape[:dim] + param.shape[dim + 1:] for dim in range(param.ndim))


def steps_beyond_position(optimizer: Mapping[str, Any], scheduler: Mapping[str, Any], step: int,
                          processes: int) -> int:
    """Updates the optimizer and schedule carry beyond ``step`` (written with each state): 0, except after a
    ``--resume`` with a lower ``--initial_step``, whose position restarts while they keep their counts."""
    steps = [_number(entry.get("step")) for entry in (optimizer.get("state") or {}).values()
             if isinstance(entry, dict)]
    most = max([int(s) for s in steps if s is not None and math.isfinite(s)], default=0)
    last_epoch = scheduler.get("last_epoch") if isinstance(scheduler, dict) else None
    if isinstance(last_epoch, int) and processes > 0:
        most = max(most, -(-last_epoch // processes))
    return max(0, most - step)
