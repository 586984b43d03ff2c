"""The model families: the only list of them. Each entry is a family package's record (``<family>/spec.py``, a
``library/families/spec.FamilySpec``); a new family is a package beside ``sd/``, ``sdxl/`` and ``flux/``, one line
here and its entry script; a full fine-tuning script is one more record of its family in ``FINE_TUNING``. Importing
this module imports no torch; ``model_family`` loads the behaviour.
"""

from __future__ import annotations

from functools import cache

from library.families.anima.spec import FINE_TUNE as ANIMA_FINE_TUNE
from library.families.anima.spec import SPEC as ANIMA
from library.families.flux.spec import FINE_TUNE as FLUX_FINE_TUNE
from library.families.flux.spec import SPEC as FLUX
from library.families.sd.spec import DREAMBOOTH as SD_DREAMBOOTH
from library.families.sd.spec import FINE_TUNE as SD_FINE_TUNE
from library.families.sd.spec import SPEC as SD
from library.families.sdxl.spec import FINE_TUNE as SDXL_FINE_TUNE
from library.families.sdxl.spec import SPEC as SDXL
from library.families.spec import FamilySpec

FAMILIES: dict[str, FamilySpec] = {spec.name: spec for spec in (SD, SDXL, FLUX, ANIMA)}

# The full fine-tuning scripts' records (each family's LoRA script is its record in ``FAMILIES``).
FINE_TUNING: tuple[FamilySpec, ...] = (SD_FINE_TUNE, SD_DREAMBOOTH, SDXL_FINE_TUNE, FLUX_FINE_TUNE, ANIMA_FINE_TUNE)


def entry_scripts() -> dict[str, FamilySpec]:
    """Every entry script's record by script name: each registered family's LoRA script, then the full fine-tuning
    scripts (read at the call, so a family registered later is one of them)."""
    return {spec.script: spec for spec in (*FAMILIES.values(), *FINE_TUNING)}


def family_spec(name: str) -> FamilySpec:
    """The record of the family called ``name`` (a key of ``FAMILIES``)."""
    return FAMILIES[name]


@cache
def model_family(name: str):
    """The behaviour object (``library.families.base.ModelFamily``) of the family called ``name``."""
    return FAMILIES[name].load()
