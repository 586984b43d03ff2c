"""How a config field is declared, and the value parsers that flags and TOML keys share.

A field declared with ``flag`` is also the command-line flag ``--<name>``; its help text, default, choices and
parser live in the field's metadata, and ``library/config/cli.py`` builds argparse from it. ``parse`` converts a
command-line string, and the same function converts a TOML value, so both forms accept the same things.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import field
from typing import Any

from library.base.errors import UserError


def flag(default: Any, help: str, *, choices: tuple[Any, ...] | None = None,
         parse: Callable[[Any], Any] | None = None, metavar: str | None = None,
         extra: dict[str, Any] | None = None) -> Any:
    """A config field that is also a command-line flag ``--<name>``.

    ``parse`` converts the command-line string (and is also applied to TOML values); ``choices`` limits the
    accepted values; ``extra`` adds metadata of the section's own. Mutable defaults are copied per instance.
    """
    meta = {"help": help, "choices": choices, "parse": parse, "metavar": metavar, **(extra or {})}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def parse_resolution(text: str | int | list | tuple) -> tuple[int, int]:
    """sd-scripts' ``--resolution``: "512" means 512x512, "768,512" means width 768, height 512."""
    if isinstance(text, bool):
        raise UserError(f'--resolution {text!r}: expected "SIZE" or "WIDTH,HEIGHT" in pixels, e.g. 512 or 768,512')
    if isinstance(text, int):
        return (text, text)
    if isinstance(text, (list, tuple)):
        parts = [str(p) for p in text]
    else:
        parts = [p.strip() for p in str(text).split(",")]
    try:
        values = [int(p) for p in parts]
    except ValueError:
        raise UserError(f'--resolution "{text}": expected "SIZE" or "WIDTH,HEIGHT" in pixels, e.g. 512 or 768,512') \
            from None
    if len(values) == 1:
        values = values * 2
    if len(values) != 2 or min(values) <= 0:
        raise UserError(f'--resolution "{text}": expected one or two positive integers, e.g. 512 or 768,512')
    return (values[0], values[1])


def parse_steps_or_ratio(text: str | int | float) -> int | float:
    """``--lr_warmup_steps`` / ``--lr_decay_steps`` as upstream's ``int_or_float``: an integer is a count of
    updates ("100"); a float is a ratio of all updates ("0.1", and "1.0" means the whole run); "10%" is 0.1."""
    if isinstance(text, bool):
        raise UserError(f'{text!r} is not a step count, a ratio such as 0.1 or a percentage such as "10%"')
    if isinstance(text, (int, float)):
        return text
    s = str(text).strip()
    try:
        if s.endswith("%"):
            return float(s[:-1]) / 100.0
        return int(s) if s.lstrip("-").isdigit() else float(s)
    except ValueError:
        raise UserError(f'"{text}" is not a step count, a ratio such as 0.1 or a percentage such as "10%"') from None


def parse_float_pair(text: str | list | tuple) -> tuple[float, float]:
    """``--face_crop_aug_range "2.0,4.0"``: exactly two floats."""
    parts = list(text) if isinstance(text, (list, tuple)) else str(text).split(",")
    try:
        values = tuple(float(p) for p in parts)
    except ValueError:
        raise UserError(f'"{text}": expected two numbers separated by a comma, e.g. 2.0,4.0') from None
    if len(values) != 2:
        raise UserError(f'"{text}": expected exactly two numbers separated by a comma, e.g. 2.0,4.0')
    return values  # type: ignore[return-value]


def parse_optional_int(text: str | int | None) -> int | None:
    """An integer flag whose value may also be written "None" (sd-scripts' ``--max_token_length`` choices)."""
    if text is None or (isinstance(text, str) and text.strip() in ("", "None", "none")):
        return None
    if isinstance(text, bool):
        raise UserError(f"{text!r}: expected an integer")
    if isinstance(text, float) and text.is_integer():
        return int(text)
    try:
        return int(text)
    except (TypeError, ValueError):
        raise UserError(f'"{text}": expected an integer') from None
