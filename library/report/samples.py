"""The sample images of a run as a grid: one row per prompt, one column per checkpoint in the order they were made.

Files are sd-scripts' (``<output_name>_<e000001 | 000120>_<NN>_<YYYYmmddHHMMSS>[_<seed>].png``; a rerun into the same
folder: the newest file per checkpoint and prompt wins). At most ``max_columns`` checkpoints (evenly spaced, first and
last kept) and ``max_rows`` prompts are drawn; the prompts left out are named in the grid's title. Each row is
labelled with its prompt (shortened; from ``--prompts``, the run's ``--sample_prompts`` file), sampler, seed (from the
file name, else the file's ``--d``, else "random seed") and the image size in pixels. Images keep their aspect
ratio in square cells; an image of one colour (a NaN sample decodes to black) is marked.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from PIL import Image

    from library.sampling.prompts import SamplePrompt

SAMPLE_NAME = re.compile(r"^(?:(?P<name>.+)_)?(?P<when>e?\d{6})_(?P<prompt>\d{2,})_(?P<stamp>\d{14})"
                         r"(?:_(?P<seed>\d+))?\.png$")
THUMB = 128
PROMPT_CHARS = 40


@dataclass
class SampleGrid:
    """Sample images by (prompt row, checkpoint column); ``columns`` are labels in the order they were made, ``rows``
    the prompt indices drawn, ``omitted`` those left out, ``seeds`` each row's seed from its newest file name."""

    columns: list[str]
    rows: list[int]
    images: dict[tuple[int, int], Path]
    omitted: list[int] = field(default_factory=list)
    seeds: dict[int, int] = field(default_factory=dict)


def collect_samples(folder: Path, max_columns: int = 8, max_rows: int = 16) -> SampleGrid | None:
    """The sample images of ``folder`` as a grid, or None when it has none."""
    found: dict[str, dict[int, tuple[str, Path, str | None]]] = {}
    made: dict[str, str] = {}
    for path in sorted(folder.glob("*.png")) if folder.is_dir() else []:
        match = SAMPLE_NAME.match(path.name)
        if match is None:
            continue
        when, prompt, stamp = match["when"], int(match["prompt"]), match["stamp"]
        kept = found.setdefault(when, {})
        if prompt not in kept or stamp > kept[prompt][0]:  # a rerun into the same folder: the newest wins
            kept[prompt] = (stamp, path, match["seed"])
        made[when] = min(made.get(when, stamp), stamp)
    if not found:
        return None
    order = sorted(found, key=lambda w: (made[w], w))
    if len(order) > max_columns:
        picks = sorted({round(i * (len(order) - 1) / (max_columns - 1)) for i in range(max_columns)})
        order = [order[i] for i in picks]
    every = sorted({p for w in order for p in found[w]})
    rows, omitted = every[:max_rows], every[max_rows:]
    images = {(r, c): found[w][p][1] for c, w in enumerate(order) for r, p in enumerate(rows) if p in found[w]}
    seeds = {}
    for p in rows:
        newest = max((found[w][p] for w in order if p in found[w]), key=lambda kept: kept[0])
        if newest[2] is not None:
            seeds[p] = int(newest[2])
    return SampleGrid([_label(w) for w in order], rows, images, omitted, seeds)


def _label(when: str) -> str:
    number = int(when.lstrip("e"))
    if number == 0:
        return "start"
    return f"epoch {number}" if when.startswith("e") else f"step {number}"


def shorten(text: str, limit: int = PROMPT_CHARS) -> str:
    """``text`` on one line, cut at a word to at most ``limit`` characters with an ellipsis."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    cut = text[:limit - 1].rsplit(" ", 1)[0] if " " in text[:limit - 1] else text[:limit - 1]
    return cut.rstrip(" ,;") + "…"


def row_labels(grid: SampleGrid, prompts: list[SamplePrompt] | None = None,
               sampler: str | None = None) -> list[str]:
    """One label per row: ``<index>: <prompt>`` and ``<sampler>, seed <d>, <w>×<h>`` on a second line."""
    from PIL import Image

    by_index = {p.index: p for p in prompts or []}
    labels = []
    for r, index in enumerate(grid.rows):
        prompt = by_index.get(index)
        head = f"{index}: {shorten(prompt.prompt)}" if prompt is not None else f"prompt {index}"
        details = []
        used = (prompt.sampler if prompt is not None else None) or sampler
        if used:
            details.append(used)
        seed = grid.seeds.get(index, prompt.seed if prompt is not None else None)
        details.append(f"seed {seed}" if seed is not None else "random seed")
        path = next((p for (row, _), p in sorted(grid.images.items()) if row == r), None)
        if path is not None:
            with Image.open(path) as img:
                details.append(f"{img.width}×{img.height}")
        labels.append(head + "\n" + ", ".join(details))
    return labels


def is_blank(img: Image.Image) -> bool:
    """One colour only: what a NaN sample decodes to (black), or a blank one."""
    return all(low == high for low, high in img.convert("RGB").getextrema())


def sheet_image(grid: SampleGrid) -> tuple[Image.Image, set[tuple[int, int]]]:
    """The grid as one image, each sample fitted into a ``THUMB`` square keeping its aspect ratio (centred on
    white); and the cells whose image is of one colour."""
    from PIL import Image, ImageOps

    sheet = Image.new("RGB", (THUMB * len(grid.columns), THUMB * len(grid.rows)), (255, 255, 255))
    blank = set()
    for (r, c), path in grid.images.items():
        with Image.open(path) as img:
            rgb = img.convert("RGB")
        if is_blank(rgb):
            blank.add((r, c))
        thumb = ImageOps.contain(rgb, (THUMB, THUMB))
        sheet.paste(thumb, (c * THUMB + (THUMB - thumb.width) // 2, r * THUMB + (THUMB - thumb.height) // 2))
    return sheet, blank
