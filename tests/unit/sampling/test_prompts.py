"""Prompt files and the sampling cadence plan (``library/sampling/prompts.py``).

Expected values are read off sd-scripts' ``line_to_prompt_dict`` / ``load_prompts`` / ``sample_image_inference``
(48d368fa) by hand: split on " --", defaults 512 x 512, 30 steps, CFG 7.5, random seed; steps clamped to 1..1000;
sizes rounded down to a multiple of 8, at least 64; comments only where the line's first character is "#".
"""

from __future__ import annotations

import json
import logging

import pytest

from library.base.errors import UserError
from library.config import SampleConfig
from library.sampling.prompts import SamplePrompt, load_prompt_file, plan_samples


def write(tmp_path, name: str, text: str):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_txt_every_option(tmp_path):
    path = write(tmp_path, "p.txt", "# a comment\n\n"
                 "masterpiece, 1girl --n low quality, bad --w 768 --h 576 --d 42 --l 5.5 --s 28 --ss euler_a\n"
                 "  a plain prompt  \n"
                 "  # indented: a prompt, as in sd-scripts\n"
                 "upper case --W 640 --H 320 --D 1 --L 1 --S 4 --SS Euler\n")
    first, plain, indented, upper = load_prompt_file(path)
    assert first == SamplePrompt(index=0, prompt="masterpiece, 1girl", negative_prompt="low quality, bad", width=768,
                                 height=576, seed=42, steps=28, scale=5.5, sampler="euler_a")
    assert plain == SamplePrompt(index=1, prompt="a plain prompt")
    assert (plain.width, plain.height, plain.steps, plain.scale, plain.seed) == (512, 512, 30, 7.5, None)
    assert indented.prompt == "# indented: a prompt, as in sd-scripts" and indented.index == 2
    assert (upper.width, upper.height, upper.seed, upper.scale, upper.steps, upper.sampler) == \
        (640, 320, 1, 1.0, 4, "euler")


def test_steps_are_clamped_and_sizes_rounded(tmp_path):
    path = write(tmp_path, "p.txt", "a --s 0 --w 70 --h 30\nb --s 5000 --w 64 --h 1023\n")
    low, high = load_prompt_file(path)
    assert (low.steps, high.steps) == (1, 1000)
    assert low.image_size() == (64, 64)
    assert high.image_size() == (64, 1016)


def test_ignored_options_warn(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    path = write(tmp_path, "p.txt", "a --g 3.5 --fs 3\nb --g 0 --cn hint.png --ctr 0.25 --rcfg 1\n")
    first, second = load_prompt_file(path)
    assert first == SamplePrompt(index=0, prompt="a")
    assert second == SamplePrompt(index=1, prompt="b")
    text = caplog.text
    for key in ("guidance_scale", "flow_shift", "controlnet_image", "cfg_trunc_ratio", "renorm_cfg"):
        assert key in text
    assert f"{path}:1,2: --g (guidance_scale)" in text


@pytest.mark.parametrize("line, expected", [
    ("a --x 1", "unknown option --x"),
    ("a --nn bad", 'unknown option --nn (did you mean "--n"?)'),
    ("a --f 2", "unknown option --f"),
    ("a --w 5l2", "--w '5l2': expected a whole number"),
    ("a --w 0", "--w 0: expected a size"),
    ("a --h 512 768", "--h '512 768': expected a whole number"),
    ("a --d -1", "--d '-1': expected a whole number >= 0: a seed"),
    ("a --s 2.5", "--s '2.5': expected a whole number"),
    ("a --l abc", "--l 'abc': expected a number >= 0"),
    ("a --l -2", "--l '-2': expected a number >= 0"),
    ("a --l nan", "--l 'nan': expected a number >= 0"),
    ("a --g x", "--g 'x': expected a number >= 0"),
    ("a --ss euler_b", "--ss 'euler_b': unknown sampler (did you mean \"euler_a\"?)"),
    ("a --ss ddpm", "--ss 'ddpm': unknown sampler"),
    ("a --n", "--n needs a value"),
    ("a (cat:1.2.3)", "prompt 'a (cat:1.2.3)': a weight such as (word:1.2) is not a number"),
    ("a --n (x:..)", "--n '(x:..)': a weight"),
])
def test_txt_errors_name_file_line_and_option(tmp_path, line, expected):
    path = write(tmp_path, "p.txt", f"# header\nfine --w 64\n{line}\n")
    with pytest.raises(UserError) as info:
        load_prompt_file(path)
    assert info.value.messages == [info.value.messages[0]]
    assert info.value.messages[0].startswith(f"{path}:3: ")
    assert expected in info.value.messages[0]


def test_every_problem_is_reported_at_once(tmp_path):
    path = write(tmp_path, "p.txt", "a --w x\nb --q 1 --s y\n")
    with pytest.raises(UserError) as info:
        load_prompt_file(path)
    assert [m.split(": ", 1)[0] for m in info.value.messages] == [f"{path}:1", f"{path}:2", f"{path}:2"]


def test_toml_defaults_and_subsets(tmp_path):
    path = write(tmp_path, "p.toml", """
[prompt]
negative_prompt = "bad"
width = 640
sample_steps = 12
scale = 6

[[prompt.subset]]
prompt = "first"
seed = 3

[[prompt.subset]]
prompt = "second"
width = 320
sample_sampler = "k_euler_a"
""")
    first, second = load_prompt_file(path)
    assert first == SamplePrompt(index=0, prompt="first", negative_prompt="bad", width=640, seed=3, steps=12,
                                 scale=6.0)
    assert second == SamplePrompt(index=1, prompt="second", negative_prompt="bad", width=320, steps=12, scale=6.0,
                                  sampler="k_euler_a")


def test_json_lines_and_tables(tmp_path):
    items = ["a line --w 64 --s 2", {"prompt": "a table", "height": 96, "scale": 1, "sample_sampler": "dpm_2"}, ""]
    path = write(tmp_path, "p.json", json.dumps(items))
    line, table, empty = load_prompt_file(path)
    assert line == SamplePrompt(index=0, prompt="a line", width=64, steps=2)
    assert table == SamplePrompt(index=1, prompt="a table", height=96, scale=1.0, sampler="dpm_2")
    assert empty == SamplePrompt(index=2, prompt="")


TOML_ERRORS = [
    ('[prompt]\n[[prompt.subset]]\nprompt = "a"\nwidht = 5\n', 'prompt.subset[0]: unknown key "widht" (did you mean '
     '"width"?)'),
    ('[prompt]\n[[prompt.subset]]\nprompt = "a"\nseed = "x"\n', "prompt.subset[0]: key \"seed\" 'x': expected a "
     "whole number"),
    ('[prompt]\nwidth = true\n[[prompt.subset]]\nprompt = "a"\n', "prompt.subset[0]: key \"width\" True"),
    ('[prompt]\n[[prompt.subset]]\nprompt = 3\n', "prompt.subset[0]: key \"prompt\": expected text"),
    ('prompt = "a"\n', "expected a [prompt] table of defaults and one [[prompt.subset]] table per image"),
    ("[prompt\n", "not valid TOML"),
]
JSON_ERRORS = [
    ('{"prompt": "a"}', "expected a JSON list"),
    ('["ok", 3]', "[1]: expected a prompt line or a table"),
    ('[{"prompt": "a", "steps": 3}]', '[0]: unknown key "steps"'),
    ('["a --w x"]', "[0]: --w 'x'"),
    ("[", "not valid JSON"),
]


@pytest.mark.parametrize("name, text, expected", [("p.toml", *case) for case in TOML_ERRORS]
                         + [("p.json", *case) for case in JSON_ERRORS])
def test_toml_and_json_errors_name_the_file_and_the_place(tmp_path, name, text, expected):
    path = write(tmp_path, name, text)
    with pytest.raises(UserError) as info:
        load_prompt_file(path)
    assert expected in str(info.value) and str(path) in str(info.value)


def test_file_errors(tmp_path):
    with pytest.raises(UserError, match="no such file"):
        load_prompt_file(tmp_path / "missing.txt")
    with pytest.raises(UserError, match="use a .txt, .toml or .json"):
        load_prompt_file(write(tmp_path, "p.yaml", "a"))
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(UserError, match="cannot read it as UTF-8"):
        load_prompt_file(bad)
    folder = tmp_path / "folder.txt"
    folder.mkdir()
    with pytest.raises(UserError, match="cannot read"):
        load_prompt_file(folder)
    bom = tmp_path / "bom.txt"
    bom.write_bytes("\ufeff# comment\na --w 64\n".encode())
    assert load_prompt_file(bom) == [SamplePrompt(index=0, prompt="a", width=64)]


def sample_config(**values) -> SampleConfig:
    return SampleConfig(**values)


def test_plan_cadence(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    path = write(tmp_path, "p.txt", "a\nb --ss heun\n")
    plan = plan_samples(sample_config(sample_prompts=str(path), sample_every_n_steps=5, sample_every_n_epochs=2,
                                      sample_sampler="euler_a"))
    assert (plan.every_n_steps, plan.every_n_epochs, plan.at_first, plan.sampler) == (None, 2, False, "euler_a")
    assert [p.prompt for p in plan.prompts] == ["a", "b"]
    assert "wins over --sample_every_n_steps" in caplog.text
    plan = plan_samples(sample_config(sample_prompts=str(path), sample_every_n_steps=5, sample_at_first=True))
    assert (plan.every_n_steps, plan.every_n_epochs, plan.at_first) == (5, None, True)


def test_no_cadence_draws_nothing_and_reads_no_file(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    assert plan_samples(sample_config()) is None
    # the kohya_ss GUI always passes a prompt file; without a cadence it is not even read
    assert plan_samples(sample_config(sample_prompts=str(tmp_path / "missing.txt"))) is None
    assert "no sample images are drawn" in caplog.text


def test_zero_or_negative_cadence_is_off(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    path = write(tmp_path, "p.txt", "a\n")
    assert plan_samples(sample_config(sample_prompts=str(path), sample_every_n_steps=0,
                                      sample_every_n_epochs=-1)) is None
    assert "--sample_every_n_steps 0: 0 or less turns it off" in caplog.text
    assert "--sample_every_n_epochs -1" in caplog.text


def test_cadence_without_prompts_is_an_error():
    with pytest.raises(UserError, match="--sample_every_n_epochs / --sample_at_first needs --sample_prompts"):
        plan_samples(sample_config(sample_every_n_epochs=1, sample_at_first=True))


def test_empty_prompt_file_warns(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    path = write(tmp_path, "p.txt", "# only a comment\n\n")
    assert plan_samples(sample_config(sample_prompts=str(path), sample_every_n_steps=1)) is None
    assert "has no prompts" in caplog.text


def test_bad_file_fails_the_plan(tmp_path):
    path = write(tmp_path, "p.txt", "a --w x\n")
    with pytest.raises(UserError, match=r"p.txt:1: --w 'x'"):
        plan_samples(sample_config(sample_prompts=str(path), sample_at_first=True))


def test_sampler_needing_a_missing_package(tmp_path, monkeypatch):
    import library.families.schedulers as samplers

    monkeypatch.setattr(samplers.importlib.util, "find_spec", lambda name: None)
    path = write(tmp_path, "p.txt", "a --ss k_lms\nb\n")
    with pytest.raises(UserError) as info:
        plan_samples(sample_config(sample_prompts=str(path), sample_at_first=True, sample_sampler="lms"))
    assert len(info.value.messages) == 2  # lms (--sample_sampler) and k_lms (--ss)
    assert all("LMSDiscreteScheduler scheduler needs scipy; pip install scipy" in m for m in info.value.messages)


def test_pndm_needs_four_steps(tmp_path):
    path = write(tmp_path, "p.txt", "a --s 3\nb --s 4\nc --s 2 --ss euler\n")
    with pytest.raises(UserError) as info:
        plan_samples(sample_config(sample_prompts=str(path), sample_at_first=True, sample_sampler="pndm"))
    assert info.value.messages == [f"{path}:1: --s 3: the pndm sampler needs at least 4 steps; use more steps or "
                                   "another sampler"]
