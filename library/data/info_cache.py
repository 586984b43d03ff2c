"""``--cache_info`` / ``cache_info = true``: a DreamBooth folder's captions and image sizes in ``metadata_cache.json``.

The file is sd-scripts' (``DreamBoothDataset.IMAGE_INFO_CACHE_FILE``), in the image folder, so both trainers share
it: a JSON object ``{"<image_dir>/<file>": {"caption": "...", "resolution": [width, height]}, ...}`` (UTF-8,
``ensure_ascii=False``, indent 2), one entry per image, the keys as sd-scripts joins them (the folder as given, then
the file name). ``caption`` is the caption used (the class tokens, or "", for an image without a caption file);
``resolution`` is the size stored in the image file, as sd-scripts reads it. An image whose EXIF orientation swaps
width and height gets ``"sdsb_exif_swaps_size": true`` too (sd-scripts ignores both EXIF and the extra key), so that
the upright size used here can be restored without opening the image.

When it is used, as in sd-scripts: the file is written after a folder has been scanned with ``cache_info`` on, and
from then on it is read instead of opening every image and caption file. Unlike sd-scripts, it is also checked
against the folder's listing: when an image was added, removed or renamed, the folder is moved, or the file is not
sd-scripts' shape, it is rebuilt with a warning (sd-scripts would train on the stale list). Edited captions and
images edited in place are not noticed, as in sd-scripts: delete the file after editing them. A folder that could
not be scanned cleanly (a broken image, an empty caption file) is not cached; a folder that cannot be written to
gets a warning and is scanned again next time.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from library.base.bounded import load_json
from library.base.errors import UserError
from library.base.files import write_bytes_atomic
from library.data.images import INFO_CACHE_FILE

logger = logging.getLogger(__name__)

FILE_NAME = INFO_CACHE_FILE
SWAPS_KEY = "sdsb_exif_swaps_size"
MAX_SIDE = 1 << 20  # pixels per side of a cached size; a larger one is an edit (the entry is rebuilt)


@dataclass(frozen=True)
class ImageInfo:
    """One image as cached: its caption, its stored size, and whether EXIF orientation swaps that size."""

    caption: str
    stored_size: tuple[int, int]
    swaps: bool = False

    @property
    def upright_size(self) -> tuple[int, int]:
        w, h = self.stored_size
        return (h, w) if self.swaps else (w, h)


def cache_file(image_dir: str | Path) -> Path:
    return Path(image_dir) / FILE_NAME


def key_for(image_dir: str | Path, image: Path) -> str:
    """sd-scripts' key: ``os.path.join`` of the folder as given and the file name (``glob_images``)."""
    return os.path.join(str(image_dir), image.name)


def _entry(value: object) -> ImageInfo | None:
    if not isinstance(value, dict) or not isinstance(value.get("caption"), str):
        return None
    size = value.get("resolution")
    if not (isinstance(size, list) and len(size) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and 0 < v <= MAX_SIDE for v in size)):
        return None
    return ImageInfo(value["caption"], (size[0], size[1]), value.get(SWAPS_KEY) is True)


def read(image_dir: str | Path, images: list[Path]) -> dict[Path, ImageInfo] | None:
    """The cached info of each of ``images`` (the folder's listing), or None when there is no usable cache file
    (with a warning saying why, unless there is simply none yet)."""
    file = cache_file(image_dir)
    if not file.is_file():
        logger.info("%s: no %s yet; it is written after this scan (cache_info)", image_dir, FILE_NAME)
        return None
    try:
        raw = load_json(file.read_text(encoding="utf-8"), str(file), "not used as a cache")
    except UserError as exc:  # nested too deeply or an integer too long (library/base/bounded.py)
        logger.warning("%s; scanning the folder again and rewriting it", exc)
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        logger.warning("%s: cannot be read (%s); scanning the folder again and rewriting it", file, exc)
        return None
    if not isinstance(raw, dict):
        logger.warning("%s: not an object of images; scanning the folder again and rewriting it", file)
        return None
    by_path = {os.path.abspath(key): value for key, value in raw.items()}
    listed = {os.path.abspath(key_for(image_dir, image)): image for image in images}
    if set(by_path) != set(listed):
        added, gone = len(set(listed) - set(by_path)), len(set(by_path) - set(listed))
        logger.warning("%s: lists other images than the folder holds (%d new, %d gone or elsewhere); scanning the "
                       "folder again and rewriting it", file, added, gone)
        return None
    infos = {}
    for path, image in listed.items():
        info = _entry(by_path[path])
        if info is None:
            logger.warning("%s: the entry of %s is not {\"caption\": ..., \"resolution\": [w, h]}; scanning the "
                           "folder again and rewriting it", file, image.name)
            return None
        infos[image] = info
    logger.info("%s: captions and sizes of %d images read from %s (cache_info)", image_dir, len(infos), FILE_NAME)
    return infos


def write(image_dir: str | Path, infos: dict[Path, ImageInfo]) -> None:
    """Write the folder's cache file atomically; a folder that cannot be written to gets a warning, not an error."""
    body = {}
    for image, info in infos.items():
        entry: dict[str, object] = {"caption": info.caption, "resolution": list(info.stored_size)}
        if info.swaps:
            entry[SWAPS_KEY] = True
        body[key_for(image_dir, image)] = entry
    file = cache_file(image_dir)
    text = json.dumps(body, ensure_ascii=False, indent=2).encode("utf-8")
    try:
        write_bytes_atomic(file, text)
    except OSError as exc:
        logger.warning("%s: cannot write %s (%s); the folder is scanned in full each run (cache_info)", image_dir,
                       FILE_NAME, exc.strerror or exc)
