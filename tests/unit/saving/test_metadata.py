"""ss_* and ModelSpec metadata: model identity hashes, ModelSpec entries from the --metadata_* flags, save-time keys.

Expected values are computed here with hashlib/base64 from sd-scripts' definitions (train_util.model_hash,
train_util.calculate_sha256, sai_model_spec.file_to_data_url / build_metadata), not with the code under test.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import os

import pytest

from library.base.errors import UserError
from library.families.sd.family import SDFamily
from library.saving.metadata import Metadata, model_identity, modelspec, thumbnail_data_url
from tests.config_helpers import parse_args

BASE = ["--pretrained_model_name_or_path", "builtin:tiny-sd15", "--train_data_dir", "x", "--output_dir", "o"]


def test_a_model_file_gets_name_legacy_hash_and_sha256(tmp_path):
    data = os.urandom(0x100000 + 0x10000 + 123)
    path = tmp_path / "model.safetensors"
    path.write_bytes(data)
    assert model_identity(str(path), "sd_model") == {
        "ss_sd_model_name": "model.safetensors",
        "ss_sd_model_hash": hashlib.sha256(data[0x100000:0x110000]).hexdigest()[:8],
        "ss_new_sd_model_hash": hashlib.sha256(data).hexdigest(),
    }


def test_a_small_file_hashes_the_empty_window(tmp_path):
    path = tmp_path / "vae.pt"
    path.write_bytes(b"tiny")
    identity = model_identity(str(path), "vae")
    assert identity["ss_vae_hash"] == hashlib.sha256(b"").hexdigest()[:8]
    assert identity["ss_new_vae_hash"] == hashlib.sha256(b"tiny").hexdigest()


def test_folders_and_builtins_are_named_only(tmp_path):
    (tmp_path / "sd15").mkdir()
    assert model_identity(str(tmp_path / "sd15"), "sd_model") == {"ss_sd_model_name": "sd15"}
    assert model_identity("builtin:tiny-sd15", "sd_model") == {"ss_sd_model_name": "builtin:tiny-sd15"}


def test_thumbnail_file_becomes_a_data_url(tmp_path):
    image = tmp_path / "thumb.png"
    image.write_bytes(b"\x89PNG fake")
    assert thumbnail_data_url(str(image)) == "data:image/png;base64," + base64.b64encode(b"\x89PNG fake").decode()
    other = tmp_path / "thumb.unknownext"
    other.write_bytes(b"x")
    assert thumbnail_data_url(str(other)).startswith("data:application/octet-stream;base64,")
    assert thumbnail_data_url("data:image/png;base64,AAAA") == "data:image/png;base64,AAAA"
    with pytest.raises(UserError, match="--metadata_thumbnail"):
        thumbnail_data_url(str(tmp_path / "missing.png"))


def test_every_metadata_flag_becomes_a_modelspec_entry():
    cfg, _ = parse_args(BASE + [
        "--metadata_author", "me", "--metadata_description", "d", "--metadata_license", "l", "--metadata_tags",
        "a,b", "--metadata_usage_hint", "hint", "--metadata_merged_from", "x,y", "--metadata_trigger_phrase", "sks",
        "--metadata_preprocessor", "pp", "--metadata_is_negative_embedding", "False", "--clip_skip", "2",
        "--min_timestep", "10"])
    spec = modelspec(cfg, SDFamily().model_ids(False, False), (64, 48), "data:image/png;base64,AA")
    assert {k: spec[f"modelspec.{k}"] for k in ("author", "description", "license", "tags", "usage_hint",
                                               "merged_from", "trigger_phrase", "preprocessor",
                                               "is_negative_embedding", "thumbnail")} == {
        "author": "me", "description": "d", "license": "l", "tags": "a,b", "usage_hint": "hint",
        "merged_from": "x,y", "trigger_phrase": "sks", "preprocessor": "pp", "is_negative_embedding": "False",
        "thumbnail": "data:image/png;base64,AA"}
    assert spec["modelspec.resolution"] == "64x48"
    assert spec["modelspec.encoder_layer"] == "2"
    assert spec["modelspec.timestep_range"] == "10,1000"  # the unset end defaults to 1000


def test_no_timestep_range_without_the_flags():
    cfg, _ = parse_args(BASE)
    spec = modelspec(cfg, SDFamily().model_ids(False, False), (64, 64), None)
    assert "modelspec.timestep_range" not in spec and "modelspec.thumbnail" not in spec
    assert "modelspec.encoder_layer" not in spec


def test_save_time_title_and_date():
    now = 1796104641.75
    untitled = Metadata({"ss_x": "1"}, {}, None, no_metadata=False).at_save(steps=3, epoch=1, now=now)
    # sai_model_spec.build_metadata: title "LoRA@<timestamp>", date = isoformat of the whole seconds
    assert untitled["modelspec.title"] == f"LoRA@{now}"
    assert untitled["modelspec.date"] == datetime.datetime.fromtimestamp(1796104641).isoformat()
    assert (untitled["ss_steps"], untitled["ss_epoch"], untitled["ss_training_finished_at"]) == ("3", "1", str(now))
    minimal = Metadata({"ss_v2": "False"}, {}, "t", no_metadata=True).at_save(steps=3, epoch=1, now=now)
    assert minimal == {"ss_v2": "False", "modelspec.title": "t", "modelspec.date": untitled["modelspec.date"]}
