"""Caption transforms, in sd-scripts' order (``BaseDataset.process_caption``), as two pure functions: the caption a
training step sees is "" when ``caption_dropped``, else ``shape_caption``'s (``library/data/batches.py``).

Order: prefix/suffix → whole-caption dropout (rate, or every N epochs) → wildcards / first line → split into fixed
and flexible tags (``keep_tokens`` or ``keep_tokens_separator``) → token warm-up → shuffle → tag dropout → join with
", " → secondary separator replaced by the separator. Randomness comes only from the ``rng`` argument, so a caption
is reproducible from the seed that made the rng.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass

from library.config.dataset import SubsetSpec

_WILDCARD = re.compile(r"\{([^}]+)\}")


@dataclass(frozen=True)
class CaptionState:
    """Training progress the transforms depend on: 1-based epoch, optimizer step and the total steps."""

    epoch: int = 1
    step: int = 0
    max_train_steps: int = 0


def warmup_steps(token_warmup_step: float, max_train_steps: int) -> int:
    """``token_warmup_step`` below 1 is a fraction of all steps (floored), else a step count."""
    if token_warmup_step < 1:
        return math.floor(token_warmup_step * max_train_steps)
    return int(token_warmup_step)


def expand_wildcards(caption: str, rng: random.Random) -> str:
    """Pick one line of a multi-line caption, then replace each ``{a|b|c}`` by one choice; ``{{``/``}}`` are
    literal braces."""
    if "\n" in caption:
        caption = rng.choice(caption.split("\n"))
    open_mark, close_mark = "⦅", "⦆"
    while open_mark in caption or close_mark in caption:
        open_mark += "⦅"
        close_mark += "⦆"
    caption = caption.replace("{{", open_mark).replace("}}", close_mark)
    caption = _WILDCARD.sub(lambda m: rng.choice(m.group(1).split("|")), caption)
    return caption.replace(open_mark, "{").replace(close_mark, "}")


def split_tags(caption: str, sub: SubsetSpec) -> tuple[list[str], list[str], list[str]]:
    """(fixed prefix, flexible, fixed suffix) tags. With ``keep_tokens_separator`` in the caption the text before
    it is fixed, and after a second separator the rest is a fixed suffix; otherwise the first ``keep_tokens`` tags
    are fixed. Empty tags are dropped only in the separator form (as sd-scripts)."""
    sep = sub.caption_separator
    marker = sub.keep_tokens_separator
    if marker and marker in caption:
        fixed_part, flex_part = caption.split(marker, 1)
        suffix: list[str] = []
        if marker in flex_part:
            flex_part, suffix_part = flex_part.split(marker, 1)
            suffix = [t.strip() for t in suffix_part.split(sep) if t.strip()]
        fixed = [t.strip() for t in fixed_part.split(sep) if t.strip()]
        flex = [t.strip() for t in flex_part.split(sep) if t.strip()]
        return fixed, flex, suffix
    tokens = [t.strip() for t in caption.strip().split(sep)]
    if sub.keep_tokens > 0:
        return tokens[:sub.keep_tokens], tokens[sub.keep_tokens:], []
    return [], tokens, []


def caption_dropped(sub: SubsetSpec, rng: random.Random, state: CaptionState) -> bool:
    """Whole-caption dropout: one ``rng.random()`` below ``caption_dropout_rate`` (drawn only when the rate is above
    0), or an epoch that ``caption_dropout_every_n_epochs`` divides; the first draw of the caption's choices, as in
    sd-scripts (the prefix and suffix it adds first draw nothing)."""
    dropped = sub.caption_dropout_rate > 0 and rng.random() < sub.caption_dropout_rate
    every = sub.caption_dropout_every_n_epochs
    return dropped or (every > 0 and state.epoch % every == 0)


def shape_caption(caption: str, sub: SubsetSpec, rng: random.Random, state: CaptionState) -> str:
    """The caption a step sees when it is not dropped: prefix and suffix, wildcards or first line, token warm-up,
    shuffle, tag dropout, secondary separator."""
    if sub.caption_prefix:
        caption = sub.caption_prefix + " " + caption
    if sub.caption_suffix:
        caption = caption + " " + sub.caption_suffix
    caption = expand_wildcards(caption, rng) if sub.enable_wildcard else caption.split("\n")[0]
    if sub.shuffle_caption or sub.token_warmup_step > 0 or sub.caption_tag_dropout_rate > 0:
        fixed, flex, suffix = split_tags(caption, sub)
        warmup = warmup_steps(sub.token_warmup_step, state.max_train_steps)
        if warmup and state.step < warmup:
            count = math.floor(state.step * ((len(flex) - sub.token_warmup_min) / warmup)) + sub.token_warmup_min
            flex = flex[:count]
        if sub.shuffle_caption:
            rng.shuffle(flex)
        if sub.caption_tag_dropout_rate > 0:
            flex = [t for t in flex if rng.random() >= sub.caption_tag_dropout_rate]
        caption = ", ".join(fixed + flex + suffix)
    if sub.secondary_separator:
        caption = caption.replace(sub.secondary_separator, sub.caption_separator)
    return caption


def cut_caption(caption: str, max_length: int) -> str | None:
    """``--max_caption_length``: the caption with each line cut to ``max_length`` characters, or None when no line is
    longer (then the caption is used exactly as read). Lines are cut one by one because with wildcards each line is
    a caption of its own. Ours, not sd-scripts': sd-scripts tokenizes the whole text at every step, and the tokenizer
    keeps only its first 75, 150 or 225 tokens; the default 10000 characters hold more tokens than that unless the
    line is mostly spaces, so the tokens trained on are the same (``tests/e2e/test_input_limits.py``)."""
    lines = caption.split("\n")
    if all(len(line) <= max_length for line in lines):
        return None
    return "\n".join(line[:max_length] for line in lines)


def count_tags(captions: list[str]) -> dict[str, int]:
    """sd-scripts' ``set_tag_frequency`` for one folder: comma-split, stripped, lower-cased tag counts."""
    counts: dict[str, int] = {}
    for caption in captions:
        for tag in caption.split(","):
            tag = tag.strip().lower()
            if tag:
                counts[tag] = counts.get(tag, 0) + 1
    return counts
