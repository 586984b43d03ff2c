"""Image and caption discovery, image sizes and decoding.

Differences from sd-scripts, on purpose:
* the EXIF orientation tag is applied (sd-scripts ignores it, so phone photos train sideways); sizes, buckets and
  cache file names use the upright size;
* the "face-detect" caption stem (drop the last four ``_`` tokens when there are at least five) is taken from the
  file name only; sd-scripts splits the whole path, so underscores in folder names count;
* the pixel limit is ``--max_image_pixels`` (default PIL's own), checked from the file's header when the dataset is
  scanned, so an image over it is named with the flag before anything is decoded (PIL raises its
  ``DecompressionBombError`` as a traceback in sd-scripts); images are then opened with PIL's check lifted, since
  the scan has applied the limit the user chose.

Images are found as sd-scripts finds them (``list_images``), so the same files train and are held out.
"""

from __future__ import annotations

import errno
import glob
import logging
import os
import stat
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from PIL import Image, ImageOps, UnidentifiedImageError

from library.base.errors import UserError
from library.config.data import PIL_PIXEL_LIMIT

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
# sd-scripts' train_util.IMAGE_EXTENSIONS (48d368fa) without its plug-in formats: each extension in lower and in
# upper case, nothing else (".Png" is not an image to it)
GLOB_EXTENSIONS = IMAGE_EXTENSIONS + tuple(ext.upper() for ext in IMAGE_EXTENSIONS)
INFO_CACHE_FILE = "metadata_cache.json"  # library/data/info_cache.py

log = logging.getLogger(__name__)

# EXIF orientations 5..8 rotate by 90 degrees, so width and height swap.
_SWAPPING_ORIENTATIONS = (5, 6, 7, 8)


class BrokenImage(Exception):
    """An image file that cannot be decoded; the message names the file and the decoder's reason."""


class ImageTooLarge(BrokenImage):
    """An image with more pixels than ``--max_image_pixels``; the message names the file, its size and the flag."""


class CaptionProblem(Exception):
    """A caption file that cannot be used (empty, not UTF-8)."""


def list_images(folder: str | Path, warn: bool = True) -> list[Path]:
    """Image files directly inside ``folder``, as sd-scripts' ``glob_images(folder, "*")`` (48d368fa) lists them.

    It globs ``*<ext>`` for each of ``GLOB_EXTENSIONS``, so an extension counts in lower or upper case only
    (``a.PNG``, not ``a.Png``; glob follows the file system's case rule, so on Windows any case) and names starting
    with ``.`` are skipped (glob's ``*`` does not match them: macOS' ``._a.png`` AppleDouble files, hidden files);
    the paths, without repeats, are sorted as strings. Difference, on purpose: what is not a file (a folder named
    ``x.png``, a named pipe, a dangling or looping link) is left out instead of failing or hanging when it is opened,
    with a warning naming it (``warn``: False for a second listing of the same folder).
    """
    pattern = os.path.join(glob.escape(str(folder)), "*")
    names = {os.path.basename(p) for ext in GLOB_EXTENSIONS for p in glob.glob(pattern + ext)}
    paths = [Path(folder) / name for name in sorted(names)]
    files = [path for path in paths if path.is_file()]
    if warn:
        for path in sorted(set(paths) - set(files)):
            log.warning("%s: %s, not an image file; left out of the dataset", path, _not_a_file(path))
    return files


def _not_a_file(path: Path) -> str:
    """What a listed name that is no regular file is, for the warning that leaves it out."""
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "a symbolic link that loops"
        return "a dangling symbolic link" if path.is_symlink() else f"unreadable ({exc.strerror or exc})"
    kinds = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))
    return next((what for test, what in kinds if test(mode)), "not a regular file")


def caption_candidates(image_path: Path, extension: str) -> list[Path]:
    """Caption files tried for an image: ``<stem><ext>``, then the face-detect stem ``a_b_cx_cy_w_h`` → ``a_b``."""
    stem = image_path.stem
    candidates = [image_path.with_name(stem + extension)]
    tokens = stem.split("_")
    if len(tokens) >= 5:
        candidates.append(image_path.with_name("_".join(tokens[:-4]) + extension))
    return candidates


def read_caption(image_path: Path, extension: str, enable_wildcard: bool) -> str | None:
    """The caption of an image, or None when it has no caption file (sd-scripts' ``read_caption``).

    Without wildcards the first line is used; with them all non-empty lines are kept, joined by newlines, so that
    one line is picked per step. An empty file or a file that is not UTF-8 raises ``CaptionProblem``.
    """
    for path in caption_candidates(image_path, extension):
        if not path.is_file():
            continue
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError:
            raise CaptionProblem(f"{path}: caption file is not UTF-8 text; re-save it as UTF-8") from None
        if not lines:
            raise CaptionProblem(f"{path}: caption file is empty; write a caption or delete the file")
        if enable_wildcard:
            return "\n".join(line.strip() for line in lines if line.strip())
        return lines[0].strip()
    return None


def image_size(path: Path, max_pixels: int = PIL_PIXEL_LIMIT) -> tuple[int, int]:
    """Upright (EXIF-oriented) width and height; decodes the file enough to catch corrupt data (``stored_size``)."""
    (width, height), swaps = stored_size(path, max_pixels)
    return (height, width) if swaps else (width, height)


_PIL_CHECK = threading.Lock()


@contextmanager
def _pil_check_lifted() -> Iterator[None]:
    """PIL's decompression-bomb check off while an image is opened (``Image.open`` reads only the header); the
    caller applies ``--max_image_pixels`` instead. A lock keeps threads from restoring each other's setting."""
    with _PIL_CHECK:
        saved = Image.MAX_IMAGE_PIXELS
        Image.MAX_IMAGE_PIXELS = None
        try:
            yield
        finally:
            Image.MAX_IMAGE_PIXELS = saved


def _open(path: str | Path) -> Image.Image:
    with _pil_check_lifted():
        return Image.open(path)


def check_pixels(path: str | Path, size: tuple[int, int], max_pixels: int) -> None:
    """``ImageTooLarge`` when an image of ``size`` (W, H) has more than ``max_pixels`` pixels."""
    width, height = size
    if width * height > max_pixels:
        raise ImageTooLarge(f"{path}: {width}x{height} = {width * height} pixels, more than --max_image_pixels "
                            f"{max_pixels}; shrink the image, or raise --max_image_pixels if it is meant to be "
                            "this large")


def stored_size(path: Path, max_pixels: int = PIL_PIXEL_LIMIT) -> tuple[tuple[int, int], bool]:
    """The width and height stored in the file (what sd-scripts reads) and whether the EXIF orientation swaps them.

    The size is read from the header and checked against ``max_pixels`` (``ImageTooLarge``) before anything is
    decoded; then PNG chunks are checksummed with ``verify``, JPEG is decoded at 1/8 scale (``draft``), other formats
    fully.
    """
    try:
        with _open(path) as img:
            check_pixels(path, img.size, max_pixels)
            is_png = img.format == "PNG"
            if is_png:
                img.verify()
        with _open(path) as img:
            width, height = img.size
            orientation = img.getexif().get(0x0112, 1)
            if not is_png:
                if img.format == "JPEG":
                    img.draft("RGB", (max(1, width // 8), max(1, height // 8)))
                img.load()
    except (OSError, UnidentifiedImageError, SyntaxError, ValueError) as e:
        raise BrokenImage(f"{path}: cannot decode image ({e})") from None
    return (width, height), orientation in _SWAPPING_ORIENTATIONS


def check_scanned_size(path: str | Path, img: Image.Image, size: tuple[int, int]) -> None:
    """A loaded image must still have the (upright W, H) size the dataset scan recorded; else a UserError naming
    it (it was edited since, or the folder's metadata_cache.json is stale)."""
    if img.size != tuple(size):
        raise UserError(f"{path}: the image is {img.size[0]}x{img.size[1]} but the dataset scan recorded "
                        f"{size[0]}x{size[1]}: it was changed since, or the folder's {INFO_CACHE_FILE} (cache_info) "
                        "is stale; delete that file, or restart the run")


def _open_upright(path: str | Path, mode: str) -> Image.Image:
    try:
        with _open(path) as img:
            return ImageOps.exif_transpose(img).convert(mode)
    except (OSError, UnidentifiedImageError, SyntaxError, ValueError) as e:
        raise BrokenImage(f"{path}: cannot decode image ({e})") from None


def load_image(path: str | Path) -> Image.Image:
    """The image as upright RGB (an alpha channel is dropped, as PIL converts RGBA to RGB)."""
    return _open_upright(path, "RGB")


def load_image_with_alpha(path: str | Path) -> tuple[Image.Image, Image.Image]:
    """The upright image as RGB and its alpha channel ("L"), as sd-scripts' ``load_image(path, alpha=True)``:
    the file is converted to RGBA, so palette and grey+alpha transparency count and an image without alpha gets
    an opaque (255) channel."""
    rgba = _open_upright(path, "RGBA")
    return rgba.convert("RGB"), rgba.getchannel("A")


def load_mask_image(path: str | Path) -> Image.Image:
    """A mask image as upright "L": the R channel of its RGB conversion, the channel sd-scripts'
    ``apply_masked_loss`` reads from a conditioning image (white trains, black is ignored)."""
    return _open_upright(path, "RGB").getchannel("R")
