#!/usr/bin/env python3
"""Generate upstream's vendored copy of the project's optimizer package: optimizers/ -> library/sr_optimizers/.

The copy in the patch series is never edited by hand: patches/make.sh writes it from this script's output, and
tests/patches/test_vendor_drift.py fails when the series' copy differs from what this script produces now.

The only changes are mechanical: absolute imports ``optimizers.x`` become ``library.sr_optimizers.x`` (statements,
module-path strings such as ``ClassFactory("optimizers.adamw", ...)`` and ````optimizers.x```` references in
docstrings), and a header line saying where the file came from. Anything else that still names the top-level
``optimizers`` package as code is an error, so a new import form cannot slip through unrewritten.

Usage:
    python patches/vendor.py OUT_DIR          write OUT_DIR/library/sr_optimizers/*.py
    python patches/vendor.py --list           print the generated paths
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "optimizers"
PACKAGE = "library.sr_optimizers"
TARGET = Path("library") / "sr_optimizers"
HEADER = "# Generated from sd-scripts-bf16 optimizers/{name} by patches/vendor.py: do not edit here, regenerate.\n"

_FROM = re.compile(r"^(\s*)from optimizers(\.\w+)* import ", re.MULTILINE)
_IMPORT = re.compile(r"^(\s*)import optimizers\b", re.MULTILINE)
_STRING = re.compile(r"""(["'])optimizers((?:\.\w+)*)\1""")
_DOC = re.compile(r"``optimizers(?=[.`])")
_LEFTOVER = re.compile(r"^\s*(from|import)\s+optimizers\b|[\"']optimizers[.\"']", re.MULTILINE)


class VendorError(RuntimeError):
    """The source uses a form of the package name that the rewrite does not handle."""


def rewrite(text: str, name: str) -> str:
    """One source file's vendored text."""
    if _IMPORT.search(text):
        raise VendorError(f"optimizers/{name}: 'import optimizers' is not rewritten; use 'from optimizers... import'")
    text = _FROM.sub(lambda m: f"{m.group(1)}from {PACKAGE}{m.group(2) or ''} import ", text)
    text = _STRING.sub(lambda m: f"{m.group(1)}{PACKAGE}{m.group(2)}{m.group(1)}", text)
    text = _DOC.sub(f"``{PACKAGE}", text)
    leftover = _LEFTOVER.search(text)
    if leftover:
        line = text.count("\n", 0, leftover.start()) + 1
        raise VendorError(f"optimizers/{name}:{line}: still refers to the top-level 'optimizers' package")
    return HEADER.format(name=name) + text


def generate(source: Path = SOURCE) -> dict[str, str]:
    """Relative path in upstream (posix) -> file text, for every module of the package."""
    files = sorted(path for path in source.glob("*.py") if path.is_file())
    if not any(path.name == "__init__.py" for path in files):
        raise VendorError(f"{source} has no __init__.py: not the optimizer package")
    return {(TARGET / path.name).as_posix(): rewrite(path.read_text(encoding="utf-8"), path.name) for path in files}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", type=Path, help="upstream work tree to write into")
    parser.add_argument("--list", action="store_true", help="print the generated paths and exit")
    args = parser.parse_args(argv)
    try:
        files = generate()
    except VendorError as error:
        print(f"vendor.py: {error}", file=sys.stderr)
        return 1
    if args.list:
        print("\n".join(files))
        return 0
    if args.out_dir is None:
        parser.error("give OUT_DIR (an upstream work tree) or --list")
    target = args.out_dir / TARGET
    if target.exists():
        for stale in target.glob("*.py"):
            stale.unlink()
    target.mkdir(parents=True, exist_ok=True)
    for rel, text in files.items():
        (args.out_dir / rel).write_text(text, encoding="utf-8")
    print(f"vendor.py: wrote {len(files)} files to {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
