"""Trackers: ``--log_config``, ``--log_tracker_config`` and ``--wandb_api_key`` as sd-scripts' ``init_trackers`` /
``prepare_accelerator`` use them (wandb replaced by a recording fake: it is not installed here)."""

from __future__ import annotations

import importlib.machinery
import json
import os
import sys
import types

import pytest

from library.base.errors import UserError
from library.config import public_snapshot, validate
from library.train.tracking import Tracker, tracker_config
from tests.config_helpers import parse_args

BASE = ["--pretrained_model_name_or_path", "/models/secret_model.safetensors", "--output_dir", "/srv/me/out",
        "--train_data_dir", "/srv/me/data", "--network_dim", "8", "--network_args", "conv_dim=4"]


def config(*extra: str):
    return parse_args(BASE + list(extra))[0]


@pytest.fixture
def fake_wandb(monkeypatch):
    calls = []
    module = types.ModuleType("wandb")
    module.__spec__ = importlib.machinery.ModuleSpec("wandb", None)

    class Run:
        def log(self, values, step):
            calls.append(("log", values, step))

        def finish(self):
            calls.append(("finish",))

    def init(**kwargs):
        calls.append(("init", kwargs))
        return Run()

    module.login = lambda key: calls.append(("login", key))
    module.init = init
    monkeypatch.setitem(sys.modules, "wandb", module)
    monkeypatch.delenv("WANDB_DIR", raising=False)
    return calls


def test_tracker_config_drops_secrets_and_paths_and_stringifies():
    cfg = config("--wandb_api_key", "KEY123", "--log_config")
    values = tracker_config(public_snapshot(cfg))
    # sd-scripts' get_sanitized_config_or_none: these never reach a tracker
    for name in ("wandb_api_key", "huggingface_token", "pretrained_model_name_or_path", "output_dir",
                 "train_data_dir", "reg_data_dir", "vae", "logging_dir", "tokenizer_cache_dir"):
        assert name not in values
    assert values["network_dim"] == 8 and values["log_config"] is True and values["learning_rate"] == 2e-6
    assert values["network_args"] == "['conv_dim=4']"  # lists as their str, as sd-scripts
    assert "KEY123" not in json.dumps(values)


def test_public_snapshot_blanks_the_key_for_files():
    snapshot = public_snapshot(config("--wandb_api_key", "KEY123"))
    assert snapshot["log"]["wandb_api_key"] is None and "KEY123" not in json.dumps(snapshot, default=str)


def test_wandb_login_before_init_config_only_with_log_config(fake_wandb, tmp_path):
    cfg = config("--log_with", "wandb", "--wandb_api_key", "KEY123", "--wandb_run_name", "run1")
    Tracker(cfg.log, public_snapshot(cfg)).close()
    assert fake_wandb[0] == ("login", "KEY123")
    assert fake_wandb[1] == ("init", {"project": "network_train", "config": None, "name": "run1"})
    fake_wandb.clear()
    cfg = config("--log_with", "wandb", "--log_config", "--log_tracker_name", "proj", "--logging_dir",
                 str(tmp_path / "logs"))
    Tracker(cfg.log, public_snapshot(cfg)).close()
    kind, kwargs = fake_wandb[0]
    assert kind == "init" and kwargs["project"] == "proj" and kwargs["config"]["network_dim"] == 8
    assert "output_dir" not in kwargs["config"] and "wandb_api_key" not in kwargs["config"]
    assert os.environ["WANDB_DIR"] == str(tmp_path / "logs")  # sd-scripts' prepare_accelerator


def test_log_tracker_config_tables_are_init_kwargs(fake_wandb, tmp_path):
    toml = tmp_path / "trackers.toml"
    toml.write_text('[wandb]\nentity = "team"\ntags = ["a", "b"]\nname = "from-file"\n'
                    '[tensorboard]\nfilename_suffix = ".mine"\n')
    cfg = config("--log_with", "all", "--logging_dir", str(tmp_path / "tb"), "--log_tracker_config", str(toml),
                 "--wandb_run_name", "from-flag")
    tracker = Tracker(cfg.log, public_snapshot(cfg))
    tracker.log({"loss/current": 1.0}, 1)
    tracker.close()
    kwargs = next(c[1] for c in fake_wandb if c[0] == "init")
    assert kwargs["entity"] == "team" and kwargs["tags"] == ["a", "b"] and kwargs["name"] == "from-file"
    assert [p.name for p in (tmp_path / "tb").rglob("events.out.tfevents.*")][0].endswith(".mine")


@pytest.mark.parametrize("body, needle", [
    ("[comet_ml]\nx = 1\n", "[comet_ml]: this trainer logs only to tensorboard and wandb"),
    ("[tensorboard]\nlog_dir = 'x'\n", '[tensorboard] unknown option "log_dir"'),
    ("wandb = 3\n", "wandb must be a table"),
    ("[wandb\n", "not valid TOML"),
])
def test_bad_tracker_config_is_refused_before_loading(tmp_path, body, needle):
    toml = tmp_path / "trackers.toml"
    toml.write_text(body)
    with pytest.raises(UserError) as info:
        validate(config("--logging_dir", str(tmp_path), "--log_tracker_config", str(toml)))
    assert any(needle in m for m in info.value.messages)


def test_missing_tracker_config_and_missing_wandb_are_refused_before_loading(tmp_path):
    with pytest.raises(UserError, match="--log_tracker_config .*nowhere.toml: file not found"):
        validate(config("--logging_dir", str(tmp_path), "--log_tracker_config", str(tmp_path / "nowhere.toml")))
    if importlib.util.find_spec("wandb") is None:
        with pytest.raises(UserError, match="--log_with wandb: the wandb package is not installed"):
            validate(config("--log_with", "wandb"))
    with pytest.raises(UserError, match="--log_with tensorboard needs --logging_dir"):
        validate(config("--log_with", "tensorboard"))


def test_tracker_flags_without_a_tracker_warn(caplog):
    validate(config("--log_config", "--wandb_api_key", "k"))
    assert "--log_config, --wandb_api_key: no effect without a tracker" in caplog.text


def _tensorboard_tags(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    texts, plugins = {}, set()
    for event_file in folder.rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(event_file), size_guidance={"tensors": 0})
        acc.Reload()
        for tag in acc.Tags()["tensors"]:
            texts[tag] = acc.Tensors(tag)[0].tensor_proto.string_val[0].decode()
        try:
            plugins |= set(acc.PluginTagToContent("hparams"))
        except KeyError:  # no hparams in this file
            pass
    return texts, plugins


def test_tensorboard_gets_config_text_and_hparams_only_with_log_config(tmp_path):
    cfg = config("--logging_dir", str(tmp_path / "with"), "--log_config", "--wandb_api_key", "KEY123")
    Tracker(cfg.log, public_snapshot(cfg)).close()
    texts, hparams = _tensorboard_tags(tmp_path / "with")
    text = next(v for k, v in texts.items() if k.startswith("config"))
    assert "network_dim = 8" in text and "KEY123" not in text and "secret_model" not in text
    assert "_hparams_/session_start_info" in hparams
    cfg = config("--logging_dir", str(tmp_path / "without"))
    Tracker(cfg.log, public_snapshot(cfg)).close()
    texts, hparams = _tensorboard_tags(tmp_path / "without")
    assert not texts and not hparams
