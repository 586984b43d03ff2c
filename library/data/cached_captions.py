"""Which caption options ``--cache_text_encoder_outputs`` allows: the outputs are encoded once, so a caption that
changes from step to step cannot be cached.

sd-scripts 48d368fa ``train_util.DatasetGroup.is_text_encoder_output_cacheable(cache_supports_dropout)`` refuses
shuffle_caption, token_warmup_step and caption_tag_dropout_rate, and caption_dropout_rate unless the model's
caching strategy drops cached outputs itself (Anima's: ``cache_supports_dropout=True``). Here a family says so in
its record (``FamilySpec.cached_caption_dropout``), and its ``ModelFamily.drop_cached_captions`` replaces the dropped
items' outputs at each step. Refused as well, where sd-scripts lets them through: enable_wildcard (it picks a line
and a choice each step, so sd-scripts caches one of them and trains on it alone), and
caption_dropout_every_n_epochs, which sd-scripts ignores silently with cached outputs even where it allows the rate.
"""

from __future__ import annotations

from collections.abc import Iterable

from library.base.errors import UserError
from library.config.dataset import SubsetSpec

CACHING_FIX = "turn them off or drop --cache_text_encoder_outputs"


def _changing(sub: SubsetSpec, cached_dropout: bool) -> list[str]:
    """The options of ``sub`` that change its caption between steps, beyond what cached outputs can follow."""
    options = {"shuffle_caption": sub.shuffle_caption, "caption_dropout_rate": sub.caption_dropout_rate > 0,
               "caption_dropout_every_n_epochs": sub.caption_dropout_every_n_epochs > 0,
               "caption_tag_dropout_rate": sub.caption_tag_dropout_rate > 0,
               "token_warmup_step": sub.token_warmup_step > 0, "enable_wildcard": sub.enable_wildcard}
    if cached_dropout:
        del options["caption_dropout_rate"]
    return [name for name, on in options.items() if on]


def refuse_changing_captions(subsets: Iterable[SubsetSpec], cached_dropout: bool) -> None:
    """A ``UserError`` naming each subset whose caption changes between steps (``cached_dropout``: the family drops
    cached outputs itself, so ``caption_dropout_rate`` is allowed)."""
    problems = []
    for sub in subsets:
        changing = _changing(sub, cached_dropout)
        if cached_dropout and "caption_dropout_every_n_epochs" in changing:
            changing.remove("caption_dropout_every_n_epochs")
            problems.append(f"{sub.location}: caption_dropout_every_n_epochs drops every caption of whole epochs, "
                            "which cached text encoder outputs do not follow here (sd-scripts ignores it with cached "
                            "outputs); use caption_dropout_rate, which works with caching, or drop "
                            "--cache_text_encoder_outputs")
        if changing:
            verb = "changes" if len(changing) == 1 else "change"
            problems.append(f"{sub.location}: {', '.join(changing)} {verb} the caption every step, so text encoder "
                            f"outputs cannot be cached; {CACHING_FIX}")
    if problems:
        raise UserError(*dict.fromkeys(problems))
