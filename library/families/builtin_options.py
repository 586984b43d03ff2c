"""The options of a built-in model's name: ``builtin:<model>[:key=value,...]`` (``builtin:flux-random:double=2``,
``builtin:anima-random:blocks=4``), read alike by every family's built-ins."""

from __future__ import annotations

from library.base.errors import UserError


def builtin_options(name: str, base: str, allowed: tuple[str, ...]) -> dict[str, str]:
    """The ``key=value`` options after ``base:`` in ``name`` (none for ``base`` itself); a ``UserError`` naming the
    allowed keys for anything else."""
    options = {}
    for item in filter(None, name[len(base) + 1:].split(",")):
        key, sep, value = item.partition("=")
        if not sep or key not in allowed:
            raise UserError(f"{name}: unknown option {item!r}; options: {', '.join(allowed)} (key=value)")
        options[key] = value
    return options


def whole_number(options: dict[str, str], key: str, default: int | None, name: str) -> int | None:
    """Option ``key`` as a whole number of at least 1 (``default`` when it is not given)."""
    if key not in options:
        return default
    value = options[key]
    if not value.isdigit() or int(value) < 1:
        raise UserError(f"{name}: {key}={value!r} must be a whole number of at least 1")
    return int(value)
