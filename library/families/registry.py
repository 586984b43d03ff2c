"""The model families by name: the entry scripts' ``family`` ("sd": ``train_network.py``, "sdxl":
``sdxl_train_network.py``, "flux": ``flux_train_network.py``) to the object the stages ask
(``library/families/base.py``). A new family is a package beside ``sd/``, ``sdxl/`` and ``flux/`` and one entry here.
"""

from __future__ import annotations

from library.families.base import ModelFamily
from library.families.flux.family import FluxFamily
from library.families.sd.family import SDFamily
from library.families.sdxl.family import SDXLFamily

FAMILIES: dict[str, ModelFamily] = {"sd": SDFamily(), "sdxl": SDXLFamily(), "flux": FluxFamily()}


def model_family(name: str) -> ModelFamily:
    return FAMILIES[name]
