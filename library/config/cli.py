"""Command line and ``--config_file`` handling with sd-scripts' flag names.

The flags are generated from the config dataclasses (``library/config/``), one argparse group per section, so a
flag's name, default, type and help exist in one place. Precedence is sd-scripts': explicit command-line flag >
``--config_file`` TOML > default. TOML values take the forms sd-scripts takes (it passes them through untouched):
lists for ``nargs`` flags (a single value is one item), ``0``/``1`` for booleans, integers for floats, integral
floats for integers. Unlike sd-scripts, an unknown TOML key or flag is an error with a suggestion instead of being
ignored, and a value of the wrong type is an error naming the file, table and key; the keys that the kohya_ss GUI
writes without sd-scripts using them are accepted with an info line (``library/config/gui.py``).

One parser per entry script, made from its model family's record (``library.families.spec.FamilySpec``, which the
entry script passes in: this package imports no family): the shared sections plus the family's own flags
(``FamilySpec.section``); each script refuses the other families' keys in a TOML with a message naming the scripts
that have them, as for the keys of upstream's scripts that this trainer does not have.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from library.base.bounded import load_toml
from library.base.errors import UserError, did_you_mean
from library.config import SECRET_FIELDS, TrainConfig, all_fields, family_sections, field_default, from_namespace
from library.config.gui import GUI_ONLY_KEYS, GUI_REFUSED_WHEN_SET, GUI_TRACKER_KEYS, OTHER_FAMILY_KEYS

log = logging.getLogger(__name__)

# Flags sd-scripts still accepts under an old name; the value is the current flag.
LEGACY_FLAGS = {"caption_extention": "caption_extension"}
# Legacy optimizer switches (sd-scripts: an error when combined with --optimizer_type).
LEGACY_OPTIMIZER_FLAGS = {"use_8bit_adam": "AdamW8bit", "use_lion_optimizer": "Lion"}


def legacy_flags(family: Any) -> dict[str, str]:
    """The old flag names the script of ``family`` accepts: the shared ones and its own (old -> current)."""
    return {**LEGACY_FLAGS, **family.legacy_flags}


class _Parser(argparse.ArgumentParser):
    """argparse that raises ``UserError`` instead of exiting: an unknown flag that another script has is named as
    that script's option (as a TOML key is, ``_owners``), any other gets a did-you-mean."""

    family: Any = None  # the script's FamilySpec
    families: Sequence[Any] = ()  # every family's record

    def error(self, message: str) -> None:  # type: ignore[override]
        if message.startswith("unrecognized arguments:"):
            known = [o.lstrip("-") for a in self._actions for o in a.option_strings]
            hints = []
            for arg in message.split(":", 1)[1].split():
                if arg.startswith("--"):
                    name = arg[2:].split("=")[0]
                    owner = _owners(name, self.family, self.families)
                    hints.append(f"unknown flag --{name}: it is an option for {owner}; {self.family.script} trains "
                                 f"{self.family.trains}" if owner is not None
                                 else f"unknown flag --{name}{did_you_mean(name, known)}")
            raise UserError(*(hints or [message]), f"run `python {self.prog} --help` for the list of flags")
        raise UserError(f"{message} (run `python {self.prog} --help` for usage)")


def _kind(f: dataclasses.Field) -> tuple[str, str | None]:
    """The value kind of a field from its annotation: ("bool"|"int"|"float"|"str", None) or ("list", element)."""
    t = str(f.type).replace(" ", "")
    if t == "bool":
        return "bool", None
    if t.startswith("list["):
        return "list", t[5:-1]
    first = t.split("|")[0]
    return (first if first in ("int", "float") else "str"), None


_CONVERT = {"int": int, "float": float, "str": str}


def _help(f: dataclasses.Field, family: Any) -> str:
    """A flag's ``--help`` text in the script of ``family``: what its record says the model flag takes, and for a
    shared flag it refuses or ignores, that it does (``FamilySpec.refused_flags`` / ``ignored_flags``)."""
    text = family.model_help if f.name == "pretrained_model_name_or_path" else f.metadata["help"]
    if f.name in family.refused_flags:
        text = f"not for {family.display_name}, an error when set: {family.refused_flags[f.name]}"
    elif f.name in family.ignored_flags:
        text = f"no effect on {family.display_name} ({family.ignored_flags[f.name]}); {text}"
    return f"{text} (default: {field_default(f)})".replace("%", "%%")


def build_parser(family: Any, families: Sequence[Any] = ()) -> argparse.ArgumentParser:
    """The argument parser of the script of ``family`` (a ``FamilySpec``); every default is ``SUPPRESS`` so that
    explicit flags can be told apart. ``families``: every family's record, to name the script of an unknown flag."""
    parser = _Parser(prog=family.script, description=family.description, argument_default=argparse.SUPPRESS,
                     allow_abbrev=False)
    parser.family, parser.families = family, families
    fields = all_fields(family)
    for section, cls in family_sections(family).items():
        group = parser.add_argument_group(section, (cls.__doc__ or "").strip().splitlines()[0])
        for f in dataclasses.fields(cls):
            if fields.get(f.name, (None,))[0] != section:  # a shared flag it lacks, or declares in its section
                continue
            meta = f.metadata
            kind, element = _kind(f)
            kwargs: dict[str, Any] = {"help": _help(f, family)}
            if kind == "bool":
                kwargs["action"] = "store_true"
            elif kind == "list":
                kwargs["nargs"] = "*"
                kwargs["type"] = _CONVERT.get(element or "str", str)
            else:
                kwargs["type"] = meta["parse"] or _CONVERT[kind]
                if meta["choices"]:
                    kwargs["choices"] = meta["choices"]
            names = [f"--{f.name}"] + [f"--{old}" for old, new in legacy_flags(family).items() if new == f.name]
            group.add_argument(*names, dest=f.name, **kwargs)
    legacy = parser.add_argument_group("legacy", "old sd-scripts switches, kept for existing scripts")
    for name, optimizer in LEGACY_OPTIMIZER_FLAGS.items():
        legacy.add_argument(f"--{name}", action="store_true", help=f"same as --optimizer_type {optimizer}")
    return parser


_EXPECTED = {"list": "a list", "int": "an integer", "float": "a number", "bool": "true or false (or 1 / 0)",
             "str": "a string"}


def _scalar(value: Any, kind: str) -> tuple[bool, Any]:
    """(ok, converted) for one TOML value of a scalar kind, in the forms sd-scripts' parser lets through."""
    if kind == "bool":
        if isinstance(value, bool):
            return True, value
        if isinstance(value, int) and value in (0, 1):
            return True, bool(value)
        return False, None
    if isinstance(value, bool):
        return False, None
    if kind == "int":
        if isinstance(value, int):
            return True, value
        if isinstance(value, float) and value.is_integer():
            return True, int(value)
        return False, None
    if kind == "float":
        return (True, float(value)) if isinstance(value, (int, float)) else (False, None)
    return (True, value) if isinstance(value, str) else (False, None)


def _check_toml_value(name: str, value: Any, f: dataclasses.Field, where: str) -> Any:
    """Type-check (and parse) one TOML value the way the matching flag would."""
    kind, element = _kind(f)
    parse = f.metadata["parse"]
    if value is None:
        return None
    if parse is not None:
        return parse(value)
    if kind == "list":
        items = value if isinstance(value, list) else [value]
        converted = [_scalar(item, element or "str") for item in items]
        if not all(ok for ok, _ in converted):
            noun = {"float": "numbers", "int": "integers"}.get(element or "str", "strings")
            raise UserError(f"{where}: {name} = {value!r}: expected a list of {noun}")
        return [v for _, v in converted]
    ok, converted = _scalar(value, kind)
    if not ok:
        raise UserError(f"{where}: {name} = {value!r}: expected {_EXPECTED[kind]}")
    choices = f.metadata["choices"]
    if choices and converted not in choices:
        raise UserError(f"{where}: {name} = {value!r}: expected one of {', '.join(map(str, choices))}")
    return converted


def _read_toml(file: Path) -> dict[str, Any]:
    if not file.is_file():
        raise UserError(f"--config_file {file}: file not found")
    try:
        return load_toml(file.read_text(encoding="utf-8"), str(file), "edit the file (its keys are the flags, in "
                         "[sections])")
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"{file}: not valid TOML: {exc}") from None
    except UnicodeDecodeError:
        raise UserError(f"{file}: not UTF-8 text; save the file as UTF-8") from None


def read_config_file(path: str, family: Any, families: Sequence[Any] = ()) -> dict[str, Any]:
    """Read a training-arguments TOML as sd-scripts does (all tables flattened), but strictly.

    Unknown keys, keys given in two tables and values of the wrong type are errors that name the file, the table
    and the key; all of them are reported at once. Keys the kohya_ss GUI writes for nothing are accepted with an
    info line. ``family``: the script's ``FamilySpec``; ``families``: all of them, to name the script that has a key
    this one lacks.
    """
    values, file, gui_fields = _read_config(path, family, families)
    _log_gui_fields(file, gui_fields)
    return values


def _log_gui_fields(file: Path | None, gui_fields: list[str]) -> None:
    """The one info line about the kohya_ss GUI's fields of ``file`` that change nothing."""
    if gui_fields:
        notes = {**GUI_ONLY_KEYS, **GUI_TRACKER_KEYS}
        log.info("%s: %s: kohya_ss GUI field(s) with no effect on training (sd-scripts ignores them too): %s",
                 file, ", ".join(gui_fields), "; ".join(f"{k}: {notes[k]}" for k in gui_fields))


def _quiet_gui_tracker_fields(values: dict[str, Any], explicit: dict[str, Any], gui_fields: list[str]) -> None:
    """A GUI file's ``wandb_run_name`` (the GUI writes one into every file) without wandb as the tracker: dropped
    and named in the GUI info line instead of the warning about tracker flags without a tracker."""
    if not gui_fields or values.get("log_with") in ("wandb", "all"):
        return
    for key in GUI_TRACKER_KEYS:
        if key not in explicit and values.get(key) is not None:
            values[key] = None
            gui_fields.append(key)


def _owners(key: str, family: Any, families: Sequence[Any]) -> str | None:
    """The other scripts that have ``key``: ours first (in ``families`` order), then those of upstream's that the
    kohya_ss GUI writes keys for; None when no other script has it."""
    ours = [f"{other.display_name} ({other.script})" for other in families
            if other.script != family.script and key in all_fields(other)]
    owners = ours + [name for name, keys in OTHER_FAMILY_KEYS.items() if key in keys]
    if not owners:
        return None
    return owners[0] if len(owners) == 1 else ", ".join(owners[:-1]) + " and " + owners[-1]


def _read_config(path: str, family: Any, families: Sequence[Any]) -> tuple[dict[str, Any], Path, list[str]]:
    """``read_config_file`` without the info line: the values, the file, and the GUI-only keys it holds."""
    file = Path(path if path.endswith(".toml") else path + ".toml")
    data = _read_toml(file)
    fields = all_fields(family)
    legacy = legacy_flags(family)
    known = [*fields, *legacy, *LEGACY_OPTIMIZER_FLAGS, *GUI_ONLY_KEYS, *GUI_REFUSED_WHEN_SET]
    values: dict[str, Any] = {}
    seen_in: dict[str, str] = {}
    problems: list[str] = []
    gui_fields: list[str] = []

    def visit(table: dict[str, Any], where: str) -> None:
        for key, value in table.items():
            if isinstance(value, dict):
                visit(value, f"{where}.{key}" if where else key)
                continue
            loc = f"{file}: [{where}]" if where else f"{file}:"
            name = legacy.get(key, key)
            if name in GUI_ONLY_KEYS and name not in fields:  # a flag of this script: read as one (train_db.py)
                gui_fields.append(key)
            elif name in GUI_REFUSED_WHEN_SET:
                if value:
                    problems.append(f"{loc} {key} = {value!r}: {GUI_REFUSED_WHEN_SET[name]}")
            elif name not in fields and name not in LEGACY_OPTIMIZER_FLAGS:
                owner = _owners(key, family, families)
                if owner is not None:
                    problems.append(f'{loc} "{key}" is an option for {owner}; {family.script} trains '
                                    f'{family.trains}')
                else:
                    problems.append(f'{loc} unknown key "{key}"{did_you_mean(key, known)}')
            elif name in seen_in:
                problems.append(f'{loc} key "{key}" is also set in [{seen_in[name]}]; keep one')
            elif name in LEGACY_OPTIMIZER_FLAGS:
                values[name] = bool(value)
                seen_in[name] = where
            else:
                try:
                    values[name] = _check_toml_value(key, value, fields[name][1], loc.rstrip(":"))
                except UserError as exc:
                    problems.extend(exc.messages)
                seen_in[name] = where

    visit(data, "")
    if problems:
        raise UserError(*problems)
    return values, file, gui_fields


def _defaults(family: Any) -> dict[str, Any]:
    """Every flag's default: the shared ones, then those of ``family``'s script (its own section's declaration of
    a shared name wins)."""
    return {name: field_default(f) for fields in (all_fields(), all_fields(family))
            for name, (_, f) in fields.items()}


def _apply_legacy_optimizer(values: dict[str, Any]) -> None:
    chosen = [name for name in LEGACY_OPTIMIZER_FLAGS if values.pop(name, False)]
    if not chosen:
        return
    if len(chosen) > 1 or values.get("optimizer_type"):
        raise UserError(f"--{chosen[0]} cannot be combined with --optimizer_type or another legacy switch; "
                        f"use --optimizer_type {LEGACY_OPTIMIZER_FLAGS[chosen[0]]} alone")
    values["optimizer_type"] = LEGACY_OPTIMIZER_FLAGS[chosen[0]]


# Never written by --output_config (sd-scripts leaves these out too): secrets and the config switches themselves.
_NOT_WRITTEN = {"config_file", "output_config", *SECRET_FIELDS}


def write_config_file(path: str, explicit: dict[str, Any]) -> Path:
    """``--output_config``: write the explicitly given arguments to a TOML; never overwrite, never write through a
    link (a dangling one included: ``library/base/files.write_file_exclusive``)."""
    import toml

    from library.base.files import link_description, write_file_exclusive

    file = Path(path if path.endswith(".toml") else path + ".toml")
    if file.is_symlink():
        raise UserError(f"--output_config: {file} {link_description(file)}; the config is never written through a "
                        "link: choose another --config_file path or remove the link")
    body = {k: list(v) if isinstance(v, tuple) else v for k, v in explicit.items()
            if k not in _NOT_WRITTEN and v is not None}
    try:
        write_file_exclusive(file, lambda f: f.write(toml.dumps(body).encode("utf-8")))
    except FileExistsError:
        raise UserError(f"--output_config: {file} exists; choose another --config_file path or remove it") from None
    except OSError as exc:
        raise UserError(f"--output_config: cannot write {file} ({exc.strerror or exc}); choose a --config_file path "
                        "in an existing, writable folder") from None
    return file


def parse_args(argv: list[str], family: Any, families: Sequence[Any] = ()) -> tuple[TrainConfig, dict[str, Any]]:
    """Parse a kohya command line of the script of ``family`` (a ``FamilySpec``) into a ``TrainConfig``; also return
    the explicitly given values. ``families``: every family's record, to name the script that has a TOML key this
    one lacks."""
    explicit = vars(build_parser(family, families).parse_args(argv))
    # With --output_config, --config_file names the file to write (sd-scripts' read_config_from_file): not read.
    reads = explicit.get("config_file") and not explicit.get("output_config")
    from_file, file, gui_fields = (_read_config(explicit["config_file"], family, families) if reads
                                   else ({}, None, []))
    values = {**_defaults(family), **from_file, **explicit}
    _quiet_gui_tracker_fields(values, explicit, gui_fields)
    _log_gui_fields(file, gui_fields)
    _apply_legacy_optimizer(values)
    return from_namespace(values, family), {**from_file, **explicit}
