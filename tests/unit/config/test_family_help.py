"""Each entry script's ``--help`` and unknown-flag messages speak of its own model family (issue 28): the model flag
names the script's own built-in tiny model (the names the README and ``library/families/*/loading.py`` give), a
shared flag the family refuses says so, and a flag of another script is named as that script's option on the command
line as in a TOML."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from library.base.errors import UserError
from tests.config_helpers import build_parser, parse_args

ROOT = Path(__file__).resolve().parents[3]
TINY = {"sd": "builtin:tiny-sd15", "sdxl": "builtin:tiny-sdxl", "flux": "builtin:tiny-flux"}
SCRIPT = {"sd": "train_network.py", "sdxl": "sdxl_train_network.py", "flux": "flux_train_network.py"}


def flag_help(family: str, flag: str) -> str:
    (action,) = [a for a in build_parser(family)._actions if f"--{flag}" in a.option_strings]
    return action.help


@pytest.mark.parametrize("family", TINY)
def test_model_flag_names_the_scripts_own_tiny_model(family):
    text = flag_help(family, "pretrained_model_name_or_path")
    assert TINY[family] in text
    assert not any(tiny in text for other, tiny in TINY.items() if other != family)


@pytest.mark.parametrize("family", ["sdxl", "flux"])
def test_the_entry_scripts_help_shows_it(family):
    out = subprocess.run([sys.executable, str(ROOT / SCRIPT[family]), "--help"], capture_output=True, text=True,
                         cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())  # argparse wraps the help lines
    assert TINY[family] in text and TINY["sd"] not in text


def test_a_missing_model_names_the_scripts_own_tiny_model():
    cfg, _ = parse_args(["--output_dir", "out", "--train_data_dir", "data"], "flux")
    from library.config import validate

    with pytest.raises(UserError) as info:
        validate(cfg)
    (message,) = [m for m in info.value.messages if m.startswith("--pretrained_model_name_or_path")]
    assert TINY["flux"] in message and TINY["sd"] not in message


def test_flux_help_says_v2_does_not_apply():
    # upstream's flux_train_network.py parser has --v2 (train_util.add_sd_models_arguments); FLUX.1 refuses it here
    text = flag_help("flux", "v2")
    assert text.startswith("not for FLUX.1") and "Stable Diffusion 2.x" in text
    assert flag_help("sd", "v2").startswith("the checkpoint is Stable Diffusion 2.x")


def test_unknown_flag_of_another_script_names_that_script():
    with pytest.raises(UserError) as info:
        parse_args(["--pretrained_model_name_or_path", TINY["sd"], "--clip_l", "x"], "sd")
    (message, _) = info.value.messages
    assert message == ("unknown flag --clip_l: it is an option for FLUX.1 (flux_train_network.py) and SD3 "
                       "(sd3_train_network.py); train_network.py trains SD 1.x/2.x LoRAs")
    assert "did you mean" not in message


def test_a_plain_unknown_flag_still_gets_a_suggestion():
    with pytest.raises(UserError) as info:
        parse_args(["--clip_skp", "2"], "flux")
    assert info.value.messages[0] == 'unknown flag --clip_skp (did you mean "clip_skip"?)'
