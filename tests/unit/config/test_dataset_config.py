"""The dataset TOML schema: every key, the fallback order, and the error messages."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from library.base.errors import UserError
from library.config import DataConfig
from library.config.dataset import load_dataset_specs, parse_config
from library.config.dataset_folders import parse_repeats_folder
from library.config.dataset_keys import DATASET_KEYS, DREAMBOOTH_ASCENDABLE_KEYS, SUBSET_ASCENDABLE_KEYS

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
    code = "import sys, library.config.dataset; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], cwd=".").returncode == 0


# Masked loss: sd-scripts' ConfigSanitizer with support_controlnet = --masked_loss (config_util.py).
def masked(tmp_path, text: str, masked_loss: bool = True, **cli):
    path = write(tmp_path, text)
    return load_dataset_specs(DataConfig(dataset_config=str(path), **cli), masked_loss)


def masked_problems(tmp_path, text: str, masked_loss: bool = True, **cli) -> str:
    with pytest.raises(UserError) as info:
        masked(tmp_path, text, masked_loss, **cli)
    return "\n".join(info.value.messages)


def test_alpha_mask_in_dreambooth_and_finetuning_subsets_and_from_the_cli(tmp_path):
    img = tmp_path / "img"
    img.mkdir()
    meta = tmp_path / "meta.json"
    meta.write_text("{}")
    spec = masked(tmp_path, f"""
        [general]
        resolution = 64
        [[datasets]]
        [[datasets.subsets]]
        image_dir = "{img}"
        alpha_mask = true
        [[datasets.subsets]]
        image_dir = "{tmp_path}"
        [[datasets]]
        [[datasets.subsets]]
        metadata_file = "{meta}"
        alpha_mask = true
    """)
    assert [[s.alpha_mask for s in ds.subsets] for ds in spec.datasets] == [[True, False], [True]]
    spec = masked(tmp_path, f"""
        [general]
        resolution = 64
        [[datasets]]
        [[datasets.subsets]]
        image_dir = "{img}"
    """, alpha_mask=True)
    assert spec.datasets[0].subsets[0].alpha_mask  # --alpha_mask is a fallback like any subset flag
    assert "belongs in a [[datasets.subsets]] table" in masked_problems(tmp_path, f"""
        [general]
        resolution = 64
        alpha_mask = true
        [[datasets]]
        [[datasets.subsets]]
        image_dir = "{img}"
    """)


def test_conditioning_data_dir_makes_a_masked_dataset(tmp_path, caplog):
    img, masks = tmp_path / "img", tmp_path / "masks"
    img.mkdir()
    masks.mkdir()
    spec = masked(tmp_path, f"""
        [general]
        resolution = 64
        class_tokens = "sks"
        caption_extension = "txt"
        [[datasets]]
        [[datasets.subsets]]
        image_dir = "{img}"
        conditioning_data_dir = "{masks}"
        cache_info = true
    """, alpha_mask=True)
    (ds,) = spec.datasets
    (sub,) = ds.subsets
    assert ds.is_dreambooth and sub.conditioning_data_dir == str(masks) and sub.caption_extension == ".txt"
    # sd-scripts' ControlNetSubset has no class_tokens / alpha_mask: they are dropped, here with a warning
    assert sub.class_tokens is None and not sub.alpha_mask and not sub.is_reg and sub.cache_info
    assert "class_tokens = 'sks' does not apply to a subset with conditioning_data_dir" in caplog.text
    assert "alpha_mask = True does not apply" in caplog.text


def test_conditioning_data_dir_needs_masked_loss(tmp_path):
    text = masked_problems(tmp_path, f"""
        [general]
        resolution = 64
        [[datasets]]
        [[datasets.subsets]]
        image_dir = "{tmp_path}"
        conditioning_data_dir = "{tmp_path}"
    """, masked_loss=False)
    assert text.endswith("datasets[0]: conditioning_data_dir (mask images, in subsets [0]) is used only with "
                         "--masked_loss; add --masked_loss (masked_loss = true in --config_file) or remove it")


def test_masked_dataset_schema_problems(tmp_path):
    text = masked_problems(tmp_path, f"""
        [general]
        resolution = 64
        conditioning_data_dir = "{tmp_path}"
        [[datasets]]
        class_tokens = "x"
        [[datasets.subsets]]
        image_dir = "{tmp_path}"
        conditioning_data_dir = "{tmp_path / 'nowhere'}"
        is_reg = true
        alpha_mask = true
        [[datasets]]
        [[datasets.subsets]]
        image_dir = "{tmp_path}"
        conditioning_data_dir = "{tmp_path}"
        [[datasets.subsets]]
        image_dir = "{tmp_path}"
        conditioning_dir = "{tmp_path}"
        [[datasets]]
        [[datasets.subsets]]
        conditioning_data_dir = "{tmp_path}"
    """)
    assert 'general: "conditioning_data_dir" belongs in a [[datasets.subsets]] table' in text
    for key in ("class_tokens", "is_reg", "alpha_mask"):
        assert f'"{key}" does not apply to a dataset whose subsets have conditioning_data_dir' in text
    assert ("datasets[1]: subsets [0] have conditioning_data_dir (mask images) but subsets [1] do not; a dataset "
            "with mask images needs them in every subset") in text
    assert 'datasets[1].subsets[1]: unknown key "conditioning_dir" (did you mean "conditioning_data_dir"?)' in text
    assert 'datasets[2].subsets[0]: required key "image_dir" is missing' in text


def test_missing_mask_folder_is_named(tmp_path):
    text = masked_problems(tmp_path, f"""
        [general]
        resolution = 64
        [[datasets]]
        [[datasets.subsets]]
        image_dir = "{tmp_path}"
        conditioning_data_dir = "{tmp_path / 'nowhere'}"
    """)
    assert f'conditioning_data_dir "{tmp_path / "nowhere"}" is not a folder' in text


def test_masked_loss_needs_a_mask_source(tmp_path, caplog):
    img = tmp_path / "img"
    img.mkdir()
    config = f"""
        [general]
        resolution = 64
        [[datasets]]
        [[datasets.subsets]]
        image_dir = "{img}"
    """
    text = masked_problems(tmp_path, config)
    assert text.startswith("--masked_loss: no subset has a loss mask; add --alpha_mask")
    assert 'conditioning_data_dir = "..."' in text
    masked(tmp_path, config, masked_loss=False)  # no masked loss, no mask: fine
    masked(tmp_path, config + f'[[datasets.subsets]]\nimage_dir = "{tmp_path}"\nalpha_mask = true\n')
    assert "--masked_loss: 1 subset(s) have no mask and train on every pixel" in caplog.text


def cli_problems(masked_loss: bool = True, **kw) -> str:
    with pytest.raises(UserError) as info:
        load_dataset_specs(DataConfig(resolution=(64, 64), **kw), masked_loss)
    return "\n".join(info.value.messages)


def test_cli_conditioning_data_dir_mirrors_the_train_folders(tmp_path):
    for name in ("train/10_a", "train/2_b", "reg/1_r", "masks/10_a", "masks/2_b"):
        (tmp_path / name).mkdir(parents=True)
    spec = load_dataset_specs(DataConfig(train_data_dir=str(tmp_path / "train"), reg_data_dir=str(tmp_path / "reg"),
                                         conditioning_data_dir=str(tmp_path / "masks"), resolution=(64, 64)), True)
    got = {s.image_dir: s.conditioning_data_dir for s in spec.datasets[0].subsets}
    assert got == {str(tmp_path / "train/10_a"): str(tmp_path / "masks/10_a"),
                   str(tmp_path / "train/2_b"): str(tmp_path / "masks/2_b"), str(tmp_path / "reg/1_r"): None}
    assert [s.class_tokens for s in spec.datasets[0].subsets] == ["a", "b", "r"]


def test_cli_conditioning_data_dir_problems(tmp_path, caplog):
    (tmp_path / "train/10_a").mkdir(parents=True)
    (tmp_path / "masks").mkdir()
    (tmp_path / "masks/a.png").write_bytes(b"")
    train, masks = str(tmp_path / "train"), str(tmp_path / "masks")
    text = cli_problems(train_data_dir=train, conditioning_data_dir=masks)
    assert f'--conditioning_data_dir "{masks}": no folder "10_a" with the masks of "{tmp_path / "train/10_a"}" ' \
           f'(it holds files directly: move the masks into {tmp_path / "masks/10_a"})' in text
    text = cli_problems(train_data_dir=train, conditioning_data_dir=masks, alpha_mask=True, masked_loss=False)
    assert "--conditioning_data_dir (mask images) is used only with --masked_loss" in text
    assert "--alpha_mask and --conditioning_data_dir are two sources of the loss mask; keep one" in text
    assert "not with --in_json" in cli_problems(in_json=str(tmp_path / "m.json"), conditioning_data_dir=masks)
    img = tmp_path / "img"
    img.mkdir()
    path = write(tmp_path, f'[general]\nresolution = 64\n[[datasets]]\n[[datasets.subsets]]\nimage_dir = "{img}"\n'
                           "alpha_mask = true\n")
    load_dataset_specs(DataConfig(dataset_config=str(path), conditioning_data_dir=masks), True)
    assert "--conditioning_data_dir ignored because --dataset_config is given" in caplog.text
