"""The validation loss on held-out images."""

from __future__ import annotations

from dataclasses import dataclass

from library.config.fields import flag


@dataclass
class ValidationConfig:
    """When the validation loss is computed (the split itself is --validation_split, a dataset option)."""

    validate_every_n_steps: int | None = flag(None, "validate every N updates (default: every epoch when a "
                                              "validation split exists)")
    validate_every_n_epochs: int | None = flag(None, "validate every N epochs (default: every epoch)")
    max_validation_steps: int | None = flag(None, "validate on at most N batches (default: all)")
