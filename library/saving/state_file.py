"""A training-state folder on disk without pickle: tensors in safetensors, everything else in JSON.

``--save_state`` writes a folder holding
* ``state.safetensors``: every tensor (LoRA weights, optimizer state, generator states as uint8 tensors) and, in
  its metadata under ``sd_scripts_bf16_state``, the JSON tree of the rest (optimizer param groups and step counts,
  scheduler state, Python's random state, ...) in which each tensor appears as ``{"__tensor__": name}``;
* ``train_state.json``: sd-scripts' ``current_epoch`` / ``current_step``, and ours: the exact position, the seed,
  what defines the run's trajectory, and the resolved config.

Neither file can run code when read (sd-scripts' accelerate states and this project's earlier ``state.pt`` are
pickles: ``torch.load(weights_only=False)`` of a hostile file executes it). An earlier ``state.pt`` is still read,
but only with ``torch.load(weights_only=True)``, which refuses anything but tensors and plain containers.

JSON forms beyond its own types: tuples ``{"__tuple__": [...]}``, dicts whose keys are not all strings (optimizer
state is keyed by parameter index) ``{"__items__": [[key, value], ...]}``, ``{"__dtype__": "bfloat16"}``,
``{"__device__": "cuda:0"}``. Any other object is refused with its path in the tree.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from library.base.bounded import load_json
from library.base.errors import UserError
from library.base.files import replace_folder, write_new_file
from library.saving.state_schema import state_problems

FORMAT = "sd-scripts-bf16/state-2"
TENSORS_FILE = "state.safetensors"
TRAIN_STATE_FILE = "train_state.json"
LEGACY_FILE = "state.pt"
TREE_KEY = "sd_scripts_bf16_state"
_MARKERS = ("__tensor__", "__tuple__", "__items__", "__dtype__", "__device__")


class StateFormatError(ValueError):
    """The tree cannot be stored as JSON (at save) or is not one this module wrote (at load)."""


def encode(obj: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """Split ``obj`` into a JSON-able tree and the tensors it references."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(value: Any, where: str) -> Any:
        if isinstance(value, torch.Tensor):
            name = f"t{len(tensors)}"
            tensors[name] = value.detach().to("cpu", copy=True).contiguous()
            return {"__tensor__": name}
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, tuple):
            return {"__tuple__": [walk(v, f"{where}[{i}]") for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [walk(v, f"{where}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, dict):
            if all(isinstance(k, str) and k not in _MARKERS for k in value):
                return {k: walk(v, f"{where}.{k}") for k, v in value.items()}
            return {"__items__": [[walk(k, f"{where} key"), walk(v, f"{where}[{k!r}]")] for k, v in value.items()]}
        if isinstance(value, torch.dtype):
            return {"__dtype__": str(value).removeprefix("torch.")}
        if isinstance(value, torch.device):
            return {"__device__": str(value)}
        raise StateFormatError(f"{where} is a {type(value).__name__}, which cannot be stored without pickle")

    return walk(obj, "state"), tensors


def decode(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The inverse of ``encode``."""

    def walk(value: Any) -> Any:
        if isinstance(value, list):
            return [walk(v) for v in value]
        if not isinstance(value, dict):
            return value
        if len(value) == 1 and next(iter(value)) in _MARKERS:
            kind, payload = next(iter(value.items()))
            if kind == "__tensor__":
                if payload not in tensors:
                    raise StateFormatError(f"tensor {payload!r} is missing")
                return tensors[payload]
            if kind == "__tuple__":
                return tuple(walk(v) for v in payload)
            if kind == "__items__":
                return {walk(k): walk(v) for k, v in payload}
            if kind == "__dtype__":
                dtype = getattr(torch, str(payload), None)
                if not isinstance(dtype, torch.dtype):
                    raise StateFormatError(f"unknown dtype {payload!r}")
                return dtype
            return torch.device(payload)
        return {k: walk(v) for k, v in value.items()}

    try:
        return walk(tree)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise StateFormatError(str(exc)) from exc


def write_state(folder: Path, objects: dict[str, Any], train_state: dict[str, Any]) -> None:
    """Write (or replace) a state folder; see ``library/base/files.replace_folder`` for the atomicity."""
    from safetensors.torch import save

    tree, tensors = encode(objects)
    payload = save(tensors, {TREE_KEY: json.dumps(tree)})
    text = json.dumps({**train_state, "format": FORMAT}, indent=2, default=str).encode()

    def fill(tmp: Path) -> None:
        write_new_file(tmp / TENSORS_FILE, lambda f: f.write(payload))
        write_new_file(tmp / TRAIN_STATE_FILE, lambda f: f.write(text))

    replace_folder(folder, fill)


@dataclass
class SavedState:
    """A state folder as read: ``train_state.json`` and the decoded objects."""

    folder: str
    train_state: dict[str, Any]
    objects: dict[str, Any]

    @property
    def legacy(self) -> bool:
        """Written by an earlier version (``state.pt``): no position, seed or trajectory stored."""
        return self.train_state.get("format") != FORMAT


def read_state(folder: str) -> SavedState:
    """Read a ``--resume`` folder; every problem is one ``UserError`` naming the folder and file."""
    path = Path(folder)
    train_state = _read_train_state(folder, path / TRAIN_STATE_FILE)
    if (path / TENSORS_FILE).is_file():
        objects = _read_tensors(folder, path / TENSORS_FILE)
    elif (path / LEGACY_FILE).is_file():
        objects = _read_legacy(folder, path / LEGACY_FILE)
    elif (path / "optimizer.bin").is_file():
        raise UserError(f"--resume {folder}: a state written by sd-scripts (accelerate); its optimizer.bin and "
                        "random_states_0.pkl are pickles, which could run code, so they are not read. Start a new "
                        f"run; --network_weights {path / 'model.safetensors'} continues from its LoRA weights")
    else:
        raise UserError(f"--resume {folder}: no {TENSORS_FILE} in it (nor the {LEGACY_FILE} of earlier versions); "
                        "give a folder written by --save_state (<name>-state, <name>-step<N>-state, ...)")
    if not isinstance(objects, dict):
        raise UserError(f"--resume {folder}: the state holds a {type(objects).__name__}, not a training state")
    saved = SavedState(folder, train_state, objects)
    problems = state_problems(train_state, objects, saved.legacy)
    if problems:
        raise UserError(*(f"--resume {folder}: {line}" for line in problems), DAMAGED_HINT)
    return saved


DAMAGED_HINT = ("the state is damaged or was edited by hand: resume from another state folder (an interrupted or full "
                "disk can truncate the last one), or start a new run")


def _damaged(folder: str, file: Path, why: str) -> UserError:
    return UserError(f"--resume {folder}: {file.name} is damaged ({why}); resume from another state folder (an "
                     "interrupted or full disk can truncate the last one)")


def _read_train_state(folder: str, file: Path) -> dict[str, Any]:
    if not file.is_file():
        raise UserError(f"--resume {folder}: not a state folder (no {TRAIN_STATE_FILE}); give a folder written by "
                        "--save_state")
    try:
        data = load_json(file.read_text(encoding="utf-8"), f"--resume {folder}: {file.name}", DAMAGED_HINT)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _damaged(folder, file, str(exc) or "empty") from None
    if not isinstance(data, dict):
        raise _damaged(folder, file, f"a JSON {type(data).__name__} instead of an object")
    return data


def _read_tensors(folder: str, file: Path) -> Any:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
        if TREE_KEY not in meta:
            raise _damaged(folder, file, f"no {TREE_KEY} entry in its metadata")
        tree = load_json(meta[TREE_KEY], f"--resume {folder}: {file.name}: metadata {TREE_KEY}", DAMAGED_HINT)
        return decode(tree, tensors)
    except (SafetensorError, OSError, json.JSONDecodeError, StateFormatError) as exc:
        raise _damaged(folder, file, str(exc)) from None


def _read_legacy(folder: str, file: Path) -> Any:
    import pickle

    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError, AttributeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"--resume {folder}: {file.name} cannot be read safely ({first}). It is a pickle of an "
                        "earlier version, read here only as plain tensors and containers, since a pickle can run "
                        "code. Resume from a state written by this version, or start the run again") from None
