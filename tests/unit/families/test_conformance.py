"""Every registered family against the seam (``library/families/spec.py``, ``library/families/base.py``): its record
is complete and true, its behaviour implements every method the stages call, and every fact of the record and
every method of the protocol is read by someone. A new family entered in the registry is checked by these tests
without adding any."""

from __future__ import annotations

import dataclasses
import importlib
import re

import pytest

from bench.layout import ROOT, modules
from library.config import all_fields
from library.families.base import ModelFamily
from library.families.registry import FAMILIES, model_family
from library.families.spec import FamilySpec

SPECS = list(FAMILIES.values())
IDS = [spec.name for spec in SPECS]


def _code_outside(*excluded: str) -> str:
    """The source of library/, the entry scripts and networks/, but the files named."""
    paths = [path for path in modules().values() if str(path.relative_to(ROOT)) not in excluded]
    paths += sorted(ROOT.glob("*.py"))
    return "\n".join(path.read_text() for path in paths)


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_the_behaviour_implements_the_whole_protocol(spec):
    family = model_family(spec.name)
    assert isinstance(family, ModelFamily)
    assert not getattr(type(family), "__abstractmethods__", ())


def test_a_family_lacking_a_method_cannot_be_made():
    class Incomplete(ModelFamily):
        def model_ids(self, v2, v_parameterization, model=None):
            raise NotImplementedError

    with pytest.raises(TypeError, match="abstract"):
        Incomplete()


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_the_record_is_true(spec):
    assert FAMILIES[spec.name] is spec
    script = ROOT / spec.script
    assert script.is_file(), spec.script
    text = script.read_text()
    assert spec.script == "train_network.py" or f'family="{spec.name}"' in text
    assert (spec.section is None) == (spec.section_name is None)
    if spec.section is not None:
        assert dataclasses.is_dataclass(spec.section)
        assert not set(f.name for f in dataclasses.fields(spec.section)) & set(all_fields())
    shared = all_fields()
    assert [name for name in (*spec.ignored_flags, *spec.refused_flags) if name not in shared] == []
    assert not set(spec.ignored_flags) & set(spec.refused_flags)
    assert spec.bucket_step.multiple > 0 and spec.bucket_step.multiple % 8 == 0 and spec.latent_channels > 0
    assert spec.text_cache_suffix.endswith(".npz") and not spec.latent_suffix.endswith(".npz")
    assert callable(importlib.import_module(spec.network_module).create_network)


def test_families_keep_their_cache_files_apart():
    assert len({spec.latent_suffix for spec in SPECS}) == len(SPECS)
    assert len({spec.script for spec in SPECS}) == len(SPECS)


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(FamilySpec)])
def test_every_fact_of_the_record_is_read(field):
    """A fact nobody reads is a capability flag that promises nothing (the records themselves do not count)."""
    records = {"library/families/spec.py", *(f"library/families/{spec.name}/spec.py" for spec in SPECS)}
    assert re.search(rf"\.{field}\b", _code_outside(*records)), field


def _stages() -> str:
    """The source of the stages that hold a ``ModelFamily``: library/ but the family packages and the config
    package (which holds the records, never a behaviour)."""
    packages = tuple(f"library.families.{spec.name}" for spec in SPECS) + ("library.config",)
    return "\n".join(path.read_text() for name, path in modules().items()
                     if name.startswith("library") and not name.startswith(packages))


# A behaviour's method or attribute read through ``family`` or ``self.family`` (not ``cfg.family``, the record).
BEHAVIOUR_USE = r"(?:(?<![\w.])|(?<=self\.))family\.(?!py\b)(\w+)"  # not the file name ``family.py``


@pytest.mark.parametrize("method", sorted(name for name in vars(ModelFamily) if not name.startswith("_")))
def test_every_method_of_the_protocol_is_called_by_shared_code(method):
    """The protocol holds what the stages ask and nothing else: each method is called outside the families."""
    assert method in set(re.findall(BEHAVIOUR_USE, _stages())), method


def test_shared_code_calls_only_what_the_protocol_declares():
    called = set(re.findall(BEHAVIOUR_USE, _stages()))
    assert "predict" in called
    assert sorted(name for name in called if not hasattr(ModelFamily, name)) == []
