"""``library/base/bounded.py``: JSON and TOML text is scanned for depth and integer length before it is parsed, so a
hostile file is one message naming the file and the key, never a ``RecursionError``, a bare ``ValueError`` or a
parse that takes minutes (``tomllib`` is quadratic in a dotted key's length)."""

from __future__ import annotations

import json
import time
import tomllib

import pytest
import toml

from library.base.bounded import MAX_DEPTH, MAX_INT_DIGITS, check_tree, load_json, load_toml
from library.base.errors import UserError


def _refused(load, text: str, *needles: str, **kwargs) -> str:
    with pytest.raises(UserError) as info:
        load(text, "f.x", "edit it", **kwargs)
    message = str(info.value)
    assert message.startswith("f.x: ") and message.endswith("; edit it")
    for needle in needles:
        assert needle in message, message
    return message


def test_the_limits_admit_every_file_the_trainer_writes():
    nested = {"a": [{"b": [[{"c": 2**64 - 1}]]}]}
    for _ in range(MAX_DEPTH - 7):
        nested = {"n": nested}
    assert load_json(json.dumps(nested), "f", "fix") == nested
    assert load_toml('x = 1_000\n[t."a.b"]\nk = [[1, 2], {c = 0xff}]\nd = 1979-05-27\n', "f", "fix") == {
        "x": 1000, "t": {"a.b": {"k": [[1, 2], {"c": 255}], "d": tomllib.loads("d = 1979-05-27")["d"]}}}
    assert load_json(json.dumps({"s": "[" * 1000 + "9" * 1000}), "f", "fix")["s"].startswith("[[")


@pytest.mark.parametrize("text,where", [
    ('{"a": {"b": [1, ' + "[" * 100_000 + "]" * 100_000 + "]}}", "key a.b[1][0][0][0][0][0]..."),
    ("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1), "key [0][0]"),
])
def test_json_nesting_is_refused_before_parsing(text, where):
    _refused(load_json, text, where, f"nested more than {MAX_DEPTH} levels")


def test_json_integers_are_bounded_and_named_with_their_line():
    _refused(load_json, '{\n "a": [1,\n  {"b\\"c": ' + "9" * 5000 + "}]}", 'key a[1].b"c (line 3)',
             "an integer of 5000 digits")
    _refused(load_json, '{"x": -' + "1" * (MAX_INT_DIGITS + 1) + "}", "key x", f"{MAX_INT_DIGITS + 1} digits")
    assert load_json('{"x": 1e999999, "y": 0.' + "1" * 5000 + "}", "f", "fix")["x"] == float("inf")


def test_syntax_errors_are_left_to_the_parser():
    with pytest.raises(json.JSONDecodeError):
        load_json('{"a": ', "f", "fix")
    with pytest.raises(tomllib.TOMLDecodeError):
        load_toml("x = [1\n", "f", "fix")


@pytest.mark.parametrize("text,where", [
    ("x = 1\n[t.u]\nk = [1, [2, " + "[" * 100_000 + "]]\n", "[t.u] key k[1][1][0][0][0][0][0]... (line 3)"),
    ("k = {a = 1, b = " + "{c = " * 100 + "}\n", "key k.b.c.c.c.c.c.c..."),
    ("x = 1\n" + ".".join(["a"] * 100_000) + " = 1\n", "key a.a.a.a.a."),
    ("[" + ".".join(["a"] * 100_000) + "]\n", "[a.a.a.a."),
    ("[[" + ".".join(['"q.q"'] * 70) + "]]\nx = 1\n", '["q.q"."q.q".'),
])
def test_toml_nesting_counts_brackets_dotted_keys_and_headers(text, where):
    started = time.perf_counter()
    _refused(load_toml, text, where, f"nested more than {MAX_DEPTH} levels")
    assert time.perf_counter() - started < 30  # tomllib alone needs minutes for the 100,000-part key


def test_toml_integers_are_bounded_in_values_only():
    _refused(load_toml, "[general]\nbatch_size = " + "9" * 5000 + "\n", "[general] key batch_size (line 2)",
             "an integer of 5000 digits")
    _refused(load_toml, "v = 0x" + "f" * (MAX_INT_DIGITS + 1), "key v", "digits")
    _refused(load_toml, "v = [1, 2, " + "1_0" * 40 + "]", "key v[2]", "80 digits")
    text = 's = "' + "9" * 5000 + '"\n# ' + "9" * 5000 + "\nm = '''\n" + "[" * 500 + "\n'''\n"
    assert load_toml(text, "f", "fix")["s"] == "9" * 5000


def test_another_toml_parser_with_its_own_errors():
    _refused(load_toml, "x = " + "9" * 5000 + "\n", "key x", parser=toml.loads, syntax_errors=(toml.TomlDecodeError,))
    with pytest.raises(toml.TomlDecodeError):
        load_toml("x = = 1\n", "f", "fix", toml.loads, (toml.TomlDecodeError,))


def test_the_parsed_tree_is_checked_without_recursion():
    deep: dict = {}
    node = deep
    for _ in range(100_000):
        node["k"] = {}
        node = node["k"]
    with pytest.raises(UserError, match=r"key k\.k\.k\.k.*nested more than"):
        check_tree(deep, "f", "fix")
    with pytest.raises(UserError, match=r"key a\[0\]: an integer of more than"):
        check_tree({"a": [10**MAX_INT_DIGITS]}, "f", "fix")
