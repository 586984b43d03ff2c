"""``finetune/merge_captions_to_metadata.py`` and ``merge_dd_tags_to_metadata.py`` against upstream's: the same
arguments, and byte for byte the files and ``--debug`` lines upstream's tools wrote for the same input
(``tests/data/upstream_finetune_metadata.py`` ran them); bad input ends in exit 2 with a message naming the path or
flag, where upstream raises a traceback, and writes nothing."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from finetune import merge_captions_to_metadata, merge_dd_tags_to_metadata
from tests.data.upstream_finetune_metadata import CAPTIONS, CASES, TAGS, build_inputs, parser_arguments

EXPECTED = Path(__file__).resolve().parents[2] / "data" / "upstream_finetune_metadata"
TOOLS = {CAPTIONS: merge_captions_to_metadata, TAGS: merge_dd_tags_to_metadata}


@pytest.fixture
def inputs(tmp_path, monkeypatch):
    build_inputs(tmp_path)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_files_and_debug_lines_are_upstreams(inputs, caplog):
    caplog.set_level(logging.INFO)
    upstream_debug = json.loads((EXPECTED / "debug.json").read_text(encoding="utf-8"))["debug"]
    wrong = []
    for case, (tool, args) in CASES.items():
        caplog.clear()
        assert TOOLS[tool].main(args) == 0, case
        if (inputs / args[1]).read_bytes() != (EXPECTED / f"{case}.json").read_bytes():
            wrong.append(f"{case}: file")
        lines = [r.getMessage() for r in caplog.records if r.name == TOOLS[tool].__name__]
        if lines != upstream_debug.get(case, []):
            wrong.append(f"{case}: debug lines {lines}")
    assert wrong == []


@pytest.mark.parametrize("tool", [CAPTIONS, TAGS])
def test_arguments_are_upstreams(tool):
    upstream = json.loads((EXPECTED / "parsers.json").read_text())[tool]
    assert parser_arguments(TOOLS[tool].setup_parser()) == upstream


def _refused(capsys, tool, args: list[str], *words: str) -> None:
    assert TOOLS[tool].main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for word in words:
        assert word in err, err


@pytest.mark.parametrize("tool", [CAPTIONS, TAGS])
def test_missing_folder(inputs, capsys, tool):
    _refused(capsys, tool, ["nowhere", "out/x.json"], "nowhere", "train_data_dir")
    assert not (inputs / "out" / "x.json").exists()


@pytest.mark.parametrize("tool", [CAPTIONS, TAGS])
def test_recursive_without_full_path(inputs, capsys, tool):
    _refused(capsys, tool, ["data", "out/x.json", "--recursive"], "--recursive", "--full_path")


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"a": "caption, not an object"}', "null"])
def test_unusable_in_json(inputs, capsys, text):
    (inputs / "bad.json").write_text(text)
    _refused(capsys, CAPTIONS, ["data", "out/x.json", "--in_json", "bad.json"], "--in_json", "bad.json")
    assert not (inputs / "out" / "x.json").exists()


def test_missing_in_json(inputs, capsys):
    _refused(capsys, TAGS, ["data", "out/x.json", "--in_json", "gone.json"], "--in_json", "gone.json")


def test_unusable_existing_out_json_is_named(inputs, capsys):
    (inputs / "out" / "x.json").write_bytes(b"\xff\xfe not text")
    _refused(capsys, TAGS, ["data", "out/x.json"], "out_json", "out/x.json")
    assert (inputs / "out" / "x.json").read_bytes() == b"\xff\xfe not text"


def test_every_missing_caption_is_named(inputs, capsys):
    (inputs / "data" / "00_red_circle.caption").unlink()
    (inputs / "data" / ".hidden.caption").unlink()
    _refused(capsys, CAPTIONS, ["data", "out/x.json"], "2 image(s)", "data/00_red_circle.caption",
             "data/.hidden.caption", "--caption_extension")
    assert not (inputs / "out" / "x.json").exists()


def test_caption_not_utf8(inputs, capsys):
    (inputs / "data" / "a-b.txt").write_bytes(b"caf\xe9\n")
    _refused(capsys, TAGS, ["data", "out/x.json"], "data/a-b.txt", "UTF-8")


@pytest.mark.parametrize(("flag", "tool"), [("--caption_extension", TAGS), ("--caption_extention", CAPTIONS)])
def test_extension_without_dot(inputs, capsys, flag, tool):
    _refused(capsys, tool, ["data", "out/x.json", flag, "txt"], flag, '"txt"')


def test_output_folder_missing(inputs, capsys):
    _refused(capsys, TAGS, ["data", "missing/x.json"], "out_json missing/x.json", "folder missing does not exist")


def test_output_that_cannot_be_written(inputs, capsys):
    (inputs / "out" / "taken").mkdir()
    _refused(capsys, CAPTIONS, ["data", "out/taken", "--in_json", "existing.json"], "out_json out/taken",
             "cannot be written")
