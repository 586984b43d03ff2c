"""The dataset TOML schema: every key, the fallback order, and the error messages."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from library.config import DataConfig
from library.dataset_config import (
    DATASET_KEYS,
    DREAMBOOTH_ASCENDABLE_KEYS,
    SUBSET_ASCENDABLE_KEYS,
    load_dataset_specs,
    parse_config,
    parse_repeats_folder,
)
from library.errors import UserError

# Two distinct valid TOML values per key (written as TOML) and what they resolve to.
SAMPLES = {
    "batch_size": ("2", "3", 2, 3), "bucket_no_upscale": ("true", "false", True, False),
    "bucket_reso_steps": ("64", "128", 64, 128), "enable_bucket": ("true", "false", True, False),
    "max_bucket_reso": ("1024", "2048", 1024, 2048), "min_bucket_reso": ("64", "128", 64, 128),
    "validation_seed": ("1", "2", 1, 2), "validation_split": ("0.0", "0.0", 0.0, 0.0),
    "resolution": ("64", "[96, 64]", (64, 64), (96, 64)), "network_multiplier": ("0.5", "2", 0.5, 2.0),
    "resize_interpolation": ('"lanczos"', '"area"', "lanczos", "area"),
    "color_aug": ("true", "false", True, False),
    "face_crop_aug_range": ("[1.0, 2.0]", "[2, 3]", (1.0, 2.0), (2.0, 3.0)),
    "flip_aug": ("true", "false", True, False), "num_repeats": ("3", "4", 3, 4),
    "random_crop": ("true", "false", True, False), "shuffle_caption": ("true", "false", True, False),
    "keep_tokens": ("1", "2", 1, 2), "keep_tokens_separator": ('"|||"', '"###"', "|||", "###"),
    "secondary_separator": ('";;;"', '"@@"', ";;;", "@@"), "caption_separator": ('"."', '";"', ".", ";"),
    "enable_wildcard": ("true", "false", True, False), "token_warmup_min": ("2", "3", 2, 3),
    "token_warmup_step": ("10", "0.5", 10, 0.5), "caption_prefix": ('"a"', '"b"', "a", "b"),
    "caption_suffix": ('"c"', '"d"', "c", "d"), "custom_attributes": ("{ x = 1 }", "{ y = 2 }", {"x": 1}, {"y": 2}),
    "caption_dropout_every_n_epochs": ("2", "3", 2, 3), "caption_dropout_rate": ("0.1", "0.2", 0.1, 0.2),
    "caption_tag_dropout_rate": ("0.3", "0.4", 0.3, 0.4), "caption_extension": ('".txt"', '".cap"', ".txt", ".cap"),
    "class_tokens": ('"sks"', '"dog"', "sks", "dog"), "cache_info": ("true", "false", True, False),
}


def write(tmp_path, text: str, name: str = "dataset.toml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def load(tmp_path, text: str, **cli):
    path = write(tmp_path, text)
    return load_dataset_specs(DataConfig(dataset_config=str(path), **cli))


def problems(tmp_path, text: str, **cli) -> list[str]:
    with pytest.raises(UserError) as info:
        load(tmp_path, text, **cli)
    return info.value.messages


def test_samples_cover_every_key():
    assert set(SAMPLES) == set(DATASET_KEYS) | set(SUBSET_ASCENDABLE_KEYS) | set(DREAMBOOTH_ASCENDABLE_KEYS)


def test_config_with_every_key_loads(tmp_path):
    img = tmp_path / "img"
    img.mkdir()
    general = "\n".join(f"{k} = {v[0]}" for k, v in SAMPLES.items())
    spec = load(tmp_path, f"""
        [general]
        {general}
        [[datasets]]
        [[datasets.subsets]]
        image_dir = "{img}"
        is_reg = true
    """.replace("\n        ", "\n"))
    (dataset,) = spec.datasets
    (subset,) = dataset.subsets
    for key, (_, _, value, _) in SAMPLES.items():
        owner = dataset if key in DATASET_KEYS else subset
        if hasattr(owner, key):
            assert getattr(owner, key) == value, key
    assert subset.is_reg and subset.image_dir == str(img)


SUBSET_LEVEL = sorted((set(SUBSET_ASCENDABLE_KEYS) | set(DREAMBOOTH_ASCENDABLE_KEYS)) - {"cache_info"})


@pytest.mark.parametrize("key", SUBSET_LEVEL)
def test_subset_key_fallback_order(tmp_path, key):
    """subset → dataset → general; each level set to a different value, the most specific wins."""
    img = tmp_path / "img"
    img.mkdir()
    general_value, dataset_value, general_expected, dataset_expected = SAMPLES[key]

    def spec_for(subset_line: str, dataset_line: str):
        return load(tmp_path, f"""
            [general]
            resolution = 64
            {key} = {general_value}
            [[datasets]]
            {dataset_line}
            [[datasets.subsets]]
            image_dir = "{img}"
            {subset_line}
        """).datasets[0].subsets[0]

    assert getattr(spec_for("", ""), key) == general_expected
    assert getattr(spec_for("", f"{key} = {dataset_value}"), key) == dataset_expected
    assert getattr(spec_for(f"{key} = {general_value}", f"{key} = {dataset_value}"), key) == general_expected


@pytest.mark.parametrize("key", sorted(DATASET_KEYS))
def test_dataset_key_fallback_order(tmp_path, key):
    img = tmp_path / "img"
    img.mkdir()
    general_value, dataset_value, general_expected, dataset_expected = SAMPLES[key]
    resolution = "" if key == "resolution" else "resolution = 64"

    def spec_for(general_line: str, dataset_line: str):
        return load(tmp_path, f"""
            [general]
            {resolution}
            {general_line}
            [[datasets]]
            {dataset_line}
            [[datasets.subsets]]
            image_dir = "{img}"
        """, resolution=(512, 512)).datasets[0]

    assert getattr(spec_for(f"{key} = {general_value}", ""), key) == general_expected
    assert getattr(spec_for(f"{key} = {general_value}", f"{key} = {dataset_value}"), key) == dataset_expected


def test_file_beats_cli_beats_default(tmp_path):
    img = tmp_path / "img"
    img.mkdir()
    base = f"""
        [general]
        resolution = 64
        {{general}}
        [[datasets]]
        [[datasets.subsets]]
        image_dir = "{img}"
    """
    sub = load(tmp_path, base.format(general="keep_tokens = 2"), keep_tokens=5).datasets[0].subsets[0]
    assert sub.keep_tokens == 2
    sub = load(tmp_path, base.format(general=""), keep_tokens=5, caption_extension="txt").datasets[0].subsets[0]
    assert sub.keep_tokens == 5 and sub.caption_extension == ".txt"  # dot prepended as sd-scripts does
    ds = load(tmp_path, base.format(general=""), train_batch_size=4, dataset_repeats=3).datasets[0]
    assert ds.batch_size == 4 and ds.subsets[0].num_repeats == 3  # CLI names mapped to config names
    sub = load(tmp_path, base.format(general="")).datasets[0].subsets[0]
    assert sub.keep_tokens == 0 and sub.caption_extension == ".caption" and sub.secondary_separator is None


def test_unknown_key_names_file_table_and_suggestion(tmp_path):
    img = tmp_path / "img"
    img.mkdir()
    messages = problems(tmp_path, f"""
        [general]
        resolution = 64
        [[datasets]]
        [[datasets.subsets]]
        image_dir = "{img}"
        [[datasets.subsets]]
        image_dir = "{img}"
        num_repeat = 10
    """)
    path = tmp_path / "dataset.toml"
    assert messages == [f'{path}: datasets[0].subsets[1]: unknown key "num_repeat" (did you mean "num_repeats"?)']


def test_every_problem_is_reported_at_once(tmp_path):
    messages = problems(tmp_path, """
        bogus = 1
        [general]
        resolution = "big"
        shufle_caption = true
        [[datasets]]
        batch_size = 1.5
        [[datasets.subsets]]
        num_repeats = 2
        batch_size = 2
        flip_aug = "yes"
    """)
    text = "\n".join(messages)
    assert len(messages) == 7, text
    assert 'unknown top-level key "bogus"' in text
    assert 'general: "resolution" = \'big\': expected a positive integer or [width, height]' in text
    assert 'general: unknown key "shufle_caption" (did you mean "shuffle_caption"?)' in text
    assert 'datasets[0]: "batch_size" = 1.5: expected an integer' in text
    assert 'datasets[0].subsets[0]: "batch_size" is a dataset-level key' in text
    assert 'datasets[0].subsets[0]: "flip_aug" = \'yes\': expected true or false' in text
    assert 'datasets[0].subsets[0]: required key "image_dir" is missing' in text


def test_missing_required_key_and_mixed_kinds(tmp_path):
    messages = problems(tmp_path, """
        [general]
        resolution = 64
        [[datasets]]
        [[datasets.subsets]]
        num_repeats = 2
        [[datasets]]
        [[datasets.subsets]]
        image_dir = "a"
        [[datasets.subsets]]
        metadata_file = "m.json"
    """)
    text = "\n".join(messages)
    assert 'datasets[0].subsets[0]: required key "image_dir" is missing' in text
    assert "datasets[1]: DreamBooth subsets (image_dir only) and fine-tuning subsets (metadata_file) cannot be mixed" \
        in text


def test_value_checks_after_schema(tmp_path):
    messages = problems(tmp_path, f"""
        [general]
        enable_bucket = true
        bucket_reso_steps = 32
        caption_dropout_rate = 1.5
        [[datasets]]
        [[datasets.subsets]]
        image_dir = "{tmp_path / 'missing'}"
    """)
    text = "\n".join(messages)
    assert "resolution is required" in text
    assert "bucket_reso_steps is 32; it must be a multiple of 64" in text
    assert "caption_dropout_rate must be between 0 and 1, got 1.5" in text
    assert f'image_dir "{tmp_path / "missing"}" is not a folder' in text


def test_json_config_and_bad_syntax(tmp_path):
    img = tmp_path / "img"
    img.mkdir()
    path = write(tmp_path, f'{{"general": {{"resolution": [96, 64]}}, "datasets": [{{"subsets": '
                           f'[{{"image_dir": "{img}"}}]}}]}}', "d.json")
    spec = load_dataset_specs(DataConfig(dataset_config=str(path)))
    assert spec.datasets[0].resolution == (96, 64)
    bad = write(tmp_path, "[general\nresolution = 64", "bad.toml")
    with pytest.raises(UserError, match="bad.toml: not valid TOML"):
        load_dataset_specs(DataConfig(dataset_config=str(bad)))
    with pytest.raises(UserError, match="expected a .toml or .json file"):
        load_dataset_specs(DataConfig(dataset_config=str(write(tmp_path, "x", "d.yaml"))))


def test_finetuning_subset_rejects_dreambooth_keys(tmp_path):
    meta = tmp_path / "meta.json"
    meta.write_text("{}")
    messages = problems(tmp_path, f"""
        [general]
        resolution = 64
        [[datasets]]
        class_tokens = "x"
        [[datasets.subsets]]
        metadata_file = "{meta}"
        is_reg = true
    """)
    text = "\n".join(messages)
    assert 'datasets[0]: "class_tokens" is only for DreamBooth' in text
    assert 'datasets[0].subsets[0]: "is_reg" is only for DreamBooth (image folder) subsets' in text


def test_parse_config_directly_keeps_file_location():
    spec_messages = []
    try:
        parse_config({"datasets": []}, "x.toml", DataConfig())
    except UserError as e:
        spec_messages = e.messages
    assert spec_messages and spec_messages[0].startswith("x.toml: no [[datasets]]")


def test_repeats_folder_names():
    assert parse_repeats_folder("10_sks dog") == (10, "sks dog")
    assert parse_repeats_folder("5_a_b") == (5, "a_b")
    assert parse_repeats_folder("3") == (3, "")
    assert parse_repeats_folder("cat_10") is None


def test_import_does_not_load_torch():
    code = "import sys, library.dataset_config; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], cwd=".").returncode == 0
