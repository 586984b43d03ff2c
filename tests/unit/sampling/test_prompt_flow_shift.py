"""``--fs`` / ``flow_shift`` in prompt files (``library/sampling/prompts.py``): read as a number above 0 into
``SamplePrompt.flow_shift`` (sd-scripts 48d368fa ``line_to_prompt_dict`` keeps the text after ``--fs``, which
Anima's ``sample_image_inference`` reads with ``float()``, default 3.0), and a warning for the families whose
sampler does not read it (``FamilySpec.sample_flow_shift``), as for ``--g`` (``sample_guidance``)."""

from __future__ import annotations

import logging

import pytest

from library.base.errors import UserError
from library.families.registry import FAMILIES
from library.sampling.prompts import load_prompt_file, sampler_reads


def write(tmp_path, name: str, text: str):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_the_txt_option(tmp_path):
    path = write(tmp_path, "p.txt", "a --fs 5\nb --FS 2.5 --s 4\nc\n")
    assert [p.flow_shift for p in load_prompt_file(path)] == [5.0, 2.5, None]


def test_the_toml_key_with_its_default(tmp_path):
    path = write(tmp_path, "p.toml", '[prompt]\nflow_shift = 4.0\n[[prompt.subset]]\nprompt = "x"\n'
                 '[[prompt.subset]]\nprompt = "y"\nflow_shift = 1\n')
    assert [p.flow_shift for p in load_prompt_file(path)] == [4.0, 1.0]


def test_the_json_table(tmp_path):
    path = write(tmp_path, "p.json", '[{"prompt": "x", "flow_shift": 6}, "y --fs 0.5"]')
    assert [p.flow_shift for p in load_prompt_file(path)] == [6.0, 0.5]


@pytest.mark.parametrize("value", ["0", "-1", "abc", "nan", "inf"])
def test_a_shift_must_be_a_number_above_0(tmp_path, value):
    path = write(tmp_path, "p.txt", f"a --fs {value}\n")
    with pytest.raises(UserError, match=f"{path}:1: --fs '{value}': expected a flow shift above 0, e.g. 3.0"):
        load_prompt_file(path)


@pytest.mark.parametrize("family, warned", [("anima", {"--g"}), ("sdxl", {"--g", "--fs"}), ("sd", {"--g", "--fs"}),
                                            ("flux", {"--fs"})])
def test_families_whose_sampler_ignores_it_warn(tmp_path, caplog, family, warned):
    caplog.set_level(logging.WARNING)
    path = write(tmp_path, "p.txt", "a --fs 5 --g 3.5\nb --fs 2\n")
    spec = FAMILIES[family]
    load_prompt_file(path, sampler_reads(spec), spec.display_name)
    lines = [r.getMessage() for r in caplog.records]
    assert {option for option in ("--g", "--fs") if any(f": {option} (" in line for line in lines)} == warned
    if "--fs" in warned:
        assert f"{path}:1,2: --fs (flow_shift) is for sd-scripts' HunyuanImage / Anima samples; " \
            f"{spec.display_name} samples ignore it" in lines
