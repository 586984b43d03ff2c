"""The bounds of every sample prompt option (``library/sampling/prompts.py``), in the three file forms.

Expected bounds come from outside the code: torch's ``Generator.manual_seed`` takes 0 ... 2**64 - 1; sd-scripts'
``line_to_prompt_dict`` clamps steps to 1 ... 1000; ComfyUI's ``MAX_RESOLUTION`` is 16384 and its KSampler's CFG
maximum 100.
"""

from __future__ import annotations

import json

import pytest
import torch

from library.base.errors import UserError
from library.sampling.prompts import load_prompt_file


def _errors(path) -> str:
    with pytest.raises(UserError) as info:
        load_prompt_file(path)
    return "\n".join(info.value.messages)


def test_json_and_toml_values_at_and_past_the_bounds(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps([{"prompt": "a", "width": 16384, "height": 1, "seed": 2**64 - 1, "scale": 100,
                                 "sample_steps": 10**40}, "b --n " + "x" * 10_000]), encoding="utf-8")
    first, second = load_prompt_file(path)
    assert (first.width, first.height, first.seed, first.scale, first.steps) == (16384, 1, 2**64 - 1, 100.0, 1000)
    assert first.image_size() == (16384, 64)
    assert len(second.negative_prompt) == 10_000
    assert torch.Generator().manual_seed(first.seed).initial_seed() == 2**64 - 1
    path.write_text(json.dumps([{"prompt": "a", "seed": 2**64}, {"prompt": "b", "width": 16385},
                                {"prompt": "c" * 10_001}, {"prompt": "d", "scale": 100.5}]), encoding="utf-8")
    text = _errors(path)
    assert f"{path}:[0]: key \"seed\" {2**64}: a seed must fit a torch generator: 0 to {2**64 - 1}" in text
    assert f"{path}:[1]: key \"width\" 16385: expected a size of 1 to 16384 pixels" in text
    assert f"{path}:[2]: key \"prompt\": 10001 characters, more than 10000" in text
    assert f"{path}:[3]: key \"scale\" 100.5: expected a CFG scale of at most 100" in text
    toml = tmp_path / "p.toml"
    toml.write_text('[prompt]\nheight = 99999\n[[prompt.subset]]\nprompt = "a"\n', encoding="utf-8")
    assert f"{toml}:prompt.subset[0]: key \"height\" 99999: expected a size of 1 to 16384" in _errors(toml)


def test_digit_strings_longer_than_int_reads_are_bounded_not_a_traceback(tmp_path):
    digits = "9" * 5000  # int() refuses more than 4300 digits
    path = tmp_path / "p.txt"
    path.write_text(f"a --s {digits}\nb --w {digits}\nc --d {digits}\n", encoding="utf-8")
    text = _errors(path)
    assert f"{path}:2: --w {'9' * 40}...: expected a size of 1 to 16384 pixels" in text
    assert f"{path}:3: --d {'9' * 40}...: a seed must fit a torch generator" in text
    assert f"{path}:1:" not in text  # steps are clamped to 1000, as sd-scripts clamps them
    path.write_text(f"a --s {digits}\n", encoding="utf-8")
    assert load_prompt_file(path)[0].steps == 1000
