"""``ss_text_encoder_lr`` and the implementation entries as sd-scripts 48d368fa writes them.

Upstream's ``train_network.py`` writes ``"ss_text_encoder_lr": text_encoder_lr`` stringified, where
``text_encoder_lr`` is what it hands the network: for ``networks.lora`` (no
``prepare_optimizer_params_with_multiple_te_lrs``) the first ``--text_encoder_lr`` value (``str(5e-05)`` =
"5e-05"), None when not given; the list only for a network with that method. Its commit entries are
``train_util.get_git_revision_hash()`` (40 hex digits, or "(unknown)") and
``sai_model_spec.get_implementation_version`` ("sd-scripts/<commit>"); here both name this trainer instead (the
decision is documented in ``library/saving/metadata.py``)."""

from __future__ import annotations

import re

import pytest

from library.families.sdxl.family import SDXLFamily
from library.saving.metadata import training_metadata
from library.train.steps import plan_steps
from tests.config_helpers import parse_args

BASE = ["--pretrained_model_name_or_path", "builtin:tiny-sdxl", "--train_data_dir", "x", "--output_dir", "o"]


def metadata(*flags: str, **kwargs) -> dict[str, str]:
    cfg, _ = parse_args([*BASE, *flags], family="sdxl")
    plan = plan_steps(4, batch_size=1, gradient_accumulation_steps=1, num_processes=1, max_train_steps=2)
    return training_metadata(cfg, plan, SDXLFamily().model_ids(False, False), seed=1, thumbnail=None,
                             dataset_meta={}, network_meta={}, optimizer_name="AdamW", stochastic_rounding=False,
                             num_train_images=4, num_reg_images=0, resolution=(64, 64), started=0.0,
                             **kwargs).at_save(steps=1, epoch=1, now=0.0)


@pytest.mark.parametrize("flags,expected", [
    ((), "None"),
    (("--text_encoder_lr", "5e-5"), str(5e-5)),
    (("--text_encoder_lr", "5e-5", "2e-5"), str(5e-5)),  # upstream's networks.lora: the first value only
])
def test_text_encoder_lr_is_the_first_value_by_default(flags, expected):
    assert metadata(*flags)["ss_text_encoder_lr"] == expected


def test_text_encoder_lr_is_what_the_network_was_given():
    given = [1e-5, 2e-5]  # this trainer's per-encoder LRs, or a network with the multiple-LR method
    assert metadata("--text_encoder_lr", "1e-5", "2e-5", text_encoder_lr=given)["ss_text_encoder_lr"] == str(given)
    assert metadata("--text_encoder_lr", "5e-5", text_encoder_lr=[5e-5])["ss_text_encoder_lr"] == "[5e-05]"


def test_commit_entries_name_this_trainer_and_no_upstream_commit():
    meta = metadata()
    value = meta["ss_sd_scripts_commit_hash"]
    assert value == meta["modelspec.implementation_version"] == "sd-scripts-bf16/0.1"
    assert not re.fullmatch(r"[0-9a-f]{40}", value) and value != "(unknown)" and not value.startswith("sd-scripts/")
    name, version = value.split("/")  # upstream's implementation_version form, "<implementation>/<version>"
    assert name == "sd-scripts-bf16" and version
