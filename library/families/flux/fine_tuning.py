"""What FLUX.1's full fine-tuning script, ``flux_train.py``, trains (its flags and checks: ``fine_tune_config.py``).

As upstream sd-scripts 48d368fa ``flux_train.py``: every parameter of the transformer, in one group at
``--learning_rate`` (logged as ``lr/unet``, upstream's name for it); CLIP-L and T5-XXL stay frozen.
"""

from __future__ import annotations

from typing import Any

from library.families.checkpoint_flags import TrainedPart


def flux_fine_tune_parts(model: Any, section: Any, learning_rate: float) -> list[TrainedPart]:
    """The transformer, at ``learning_rate`` (the shared checks refuse 0: nothing would train)."""
    return [TrainedPart("unet", model.unet, learning_rate)]
