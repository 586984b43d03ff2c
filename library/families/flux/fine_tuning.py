"""What FLUX.1's full fine-tuning script, ``flux_train.py``, trains (its flags and checks: ``fine_tune_config.py``).

As upstream sd-scripts 48d368fa ``flux_train.py``: every parameter of the transformer, in one group at
``--learning_rate`` (logged as ``lr/unet``, upstream's name for it); CLIP-L and T5-XXL stay frozen. Chroma
(``--model_type chroma``, which upstream's ``flux_train.py`` does not load) trains the same way but for its
approximator.
"""

from __future__ import annotations

from typing import Any

from library.families.checkpoint_flags import TrainedPart
from library.families.flux.chroma import ChromaTransformer


def flux_fine_tune_parts(model: Any, section: Any, learning_rate: float) -> list[TrainedPart]:
    """The transformer, at ``learning_rate`` (the shared checks refuse 0: nothing would train); Chroma's
    ``distilled_guidance_layer`` stays frozen: its modulation vectors are computed without gradient, as upstream's
    trainer computes them (``get_mod_vectors`` under ``no_grad``), so it would never get one."""
    frozen = (model.unet.distilled_guidance_layer,) if isinstance(model.unet, ChromaTransformer) else ()
    return [TrainedPart("unet", model.unet, learning_rate, frozen)]
