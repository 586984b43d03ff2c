"""The metadata JSON files that sd-scripts' fine-tuning tools (``finetune/merge_captions_to_metadata.py``,
``merge_dd_tags_to_metadata.py``, ``prepare_buckets_latents.py``; 48d368fa) read and write, for ``--in_json``.

As upstream: images are listed by ``train_util.glob_images_pathlib`` (``list_metadata_images``); an image's key is
its file name without the extension, or with ``--full_path`` the path as the folder was given joined with the name
(``data/a.png``); an existing file is read and updated in place, its keys keeping their order and new images
appended in listing order; the file is written as ``json.dumps(metadata, indent=2)`` (ASCII, ``\\uXXXX`` escapes,
no newline at the end). Differences, on purpose: what upstream meets as a traceback (a missing caption or tag file,
``--recursive`` without ``--full_path``, a missing folder or JSON file, JSON that is not an object of objects, an
extension without its dot) is a ``UserError`` naming the file or flag, found before anything is written; the file
is replaced atomically, so a failed write leaves the old one as it was.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from library.base.errors import UserError
from library.base.files import write_bytes_atomic
from library.data.images import GLOB_EXTENSIONS
from library.data.in_json import load_metadata_json

log = logging.getLogger(__name__)
_SHOWN = 5  # missing text files named in the message; the rest are counted


def list_metadata_images(folder: Path, recursive: bool) -> list[Path]:
    """Upstream's ``glob_images_pathlib``: ``pathlib`` globs ``*<ext>`` of each extension in lower and upper case
    (``rglob`` with ``recursive``), so hidden files count and ``.Png`` does not; sorted as paths (by their parts:
    ``a/b.png`` before ``a-b.png``), without repeats."""
    search = folder.rglob if recursive else folder.glob
    return sorted({path for ext in GLOB_EXTENSIONS for path in search("*" + ext)})


def check_paths(folder: Path, out_json: Path, full_path: bool, recursive: bool) -> None:
    """Refuse ``--recursive`` without ``--full_path`` (upstream asserts it), a ``train_data_dir`` that is no folder
    (upstream finds no image in it) and an ``out_json`` in a folder that does not exist (upstream fails at the end)."""
    if recursive and not full_path:
        raise UserError("--recursive needs --full_path: images of different folders may have the same file name, "
                        "so their keys must be their paths")
    if not folder.is_dir():
        raise UserError(f"train_data_dir {folder}: no such folder")
    if not out_json.parent.is_dir():
        raise UserError(f"out_json {out_json}: the folder {out_json.parent} does not exist; create it or write the "
                        "file elsewhere")


def image_key(image: Path, full_path: bool) -> str:
    return str(image) if full_path else image.stem


def read_existing(in_json: Path, flag: str) -> dict[str, dict]:
    """The metadata of ``in_json`` (given by ``flag``), as a dict in the file's key order."""
    if not in_json.is_file():
        raise UserError(f"{flag} {in_json}: no such file")
    errors: list[str] = []
    metadata = load_metadata_json(in_json, errors)
    if errors:
        raise UserError(*(f"{flag}: {message}" for message in errors))
    return metadata


def write_metadata(out_json: Path, metadata: dict) -> None:
    """Write ``metadata`` as upstream does (``json.dumps(metadata, indent=2)``, UTF-8)."""
    try:
        write_bytes_atomic(out_json, json.dumps(metadata, indent=2).encode("utf-8"))
    except OSError as exc:
        raise UserError(f"out_json {out_json}: cannot be written: {exc.strerror or exc}") from None
    log.info("wrote %s: %d images", out_json, len(metadata))


def text_beside(image: Path, extension: str, flag: str) -> Path:
    """The caption or tag file of ``image``: its extension replaced by ``extension`` (``Path.with_suffix``)."""
    try:
        return image.with_suffix(extension)
    except ValueError:
        raise UserError(f'{flag} "{extension}": not a file extension; give it with its dot, e.g. ".txt"') from None


def read_texts(images: list[Path], extension: str, flag: str) -> list[str]:
    """The stripped text of each image's ``extension`` file; all missing or unreadable files in one error."""
    texts, missing, bad = [], [], []
    for image in images:
        path = text_beside(image, extension, flag)
        try:
            texts.append(path.read_text(encoding="utf-8").strip())
        except FileNotFoundError:
            missing.append(str(path))
        except (OSError, UnicodeDecodeError) as exc:
            reason = "not UTF-8 text" if isinstance(exc, UnicodeDecodeError) else exc.strerror or str(exc)
            bad.append(f"{path}: cannot be read ({reason})")
    if missing:
        shown = ", ".join(missing[:_SHOWN]) + (f" ... and {len(missing) - _SHOWN} more" if len(missing) > _SHOWN
                                               else "")
        bad.insert(0, f"{len(missing)} image(s) have no {extension} file ({flag}): {shown}; write them, or move the "
                      "images without one out of the folder")
    if bad:
        raise UserError(*bad)
    return texts


def merge_texts(folder: Path, out_json: Path, in_json: Path | None, extension: str, field: str, *, flag: str,
                full_path: bool, recursive: bool, echo: Callable[[str], None] | None = None) -> None:
    """Upstream's merge tools: set ``field`` ("caption", "tags") of each image's entry to its ``extension`` file's
    text, in ``in_json``'s metadata (``out_json``'s when it exists and no ``in_json`` is given), and write
    ``out_json``. ``echo`` receives upstream's ``--debug`` line per image: ``"<key> <text>"``."""
    check_paths(folder, out_json, full_path, recursive)
    images = list_metadata_images(folder, recursive)
    log.info("found %d images in %s", len(images), folder)
    source = "--in_json" if in_json is not None else "out_json"
    if in_json is None and out_json.is_file():
        in_json = out_json
    metadata = read_existing(in_json, source) if in_json is not None else {}
    for image, text in zip(images, read_texts(images, extension, flag), strict=True):
        key = image_key(image, full_path)
        metadata.setdefault(key, {})[field] = text
        if echo is not None:
            echo(f"{key} {text}")
    write_metadata(out_json, metadata)


def merge_command(args: Any, field: str, extension: str, flag: str, echo: Callable[[str], None]) -> int:
    """The body of both merge tools (``finetune/merge_captions_to_metadata.py``, ``merge_dd_tags_to_metadata.py``)
    on their parsed ``args``: ``merge_texts`` of ``field`` from ``extension`` files (``flag`` names the option that
    gave it), with ``--debug``'s lines to ``echo``; 0 when written, else each problem printed as ``error: ...`` and
    exit code 2 (nothing written)."""
    in_json = Path(args.in_json) if args.in_json is not None else None
    try:
        merge_texts(Path(args.train_data_dir), Path(args.out_json), in_json, extension, field, flag=flag,
                    full_path=args.full_path, recursive=args.recursive, echo=echo if args.debug else None)
    except UserError as exc:
        for message in exc.messages:
            print(f"error: {message}", file=sys.stderr)
        return exc.exit_code
    return 0
