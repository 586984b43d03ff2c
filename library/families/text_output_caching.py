"""What the sections of the families that cache text-encoder outputs answer alike (``SDXLConfig``, ``FluxConfig``:
both have upstream's ``--cache_text_encoder_outputs`` and ``--cache_text_encoder_outputs_to_disk``)."""

from __future__ import annotations


class TextOutputCaching:
    """Read by ``ModelFamily.text_output_cache`` and the scripts' checks; the section dataclass holds the two flags."""

    cache_text_encoder_outputs: bool
    cache_text_encoder_outputs_to_disk: bool
    # captions per batch when caching (upstream ``--text_encoder_batch_size``, ``add_dit_training_arguments``); a
    # section without the flag (SDXL's: upstream's sdxl scripts lack it) caches in batches of --train_batch_size
    text_encoder_batch_size: int | None = None

    @property
    def caches_text_encoder_outputs(self) -> bool:
        """Either caching flag is set (``--cache_text_encoder_outputs_to_disk`` implies caching)."""
        return self.cache_text_encoder_outputs or self.cache_text_encoder_outputs_to_disk

    @property
    def caching_flag(self) -> str:
        """The caching flag a message names: the one given (the disk one when both are)."""
        return ("--cache_text_encoder_outputs_to_disk" if self.cache_text_encoder_outputs_to_disk
                else "--cache_text_encoder_outputs")
