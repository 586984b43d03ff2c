"""A run's TensorBoard scalars, found in this trainer's and sd-scripts' ``--logging_dir`` layouts and merged over
resumes.

Layouts: this trainer writes ``<logging_dir>/<log_prefix><YYYYmmddHHMMSS>/events.out.tfevents.*``; sd-scripts
(accelerate's tracker) one level further down, ``<logging_dir>/<log_prefix><YYYYmmddHHMMSS>/network_train/``. A run
is named after its timestamp folder in both.

Resumes: each event file is one part of a run, in the order it was written. A ``--resume``\\ d run writes a new
timestamp folder whose first update is after step 1: the newest run is joined to the older run folders (same
prefix) that reach the step before it, newest first. Parts are merged into one continuous run: a later part
replaces every value of the earlier ones from its first step on (the steps the earlier run made after the saved
state are dropped), and within a part the newest value per step is kept, so no step goes back and none repeats.

Epoch-logged tags (a name with ``epoch`` in it: ``loss/epoch_average``, ``loss/validation/epoch_average``; sd-scripts
logs them at the epoch number) are moved to the update they follow, found by wall time within their part; the epoch
boundaries come from ``loss/epoch_average`` (or sd-scripts' older ``loss/epoch``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

EVENTS = "events.out.tfevents.*"
TIMESTAMP = re.compile(r"^(?P<prefix>.*?)(?P<stamp>\d{14})$")
EPOCH_TAGS = ("loss/epoch_average", "loss/epoch")


@dataclass
class Series:
    """One scalar tag: steps, wall times and values, in step order."""

    steps: list[int] = field(default_factory=list)
    walls: list[float] = field(default_factory=list)
    values: list[float] = field(default_factory=list)


@dataclass
class RunLog:
    """A run's scalars merged over its parts; ``epochs`` are (epoch number, its last update); ``resumed_at`` the
    first update of each part after the first."""

    name: str
    folders: list[Path]
    scalars: dict[str, Series]
    epochs: list[tuple[int, int]] = field(default_factory=list)
    resumed_at: list[int] = field(default_factory=list)


def _has_events(folder: Path) -> bool:
    return any(p.is_file() for p in folder.glob(EVENTS))


def run_folders(log_dir: Path) -> list[Path]:
    """The run folders of a ``--logging_dir``, oldest first: each subfolder holding event files, or whose subfolder
    does (sd-scripts' ``<timestamp>/network_train``). ``log_dir`` itself when it holds event files."""
    if _has_events(log_dir):
        return [log_dir]
    found = []
    for child in sorted(p for p in log_dir.iterdir() if p.is_dir()) if log_dir.is_dir() else []:
        if _has_events(child):
            found.append(child)
        else:
            inner = sorted(p for p in child.iterdir() if p.is_dir() and _has_events(p))
            found.extend(inner[-1:])
    return sorted(found, key=lambda p: (_stamp(run_name(p)), str(p)))


def run_name(folder: Path) -> str:
    """The timestamp folder's name: ``folder``'s own, or its parent's for sd-scripts' ``<timestamp>/network_train``."""
    if TIMESTAMP.match(folder.name) is None and TIMESTAMP.match(folder.parent.name) is not None:
        return folder.parent.name
    return folder.name


def _stamp(name: str) -> str:
    match = TIMESTAMP.match(name)
    return match["stamp"] if match else ""


def _prefix(name: str) -> str | None:
    match = TIMESTAMP.match(name)
    return match["prefix"] if match else None


def read_event_file(path: Path) -> dict[str, Series]:
    """Every scalar of one event file, all events kept (EventAccumulator samples by default), the newest value per
    step, in step order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(path), size_guidance={"scalars": 0})
    events.Reload()
    out: dict[str, Series] = {}
    for tag in events.Tags()["scalars"]:
        newest = {event.step: event for event in events.Scalars(tag)}  # later events win
        series = out.setdefault(tag, Series())
        for step in sorted(newest):
            series.steps.append(step)
            series.walls.append(newest[step].wall_time)
            series.values.append(newest[step].value)
    return out


def at_update(epoch_series: Series, updates: Series) -> list[int]:
    """The update each epoch-logged value follows: the last update logged before it (by wall time)."""
    steps = []
    for wall in epoch_series.walls:
        before = [s for s, w in zip(updates.steps, updates.walls, strict=True) if w <= wall]
        steps.append(before[-1] if before else 0)
    return steps


def _is_epoch_tag(tag: str) -> bool:
    return "epoch" in tag


def _part(raw: dict[str, Series]) -> tuple[dict[str, Series], list[tuple[int, int]]]:
    """One event file's scalars with the epoch-logged tags moved to their update, and its epoch boundaries."""
    step_tags = [t for t in raw if not _is_epoch_tag(t)]
    updates = raw.get("loss/current") or max((raw[t] for t in step_tags), key=lambda s: len(s.steps), default=None)
    out, epochs = {}, []
    for tag, series in raw.items():
        if not _is_epoch_tag(tag):
            out[tag] = series
            continue
        steps = at_update(series, updates) if updates is not None else list(series.steps)
        out[tag] = Series(steps, list(series.walls), list(series.values))
        if tag in EPOCH_TAGS and not epochs:
            epochs = list(zip(series.steps, steps, strict=True))
    return out, epochs


def _first_step(scalars: dict[str, Series]) -> int | None:
    firsts = [s.steps[0] for t, s in scalars.items() if s.steps and not _is_epoch_tag(t)]
    return min(firsts) if firsts else None


def merge_parts(parts: list[dict[str, Series]]) -> tuple[dict[str, Series], list[tuple[int, int]], list[int]]:
    """Event files' scalars (oldest first) as one run: each part replaces the earlier ones from its first step on."""
    merged: dict[str, Series] = {}
    epochs: list[tuple[int, int]] = []
    resumed: list[int] = []
    for raw in parts:
        scalars, part_epochs = _part(raw)
        start = _first_step(scalars)
        if start is None:
            continue
        if merged and start > 1:  # a part from step 1 is a restart: it replaces everything before it
            resumed.append(start)
        for series in merged.values():
            keep = [i for i, s in enumerate(series.steps) if s < start]
            series.steps, series.walls, series.values = ([getattr(series, a)[i] for i in keep]
                                                         for a in ("steps", "walls", "values"))
        epochs = [e for e in epochs if e[1] < start] + part_epochs
        for tag, series in scalars.items():
            into = merged.setdefault(tag, Series())
            for step, wall, value in zip(series.steps, series.walls, series.values, strict=True):
                if into.steps and into.steps[-1] == step:  # an epoch value moved onto a step already held
                    into.walls[-1], into.values[-1] = wall, value
                else:
                    into.steps.append(step)
                    into.walls.append(wall)
                    into.values.append(value)
    return {t: s for t, s in merged.items() if s.steps}, epochs, resumed


def _folder_parts(folder: Path) -> list[dict[str, Series]]:
    """The event files of one folder, read, in the order they were written (first wall time, then name)."""
    parts = [read_event_file(p) for p in sorted(folder.glob(EVENTS)) if p.is_file()]
    return sorted(parts, key=lambda raw: min((s.walls[0] for s in raw.values() if s.walls), default=0.0))


def _span(parts: list[dict[str, Series]]) -> tuple[int, int] | None:
    steps = [st for raw in parts for t, s in raw.items() if not _is_epoch_tag(t) for st in s.steps]
    return (min(steps), max(steps)) if steps else None


def read_run(log_dir: Path) -> RunLog:
    """The newest run under ``log_dir`` (a ``--logging_dir`` or one run folder), joined to the earlier runs it
    resumed."""
    folders = run_folders(log_dir)
    if not folders:
        raise SystemExit(f"{log_dir}: no TensorBoard event files here, in a subfolder or in sd-scripts' "
                         "<timestamp>/network_train/ below it; pass the --logging_dir of a run (or one run folder)")
    chain = [folders[-1]]
    parts = {folders[-1]: _folder_parts(folders[-1])}
    span = _span(parts[folders[-1]])
    for older in reversed(folders[:-1]):
        if span is None or span[0] <= 1:
            break
        if _prefix(run_name(older)) != _prefix(run_name(chain[0])):
            continue
        parts[older] = _folder_parts(older)
        older_span = _span(parts[older])
        if older_span is None or older_span[0] >= span[0] or older_span[1] < span[0] - 1:
            break
        chain.insert(0, older)
        span = older_span
    scalars, epochs, resumed = merge_parts([raw for folder in chain for raw in parts[folder]])
    return RunLog(run_name(chain[-1]), chain, scalars, epochs, resumed)


def read_scalars(run_dir: Path) -> dict[str, Series]:
    """Every scalar of one run folder, its event files merged as one run (epoch tags at their update)."""
    return merge_parts(_folder_parts(run_dir))[0]
