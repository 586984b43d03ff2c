"""Bounded parsing of JSON and TOML text that a user controls (state files, configs, caches, prompt files).

Python's parsers have no bounds of their own that end in a message: ``json.loads`` and ``tomllib.loads`` recurse
once per nested array or table (``RecursionError`` at about a thousand levels), and an integer of more digits than
``sys.get_int_max_str_digits()`` (4300 by default: CPython's guard against quadratic conversion, CVE-2020-10735)
is a bare ``ValueError`` without the file or the key. Here the text is scanned first, without recursion, so that
the parser is never handed a document nested deeper than ``MAX_DEPTH`` levels (TOML's dotted keys and table headers
count, ``tomllib`` being quadratic in their length) or holding an integer of more than ``MAX_INT_DIGITS`` digits;
the parsed tree is checked again without recursion. Each refusal is a ``UserError`` naming the file (``source``),
the key (with its line) and what to do (``fix``). The text's own syntax errors are left to the parser, so callers
keep their messages.

No file of this project nests more than about ten levels or needs an integer beyond 20 digits (a 64-bit seed), so
the limits refuse nothing a program wrote.
"""

from __future__ import annotations

import json
import re
import sys
import tomllib
from collections.abc import Callable
from typing import Any

from library.base.errors import UserError

MAX_DEPTH = 64
MAX_INT_DIGITS = 64
_PATH_SHOWN = 8  # key path components shown in a message; deeper ones are elided

_JSON_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{},:]|-?[0-9][0-9.eE+\-]*', re.S)
_JSON_INT = re.compile(r"-?[0-9]+")
_TOML_TOKEN = re.compile(
    r'#[^\n]*|"""(?:[^\\"]|\\[\s\S]|"(?!""))*"""|\'\'\'[\s\S]*?\'\'\'|"[^"\\\n]*(?:\\.[^"\\\n]*)*"|\'[^\'\n]*\''
    r"|[\[\]{},=\n]|[A-Za-z0-9_+\-.:]+")
_TOML_HEADER = re.compile(r'\[\[?((?:[^\]\n"\']|"[^"\n]*"|\'[^\'\n]*\')*)\]\]?')
_TOML_INT = re.compile(r"[+-]?(?:0x[0-9A-Fa-f_]+|0o[0-7_]+|0b[01_]+|[0-9][0-9_]*)")


class _Frame:
    """One open array or table of the scan: its kind ("array" / "table"), the key or index inside it and, for
    TOML, the tables its dotted key adds (``a.b.c = 1`` is two tables deeper than ``c = 1``)."""

    __slots__ = ("kind", "key", "extra")

    def __init__(self, kind: str, key: str | int | None) -> None:
        self.kind, self.key, self.extra = kind, key, 0


def _path(frames: list[_Frame]) -> str:
    parts = []
    for frame in frames[:_PATH_SHOWN]:
        if frame.key is None:
            break
        parts.append(f"[{frame.key}]" if frame.kind == "array" else f".{_clip(str(frame.key))}")
    text = "".join(parts).lstrip(".") or "(top level)"
    return text + ("..." if len(frames) > _PATH_SHOWN else "")


def _refuse(source: str, where: str, problem: str, fix: str) -> UserError:
    return UserError(f"{source}: {where}: {problem}; {fix}")


def _too_deep() -> str:
    return f"nested more than {MAX_DEPTH} levels deep (no file of this kind nests more than about ten)"


def _too_long(digits: int) -> str:
    return f"an integer of {digits} digits (at most {MAX_INT_DIGITS} are read)"


def _line(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def scan_json(text: str, source: str, fix: str) -> None:
    """Refuse JSON text nested deeper than ``MAX_DEPTH`` or holding an integer longer than ``MAX_INT_DIGITS``."""
    frames: list[_Frame] = []
    key = ""
    for match in _JSON_TOKEN.finditer(text):
        token = match.group()
        first = token[0]
        if first == '"':
            key = token
        elif first in "[{":
            frames.append(_Frame("array" if first == "[" else "table", 0 if first == "[" else None))
            if len(frames) > MAX_DEPTH:
                raise _refuse(source, f"key {_path(frames)} (line {_line(text, match.start())})", _too_deep(), fix)
        elif first in "]}":
            if frames:
                frames.pop()
        elif first == ",":
            if frames and frames[-1].kind == "array":
                frames[-1].key = int(frames[-1].key or 0) + 1
        elif first == ":":
            if frames:
                frames[-1].key = _json_key(key)
        elif _JSON_INT.fullmatch(token) and len(token.lstrip("-")) > MAX_INT_DIGITS:
            where = f"key {_path(frames)} (line {_line(text, match.start())})"
            raise _refuse(source, where, _too_long(len(token.lstrip("-"))), fix)


def _json_key(raw: str) -> str:
    try:
        return str(json.loads(raw))
    except ValueError:
        return raw.strip('"')


def scan_toml(text: str, source: str, fix: str) -> None:
    """The TOML form of ``scan_json``: arrays, inline tables, dotted keys and table headers all count as levels
    (``tomllib`` takes time quadratic in a dotted key's length, so those are bounded before it runs too)."""
    frames: list[_Frame] = [_Frame("table", None)]
    table, key_start, previous, pos = "", 0, "\n", 0

    def check(start: int, problem: str | None = None) -> None:
        if problem is not None or len(frames) + sum(f.extra for f in frames) > MAX_DEPTH:
            raise _refuse(source, _toml_where(text, start, table, frames), problem or _too_deep(), fix)

    while (match := _TOML_TOKEN.search(text, pos)) is not None:
        token, start, pos = match.group(), match.start(), match.end()
        first = token[0]
        if first == "#":
            continue
        if first == "[" and len(frames) == 1 and previous == "\n":
            header = _TOML_HEADER.match(text, start)
            if header is not None:
                table, pos, previous = header.group(1).strip(), header.end(), "]"
                frames[0].key, frames[0].extra = None, _components(table)
                check(start)
                continue
        if first in "[{":
            frames.append(_Frame("array" if first == "[" else "table", 0 if first == "[" else None))
            key_start = pos
            check(start)
        elif first in "]}":
            if len(frames) > 1:
                frames.pop()
        elif first == "\n":
            if len(frames) == 1:
                key_start = pos
        elif first == ",":
            key_start = pos
            if frames[-1].kind == "array":
                frames[-1].key = int(frames[-1].key or 0) + 1
        elif first == "=":
            frames[-1].key = text[key_start:start].strip()
            frames[-1].extra = (_components(table) if len(frames) == 1 else 0) + _components(frames[-1].key) - 1
            check(start)
        elif (previous == "=" or frames[-1].kind == "array") and _TOML_INT.fullmatch(token):
            digits = len(re.sub(r"^[+-]?(0[xob])?|_", "", token))
            if digits > MAX_INT_DIGITS:
                check(start, _too_long(digits))
        previous = first if first in "\n=" else token


def _components(key: str) -> int:
    """The parts of a dotted TOML key or table name (dots inside quotes do not count)."""
    return re.sub(r'"[^"\n]*"|\'[^\'\n]*\'', "q", key).count(".") + 1 if key else 0


def _toml_where(text: str, pos: int, table: str, frames: list[_Frame]) -> str:
    path = _path(frames)
    parts = [f"[{_clip(table)}]"] if table else []
    if path != "(top level)" or not table:
        parts.append(f"key {path}")
    return " ".join(parts) + f" (line {_line(text, pos)})"


def _clip(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def check_tree(value: Any, source: str, fix: str) -> None:
    """Refuse a parsed tree nested deeper than ``MAX_DEPTH`` or holding an integer longer than ``MAX_INT_DIGITS``,
    walked without recursion (TOML's ``a.b.c = 1`` and ``[a.b.c]`` nest without brackets)."""
    limit = 10**MAX_INT_DIGITS
    stack: list[tuple[Any, tuple[str, ...]]] = [(value, ())]
    while stack:
        node, path = stack.pop()
        if len(path) > MAX_DEPTH:
            raise _refuse(source, f"key {_shown(path)}", _too_deep(), fix)
        if isinstance(node, dict):
            stack.extend((child, (*path, f".{key}")) for key, child in node.items())
        elif isinstance(node, (list, tuple)):
            stack.extend((child, (*path, f"[{index}]")) for index, child in enumerate(node))
        elif isinstance(node, int) and not isinstance(node, bool) and abs(node) >= limit:
            raise _refuse(source, f"key {_shown(path)}", f"an integer of more than {MAX_INT_DIGITS} digits", fix)


def _shown(path: tuple[str, ...]) -> str:
    text = "".join(path[:_PATH_SHOWN]).lstrip(".") or "(top level)"
    return text + ("..." if len(path) > _PATH_SHOWN else "")


def _parsed(parse: Callable[[], Any], source: str, fix: str, syntax_errors: tuple[type[Exception], ...]) -> Any:
    """Run ``parse``; Python's own integer-digits limit and recursion limit become the bounded refusals (both are
    caught by the scans first; this is the net under them). The parser's syntax errors pass through."""
    try:
        value = parse()
    except syntax_errors:
        raise
    except RecursionError:
        raise _refuse(source, "(whole file)", _too_deep(), fix) from None
    except ValueError as exc:
        if "integer string conversion" not in str(exc):
            raise
        raise _refuse(source, "(whole file)", f"an integer longer than Python's limit of "
                      f"{sys.get_int_max_str_digits()} digits (at most {MAX_INT_DIGITS} are read)", fix) from None
    check_tree(value, source, fix)
    return value


def load_json(text: str, source: str, fix: str) -> Any:
    """``json.loads`` within the bounds; ``json.JSONDecodeError`` for text that is not JSON."""
    scan_json(text, source, fix)
    return _parsed(lambda: json.loads(text), source, fix, (json.JSONDecodeError,))


def load_toml(text: str, source: str, fix: str, parser: Callable[[str], Any] = tomllib.loads,
              syntax_errors: tuple[type[Exception], ...] = (tomllib.TOMLDecodeError,)) -> Any:
    """``parser(text)`` (``tomllib.loads``, or e.g. ``toml.loads`` with its error type) within the bounds."""
    scan_toml(text, source, fix)
    return _parsed(lambda: parser(text), source, fix, syntax_errors)
