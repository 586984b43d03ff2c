"""Fine-tuning metadata (``--in_json`` / ``metadata_file``): captions and tags per image, as sd-scripts'
``FineTuningDataset`` reads them.

JSON: ``{"<image key>": {"caption": "...", "tags": "a, b"}, ...}``; JSONL: one ``{"image_path", "caption",
"tags"}`` object per line. Relative keys are joined to ``image_dir``; a key without an image extension is looked up
with each extension (the form sd-scripts' ``merge_captions_to_metadata.py`` writes). The caption used is
``caption + separator + tags``; with wildcards the tags are appended to every caption line.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from library.base.bounded import load_json
from library.base.errors import UserError
from library.config.dataset import SubsetSpec
from library.data.images import IMAGE_EXTENSIONS

IN_JSON_SHAPE = 'a fine-tuning metadata file maps each image to {"caption": ..., "tags": ...}'


def _read(path: Path, errors: list[str], parse: Callable[[str], Any]) -> Any:
    """``parse`` of the file's text; a problem (unreadable, not UTF-8, not JSON, out of bounds) is appended to
    ``errors`` and None returned."""
    try:
        return parse(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        errors.append(f"{path}: not valid JSON: {e}")
    except UserError as e:  # nested too deep, or an integer too long
        errors.extend(e.messages)
    except OSError as e:
        errors.append(f"{path}: cannot be read: {e.strerror or e}")
    return None


def _jsonl(text: str, path: Path, errors: list[str]) -> dict[str, dict]:
    entries = {}
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            record = load_json(line, f"{path}:{number}", IN_JSON_SHAPE)
            if not isinstance(record, dict) or "image_path" not in record:
                errors.append(f"{path}:{number}: expected an object with image_path")
                continue
            entries[record["image_path"]] = record
    return entries


def load_metadata_json(path: Path, errors: list[str]) -> dict[str, dict]:
    """A metadata JSON file (not JSONL) as parsed, in its key order; {} with the problem appended to ``errors``
    when it cannot be read or is not an object of objects."""
    before = len(errors)
    loaded = _read(path, errors, lambda text: load_json(text, str(path), IN_JSON_SHAPE))
    if len(errors) > before:
        return {}
    if not isinstance(loaded, dict) or not all(isinstance(v, dict) for v in loaded.values()):
        errors.append(f'{path}: expected {{"image": {{"caption": "...", "tags": "..."}}, ...}}')
        return {}
    return loaded


def _load(path: Path, errors: list[str]) -> dict[str, dict]:
    if path.suffix.lower() == ".jsonl":
        return _read(path, errors, lambda text: _jsonl(text, path, errors)) or {}
    return load_metadata_json(path, errors)


def _image_path(key: str, image_dir: str | None) -> Path | None:
    path = Path(key)
    if not path.is_absolute():
        if image_dir is None:
            return None
        path = Path(image_dir) / key
    if path.suffix.lower() in IMAGE_EXTENSIONS or path.exists():
        return path
    for ext in IMAGE_EXTENSIONS:
        candidate = path.with_name(path.name + ext)
        if candidate.exists():
            return candidate
    return path


def combine_caption(caption: str, tags: str | None, sub: SubsetSpec) -> str:
    """sd-scripts' caption + tags join for fine-tuning entries."""
    if not tags:
        return caption
    if sub.enable_wildcard:
        tags = tags.replace("\n", sub.caption_separator)
        lines = [line for line in caption.split("\n") if line.strip()]
        return "\n".join(f"{line}{sub.caption_separator}{tags}" for line in lines)
    return caption + sub.caption_separator + tags if caption else tags


def read_metadata_subset(sub: SubsetSpec, errors: list[str]) -> list[tuple[str, str, str | None]]:
    """(image path, caption, tags) for each entry of a metadata file, in sd-scripts' order (``FineTuningDataset``
    registers the keys longest first, ties in the file's order: the order its latents are cached in, one random draw
    each, and its batches are drawn from); problems are appended to ``errors``."""
    path = Path(sub.metadata_file)
    out = []
    missing = []
    for key, entry in sorted(_load(path, errors).items(), key=lambda item: len(item[0]), reverse=True):
        image = _image_path(key, sub.image_dir)
        if image is None:
            errors.append(f'{sub.location}: "{key}" is a relative path; set image_dir (or --train_data_dir) to the '
                          "folder it is relative to")
            continue
        if not image.is_file():
            missing.append(str(image))
            continue
        caption = entry.get("caption") or ""
        tags = entry.get("tags")
        out.append((str(image), combine_caption(caption, tags, sub), tags))
    if missing:
        shown = ", ".join(missing[:5]) + (f" ... and {len(missing) - 5} more" if len(missing) > 5 else "")
        errors.append(f"{sub.location}: {len(missing)} image(s) listed in {path} do not exist: {shown}")
    return out
