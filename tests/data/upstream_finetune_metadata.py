"""Generator of ``upstream_finetune_metadata/``: what upstream sd-scripts' (48d368fa) metadata tools
``finetune/merge_captions_to_metadata.py`` and ``finetune/merge_dd_tags_to_metadata.py`` write for a fixed input
(``build_inputs``: images of ``configs/sample_data`` under other names, captions and made-up tags, a non-ASCII and a
multi-line caption, a hidden image, a ``.Png`` that is no image to upstream, a sub-folder and a pre-existing JSON),
run case after case (``CASES``; a case may read what an earlier one wrote) in one temporary folder with relative
paths, so the keys of ``--full_path`` do not name this machine. Run with upstream's Python, not ours; upstream's
scripts are run, nothing copied.

    PYTHONPATH="$PEER_DIR/shim" "$PEER_DIR/venv/bin/python" \\
        <this repository>/tests/data/upstream_finetune_metadata.py [--upstream_dir DIR] [--out DIR]

``--upstream_dir`` defaults to ``$PEER_DIR/sd-scripts``, ``--out`` to ``upstream_finetune_metadata/`` beside this
script. It writes ``<case>.json`` (the output file's bytes as upstream wrote them), ``debug.json`` (per case, the
messages ``--debug`` logs, one per image) and ``parsers.json`` (each tool's arguments: flags, defaults, actions).
A few seconds of CPU. The tests (``tests/unit/finetune/``) build the same input with ``build_inputs`` and run ours.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

UPSTREAM_COMMIT = "48d368fa"
REPO = Path(__file__).resolve().parents[2]
SAMPLES = REPO / "configs" / "sample_data" / "10_shapes"
CAPTIONS = "merge_captions_to_metadata"
TAGS = "merge_dd_tags_to_metadata"

# image path under the input folder -> sample image copied there
IMAGES = {
    "data/00_red_circle.png": "00_red_circle.png",
    "data/01_blue_square.png": "01_blue_square.png",
    "data/02_green_triangle.PNG": "02_green_triangle.png",
    "data/.hidden.png": "03_yellow_circle.png",
    "data/a-b.png": "04_purple_square.png",
    "data/07.red.square.png": "07_red_square.png",
    "data/06_blue_circle.Png": "06_blue_circle.png",
    "data/a/05_orange_triangle.png": "05_orange_triangle.png",
}
# text file under the input folder -> its content (captions and tags, with the whitespace upstream strips)
TEXTS = {
    "data/00_red_circle.caption": "  a red circle\non white  \n",
    "data/00_red_circle.txt": "red, circle\n",
    "data/01_blue_square.caption": 'ein blaues Quadrat, 青い四角 — “quoted” "q" \\ back\n',
    "data/01_blue_square.txt": "blue, square, ü",
    "data/02_green_triangle.caption": "a green triangle",
    "data/02_green_triangle.txt": "green, triangle\r\n",
    "data/.hidden.caption": "a hidden yellow circle\n",
    "data/.hidden.txt": "yellow, hidden\n",
    "data/a-b.caption": "a purple square\t\n",
    "data/a-b.txt": "purple\n",
    "data/07.red.square.caption": "a red square, dotted name\n",
    "data/07.red.square.txt": "red, square\n",
    "data/notes.txt": "not a caption of any image\n",
    "data/a/05_orange_triangle.caption": "an orange triangle in a sub-folder\n",
    "data/a/05_orange_triangle.txt": "orange, triangle\n",
    "existing.json": json.dumps({
        "zz_kept": {"caption": "stays", "tags": "x"},
        "01_blue_square": {"tags": "old tags", "caption": "old", "train_resolution": [512, 512]},
        "émoji": {"caption": "Ünïcode ✓", "n": 1.5, "big": 12345678901234567890, "none": None,
                  "nested": {"list": [1, 2]}},
    }, ensure_ascii=False, indent=4) + "\n",
}
# case -> (tool, arguments), run in this order in the input folder
CASES = {
    "captions_new": (CAPTIONS, ["data", "out/captions_new.json", "--debug"]),
    "captions_into_existing": (CAPTIONS, ["data", "out/merged.json", "--in_json", "existing.json"]),
    "tags_into_out_json": (TAGS, ["data", "out/merged.json", "--debug"]),
    "captions_full_recursive": (CAPTIONS, ["data", "out/full.json", "--full_path", "--recursive"]),
    "captions_extention": (CAPTIONS, ["data", "out/spelled.json", "--caption_extention", ".txt",
                                      "--caption_extension", ".nothing"]),
    "tags_full_caption_extension": (TAGS, ["./data/", "out/tags_full.json", "--full_path", "--caption_extension",
                                           ".caption", "--debug"]),
    "tags_recursive": (TAGS, ["data", "out/tags_recursive.json", "--recursive", "--full_path"]),
}
# Runs a tool as ``python <script> ...`` does, with each log record written as one JSON line [logger, message].
_WRAPPER = """
import json, logging, runpy, sys
class Lines(logging.Formatter):
    def format(self, record):
        return json.dumps([record.name, record.getMessage()])
handler = logging.StreamHandler(sys.stdout)
handler.setFormatter(Lines())
logging.basicConfig(level=logging.INFO, handlers=[handler])
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def build_inputs(root: Path) -> None:
    """Write the input folder (``IMAGES``, ``TEXTS``) under ``root``, with an empty ``out/`` for the outputs."""
    for rel, sample in IMAGES.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(SAMPLES / sample, root / rel)
    for rel, text in TEXTS.items():
        (root / rel).write_bytes(text.encode("utf-8"))
    (root / "out").mkdir()


def debug_messages(stdout: str) -> list[str]:
    """The messages ``--debug`` adds: those the tool logs between its "merge ..." and "writing metadata" lines."""
    messages = [message for name, message in map(json.loads, stdout.splitlines()) if name == "__main__"]
    start = next(i for i, m in enumerate(messages) if m.startswith("merge "))
    end = next(i for i, m in enumerate(messages) if m.startswith("writing metadata"))
    return messages[start + 1:end]


def parser_arguments(parser: argparse.ArgumentParser) -> list[dict]:
    """Each argument of ``parser``: its flags (or positional name), dest, default, action, type and choices (what the
    tests compare between upstream's tools and ours)."""
    return [{"flags": action.option_strings or [action.dest], "dest": action.dest, "default": action.default,
             "action": type(action).__name__, "type": getattr(action.type, "__name__", None),
             "choices": action.choices} for action in parser._actions]


def parser_record(upstream: Path, tool: str) -> list[dict]:
    """``parser_arguments`` of the upstream tool's ``setup_parser()`` (importing it runs nothing)."""
    sys.path.insert(0, str(upstream))
    sys.path.insert(0, str(upstream / "finetune"))
    return parser_arguments(__import__(tool).setup_parser())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    peer = os.environ.get("PEER_DIR")
    parser.add_argument("--upstream_dir", default=str(Path(peer) / "sd-scripts") if peer else None,
                        required=not peer)
    parser.add_argument("--out", default=str(Path(__file__).with_suffix("")))
    options = parser.parse_args()
    upstream, out = Path(options.upstream_dir).resolve(), Path(options.out)
    out.mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(upstream)]))}
    debug = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        build_inputs(root)
        for case, (tool, args) in CASES.items():
            script = str(upstream / "finetune" / f"{tool}.py")
            done = subprocess.run([sys.executable, "-c", _WRAPPER, script, *args], cwd=root, env=env,
                                  capture_output=True, text=True, check=True)
            (out / f"{case}.json").write_bytes((root / args[1]).read_bytes())
            if "--debug" in args:
                debug[case] = debug_messages(done.stdout)
    record = {"upstream_commit": UPSTREAM_COMMIT, "generator": Path(__file__).name, "debug": debug}
    (out / "debug.json").write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    parsers = {tool: parser_record(upstream, tool) for tool in (CAPTIONS, TAGS)}
    (out / "parsers.json").write_text(json.dumps(parsers, indent=1) + "\n")
    print(f"wrote {out}: {len(CASES)} cases")


if __name__ == "__main__":
    main()
