"""Flag parsing, --config_file precedence and strictness, --output_config, cross-field validation."""

import pytest

from library.base.errors import UserError
from library.config import validate
from library.config.cli import write_config_file
from tests.config_helpers import parse_args

BASE = ["--pretrained_model_name_or_path", "builtin:tiny-sd15", "--output_dir", "out", "--train_data_dir", "data"]


def _messages(exc_info) -> str:
    return "\n".join(exc_info.value.messages)


def test_kohya_defaults():
    cfg, explicit = parse_args(BASE)
    assert cfg.optimizer.learning_rate == 2e-6
    assert cfg.schedule.max_train_steps == 1600
    assert cfg.data.caption_extension == ".caption"
    assert cfg.optimizer.max_grad_norm == 1.0
    assert cfg.data.max_data_loader_n_workers == 8
    assert set(explicit) == {"pretrained_model_name_or_path", "output_dir", "train_data_dir"}


def test_values_are_typed():
    cfg, _ = parse_args(BASE + ["--resolution", "768,512", "--network_dim", "16", "--lr_warmup_steps", "10%",
                                "--optimizer_args", "betas=0.9,0.99", "weight_decay=0.1", "--shuffle_caption"])
    assert cfg.data.resolution == (768, 512)
    assert cfg.network.network_dim == 16
    assert cfg.schedule.lr_warmup_steps == pytest.approx(0.1)
    assert cfg.optimizer.optimizer_args == ["betas=0.9,0.99", "weight_decay=0.1"]
    assert cfg.data.shuffle_caption is True


def test_unknown_flag_suggests_the_closest():
    with pytest.raises(UserError) as info:
        parse_args(BASE + ["--network_dimm", "4"])
    assert 'did you mean "network_dim"' in _messages(info)


def test_bad_choice_names_the_flag():
    with pytest.raises(UserError) as info:
        parse_args(BASE + ["--mixed_precision", "fp8"])
    assert "--mixed_precision" in _messages(info)


def test_config_file_sections_flattened_and_cli_wins(tmp_path):
    toml = tmp_path / "args.toml"
    toml.write_text('[model]\npretrained_model_name_or_path = "m"\n[train]\nlearning_rate = 1e-4\n'
                    'network_dim = 8\noptimizer_args = ["weight_decay=0.1"]\n')
    cfg, _ = parse_args(["--config_file", str(toml), "--learning_rate", "5e-4"])
    assert cfg.model.pretrained_model_name_or_path == "m"
    assert cfg.optimizer.learning_rate == 5e-4
    assert cfg.network.network_dim == 8
    assert cfg.optimizer.optimizer_args == ["weight_decay=0.1"]


def test_config_file_extension_is_optional(tmp_path):
    (tmp_path / "args.toml").write_text("network_dim = 2\n")
    cfg, _ = parse_args(["--config_file", str(tmp_path / "args")])
    assert cfg.network.network_dim == 2


def test_config_file_unknown_keys_all_reported_with_location(tmp_path):
    toml = tmp_path / "args.toml"
    toml.write_text('[train]\nlearning_rat = 1e-4\n[net]\nnetwork_dimm = 4\n')
    with pytest.raises(UserError) as info:
        parse_args(["--config_file", str(toml)])
    text = _messages(info)
    assert f'{toml}: [train] unknown key "learning_rat" (did you mean "learning_rate"?)' in text
    assert '[net] unknown key "network_dimm" (did you mean "network_dim"?)' in text


def test_config_file_type_errors(tmp_path):
    toml = tmp_path / "args.toml"
    toml.write_text('network_dim = "eight"\nshuffle_caption = 2\nlearning_rate = 0.5e\n'.replace("0.5e", "'x'"))
    with pytest.raises(UserError) as info:
        parse_args(["--config_file", str(toml)])
    text = _messages(info)
    assert "network_dim = 'eight': expected an integer" in text
    assert "shuffle_caption = 2: expected true or false (or 1 / 0)" in text
    assert "learning_rate = 'x': expected a number" in text


def test_config_file_duplicate_key(tmp_path):
    toml = tmp_path / "args.toml"
    toml.write_text("[a]\nnetwork_dim = 4\n[b]\nnetwork_dim = 8\n")
    with pytest.raises(UserError, match="also set in"):
        parse_args(["--config_file", str(toml)])


def test_missing_config_file(tmp_path):
    with pytest.raises(UserError, match="file not found"):
        parse_args(["--config_file", str(tmp_path / "nope.toml")])


def test_legacy_optimizer_switches():
    cfg, _ = parse_args(BASE + ["--use_8bit_adam"])
    assert cfg.optimizer.optimizer_type == "AdamW8bit"
    with pytest.raises(UserError, match="cannot be combined"):
        parse_args(BASE + ["--use_8bit_adam", "--optimizer_type", "Lion"])


def test_legacy_caption_extention_spelling():
    cfg, _ = parse_args(BASE + ["--caption_extention", ".txt"])
    assert cfg.data.caption_extension == ".txt"


def test_output_config_round_trip_and_no_overwrite(tmp_path):
    target = tmp_path / "saved.toml"
    _, explicit = parse_args(BASE + ["--network_dim", "12", "--resolution", "512"])
    write_config_file(str(target), explicit)
    cfg, _ = parse_args(["--config_file", str(target)])
    assert cfg.network.network_dim == 12 and cfg.data.resolution == (512, 512)
    with pytest.raises(UserError, match="exists"):
        write_config_file(str(target), explicit)


@pytest.mark.parametrize("extra,needle", [
    (["--full_bf16"], "--full_bf16 needs --mixed_precision bf16"),
    (["--full_fp16", "--mixed_precision", "bf16"], "--full_fp16 needs --mixed_precision fp16"),
    (["--network_train_unet_only", "--network_train_text_encoder_only"], "exclude each other"),
    (["--gradient_accumulation_steps", "0"], "--gradient_accumulation_steps 0: must be at least 1"),
    (["--network_dropout", "1.5"], "--network_dropout 1.5: must be in [0, 1)"),
    (["--max_token_length", "100"], "must be 75, 150 or 225"),
    (["--cache_latents", "--color_aug"], "latents cannot be cached"),
])
def test_cross_field_validation(extra, needle):
    cfg, _ = parse_args(BASE + extra)
    with pytest.raises(UserError) as info:
        validate(cfg)
    assert needle in _messages(info)


def test_validation_reports_every_problem_at_once():
    cfg, _ = parse_args(["--full_bf16", "--network_dim", "0"])
    with pytest.raises(UserError) as info:
        validate(cfg)
    assert len(info.value.messages) >= 4  # model, output_dir, data, full_bf16, network_dim


def test_xformers_without_package_is_not_refused():
    cfg, _ = parse_args(BASE + ["--xformers"])
    validate(cfg)  # the UNet gets scaled-dot-product attention then, with an info line (families/model_setup.py)
