"""Every reader of a file the user controls bounds what it accepts: a hand-edited state, training or dataset config,
``metadata_cache.json`` or sample-prompt file with a huge integer, deep nesting, values of the wrong type or shape, or
numbers no run can have written stops with exit 2 naming the file and the key (the cache is rebuilt with a warning),
instead of a ``ValueError`` / ``RecursionError`` / ``TypeError`` / ``OverflowError`` traceback or an exit 3 after an
update. And ``--output_config --config_file new.toml`` writes the given flags, as the README shows it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import train_network
from library.families import model_setup
from tests.e2e.test_train_network import ROOT, SAMPLES, train_args
from tests.e2e.test_train_network import refused as _fails

DEEP = 100_000
HUGE = "9" * 5000
TREE_KEY = "sd_scripts_bf16_state"


def _deep(opening: str = "[", closing: str = "]") -> str:
    return opening * DEEP + closing * DEEP


@pytest.fixture(scope="module")
def good_state(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("good")
    assert train_network.main(train_args(out, "--max_train_steps", "2", "--save_state")) == 0
    return out / "lora-state"


# --- state files -------------------------------------------------------------------------------------------------
def _train_state_text(edit: Callable[[str], str]) -> Callable[[Path], None]:
    def apply(folder: Path) -> None:
        path = folder / "train_state.json"
        path.write_text(edit(path.read_text()))
    return apply


def _train_state(**changes) -> Callable[[Path], None]:
    def edit(text: str) -> str:
        return json.dumps({**json.loads(text), **changes})
    return _train_state_text(edit)


def _tree(edit: Callable[[str, dict[str, torch.Tensor]], str]) -> Callable[[Path], None]:
    """Rewrite ``state.safetensors`` with ``edit(tree JSON text, tensors)`` (which may also change the tensors)."""
    def apply(folder: Path) -> None:
        path = folder / "state.safetensors"
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata())
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
        meta[TREE_KEY] = edit(meta[TREE_KEY], tensors)
        save_file(tensors, str(path), metadata=meta)
    return apply


def _tree_values(change: Callable[[dict], None]) -> Callable[[Path], None]:
    def edit(text: str, tensors: dict[str, torch.Tensor]) -> str:
        tree = json.loads(text)
        change(tree)
        return json.dumps(tree)
    return _tree(edit)


def _optimizer_tensor(key: str, change: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[Path], None]:
    """Replace optimizer.state[0][key] (a tensor of AdamW's state) by ``change(it)``."""
    def edit(text: str, tensors: dict[str, torch.Tensor]) -> str:
        entry = dict(json.loads(text)["optimizer"]["state"]["__items__"])[0]
        name = entry[key]["__tensor__"]
        tensors[name] = change(tensors[name]).contiguous()
        return text
    return _tree(edit)


def _set_lr(tree: dict) -> None:
    tree["optimizer"]["param_groups"][0]["lr"] = 1e300


def _set_last_epoch(value: int) -> Callable[[dict], None]:
    def change(tree: dict) -> None:
        tree["scheduler"]["last_epoch"] = value
    return change


# name: (damage, needles); each read before the model loads
BEFORE_LOADING = {
    "train_state_5000_digit_integer": (
        _train_state_text(lambda text: text.replace('"step": 2', f'"step": {HUGE}', 1)),
        ("train_state.json", "position.step", "an integer of 5000 digits")),
    "train_state_nested_100000_deep": (
        _train_state_text(lambda text: text.replace('"config": {', f'"extra": {_deep()}, "config": {{', 1)),
        ("train_state.json", "key extra[0][0]", "nested more than 64 levels")),
    "metadata_5000_digit_integer": (
        _tree(lambda text, _: text.replace('"last_epoch": 2', f'"last_epoch": {HUGE}', 1)),
        ("state.safetensors: metadata sd_scripts_bf16_state", "scheduler.last_epoch", "an integer of 5000 digits")),
    "metadata_nested_100000_deep": (
        _tree(lambda text, _: text[:-1] + f', "extra": {_deep()}}}'),
        ("state.safetensors: metadata sd_scripts_bf16_state", "key extra[0]", "nested more than 64 levels")),
    "trajectory_dataset_of_the_wrong_type": (
        _train_state(trajectory={"seed": 1, "datasets": [{"batch_size": "two"}], "gradient_accumulation_steps": 1,
                                 "optimizer": "AdamW()", "network_module": "networks.lora", "num_processes": 1}),
        ("train_state.json: trajectory.datasets[0].batch_size is 'two'", "trajectory.datasets[0].images")),
    "trajectory_not_an_object": (
        _train_state(trajectory=[1, 2]), ("train_state.json: trajectory is [1, 2], not an object",)),
    "scheduler_last_epoch_10_to_the_400": (
        _tree_values(_set_last_epoch(10**400)),
        ("state.safetensors", "scheduler.last_epoch", "an integer of 401 digits")),
    "scheduler_last_epoch_past_the_position": (
        _tree_values(_set_last_epoch(10**6)), ("state.safetensors: scheduler.last_epoch", "1000000")),
    "learning_rate_1e300": (
        _tree_values(_set_lr), ("state.safetensors: optimizer.param_groups[0].lr is 1e+300", "float32's largest")),
    "negative_second_moments": (
        _optimizer_tensor("exp_avg_sq", lambda t: -(t.abs() + 1e-3)),
        ("state.safetensors: optimizer.state[0].exp_avg_sq holds negative values",)),
    "optimizer_step_past_the_position": (
        _optimizer_tensor("step", lambda t: torch.full_like(t, 1000)),
        ("state.safetensors: optimizer.state[0].step", "but the state is 2 update(s) in")),
}


@pytest.mark.parametrize("case", BEFORE_LOADING)
def test_damaged_state_is_refused_before_the_model_loads(good_state, tmp_path, capsys, monkeypatch, case):
    damage, needles = BEFORE_LOADING[case]
    state = tmp_path / "state"
    shutil.copytree(good_state, state)
    damage(state)
    monkeypatch.setattr(model_setup, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    _fails(capsys, train_args(tmp_path / "out", "--max_train_steps", "4", "--resume", str(state)),
           f"--resume {state}", "damaged or was edited", *needles)
    assert not (tmp_path / "out").exists()


def test_optimizer_tensor_of_the_wrong_shape_is_refused_before_the_first_step(good_state, tmp_path, capsys):
    state = tmp_path / "state"
    shutil.copytree(good_state, state)
    for key in ("exp_avg", "exp_avg_sq"):  # both, so that the two agree with each other and only the run can tell
        _optimizer_tensor(key, lambda t: t.t())(state)
    out = tmp_path / "out"
    _fails(capsys, train_args(out, "--max_train_steps", "4", "--resume", str(state)), f"--resume {state}",
           "state.safetensors: optimizer.state[0].exp_avg has shape", "optimizer.state[0].exp_avg_sq has shape")
    assert not list(out.glob("*.safetensors"))


def test_an_untouched_state_resumes_and_records_no_steps_beyond_its_position(good_state, tmp_path):
    assert json.loads((good_state / "train_state.json").read_text())["steps_beyond_position"] == 0
    assert train_network.main(train_args(tmp_path / "out", "--max_train_steps", "3", "--resume",
                                         str(good_state))) == 0


def test_a_resume_with_a_lower_initial_step_writes_a_state_that_resumes(good_state, tmp_path):
    """The optimizer (2 steps) and schedule keep their counts while the position restarts at 1: the state records
    the step they carry beyond it, so the next resume does not take them for an edit."""
    first = tmp_path / "first"
    assert train_network.main(train_args(first, "--max_train_steps", "3", "--resume", str(good_state),
                                         "--initial_step", "1", "--save_state")) == 0
    record = json.loads((first / "lora-state" / "train_state.json").read_text())
    assert (record["position"]["step"], record["steps_beyond_position"]) == (3, 1)
    assert train_network.main(train_args(tmp_path / "second", "--max_train_steps", "4", "--resume",
                                         str(first / "lora-state"))) == 0


# --- --config_file and --dataset_config ---------------------------------------------------------------------------
def _without_data(args: list[str]) -> list[str]:
    at = args.index("--train_data_dir")
    return args[:at] + args[at + 2:]


CONFIGS = {
    "config_file_toml_5000_digit_integer": (
        "--config_file", "args.toml", f"max_train_epochs = {HUGE}\n",
        ("args.toml: key max_train_epochs (line 1)", "an integer of 5000 digits")),
    "config_file_toml_nested_100000_deep": (
        "--config_file", "args.toml", f"[network]\nnetwork_args = {_deep()}\n",
        ("args.toml: [network] key network_args[0][0]", "(line 2)", "nested more than 64 levels")),
    "dataset_config_toml_5000_digit_integer": (
        "--dataset_config", "data.toml", f'[general]\nbatch_size = {HUGE}\n[[datasets]]\n[[datasets.subsets]]\n'
                                         f'image_dir = "{SAMPLES}"\n',
        ("data.toml: [general] key batch_size (line 2)", "an integer of 5000 digits")),
    "dataset_config_toml_nested_100000_deep": (
        "--dataset_config", "data.toml", f"[general]\nshuffle_caption = {_deep()}\n",
        ("data.toml: [general] key shuffle_caption[0]", "nested more than 64 levels")),
    "dataset_config_json_5000_digit_integer": (
        "--dataset_config", "data.json", f'{{"general": {{"batch_size": {HUGE}}}, "datasets": []}}',
        ("data.json: key general.batch_size (line 1)", "an integer of 5000 digits")),
    "dataset_config_json_nested_100000_deep": (
        "--dataset_config", "data.json", f'{{"general": {{"shuffle_caption": {_deep()}}}}}',
        ("data.json: key general.shuffle_caption[0]", "nested more than 64 levels")),
    "log_tracker_config_toml_nested_100000_deep": (
        "--log_tracker_config", "trackers.toml", f"[tensorboard]\nflush_secs = {_deep()}\n",
        ("trackers.toml: [tensorboard] key flush_secs[0]", "nested more than 64 levels")),
    "in_json_5000_digit_integer": (
        "--in_json", "meta.json", f'{{"img": {{"caption": "a", "n": {HUGE}}}}}',
        ("meta.json: key img.n (line 1)", "an integer of 5000 digits")),
    "in_json_nested_100000_deep": (
        "--in_json", "meta.json", f'{{"img": {{"caption": {_deep()}}}}}',
        ("meta.json: key img.caption[0]", "nested more than 64 levels")),
}


@pytest.mark.parametrize("case", CONFIGS)
def test_hostile_config_is_refused_naming_file_and_key(tmp_path, capsys, monkeypatch, case):
    flag, name, text, needles = CONFIGS[case]
    path = tmp_path / name
    path.write_text(text)
    monkeypatch.setattr(model_setup, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    args = train_args(tmp_path / "out", flag, str(path))
    _fails(capsys, _without_data(args) if flag == "--dataset_config" else args, *needles)


# --- metadata_cache.json (--cache_info) ---------------------------------------------------------------------------
@pytest.mark.parametrize("hostile", [f'{{"a": {_deep()}}}', f'{{"a": {{"caption": "", "resolution": [{HUGE}, 1]}}}}'],
                         ids=["nested_100000_deep", "5000_digit_integer"])
def test_hostile_metadata_cache_is_rebuilt_with_a_warning(tmp_path, capsys, hostile):
    data = tmp_path / "data"
    shutil.copytree(SAMPLES, data)
    cache = data / "10_shapes" / "metadata_cache.json"
    cache.write_text(hostile)
    assert train_network.main(train_args(tmp_path / "out", "--cache_info", "--max_train_steps", "1",
                                         data=data)) == 0
    err = capsys.readouterr().err
    assert f"{cache}: key a" in err and "scanning the folder again and rewriting it" in err, err
    assert len(json.loads(cache.read_text())) == len(list((SAMPLES / "10_shapes").glob("*.png")))


# --- sample prompt files ------------------------------------------------------------------------------------------
PROMPTS = {
    "json_nested_100000_deep": ("prompts.json", f'[{{"prompt": "a cat", "negative_prompt": {_deep()}}}]',
                                ("prompts.json: key [0].negative_prompt[0]", "nested more than 64 levels")),
    "json_5000_digit_integer": ("prompts.json", f'[{{"prompt": "a cat", "seed": {HUGE}}}]',
                                ("prompts.json: key [0].seed (line 1)", "an integer of 5000 digits")),
    "toml_nested_100000_deep": ("prompts.toml", f'[prompt]\nwidth = 64\n[[prompt.subset]]\nprompt = {_deep()}\n',
                                ("prompts.toml: [prompt.subset] key prompt[0]", "nested more than 64 levels")),
}


@pytest.mark.parametrize("case", PROMPTS)
def test_hostile_prompt_file_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch, case):
    name, text, needles = PROMPTS[case]
    prompts = tmp_path / name
    prompts.write_text(text)
    monkeypatch.setattr(model_setup, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    _fails(capsys, train_args(tmp_path / "out", "--sample_prompts", str(prompts), "--sample_at_first"),
           f"--sample_prompts {prompts}", *needles)


# --- --output_config --config_file new.toml -----------------------------------------------------------------------
FLAGS = ["--network_dim", "12", "--learning_rate", "0.0002", "--optimizer_args", "weight_decay=0.1"]


def test_output_config_writes_the_given_flags(tmp_path, capsys):
    new = tmp_path / "new.toml"
    assert train_network.main(["--output_config", "--config_file", str(new), *FLAGS]) == 0
    assert f"wrote {new}" in capsys.readouterr().out
    from tests.config_helpers import parse_args

    cfg, _ = parse_args(["--config_file", str(new)])
    assert (cfg.network.network_dim, cfg.optimizer.learning_rate) == (12, 0.0002)
    assert cfg.optimizer.optimizer_args == ["weight_decay=0.1"]
    assert "config_file" not in new.read_text() and "output_config" not in new.read_text()


def test_output_config_command_line_as_the_readme_shows_it(tmp_path):
    command = [sys.executable, str(ROOT / "train_network.py"), "--output_config", "--config_file", "new.toml", *FLAGS]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert "network_dim = 12" in (tmp_path / "new.toml").read_text()
    again = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, check=False)
    assert again.returncode == 2 and "exists" in again.stderr  # never overwritten
