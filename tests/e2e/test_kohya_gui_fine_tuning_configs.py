"""The kohya_ss GUI's DreamBooth and Finetune TOMLs run with our full fine-tuning scripts:
``tests/data/kohya_gui/dreambooth/*.toml`` and ``tests/data/kohya_gui/finetune/*.toml``.

Each file is the ``--config_file`` TOML that the GUI's ``train_model`` (bmaltais/kohya_ss 45088f04,
``dreambooth_gui.py`` / ``finetune_gui.py``) writes for one tab state (see its header), with only the paths as
placeholders. The GUI runs it with ``train_db.py`` (DreamBooth, SD 1.5), ``fine_tune.py`` (Finetune, SD 1.5) or
``sdxl_train.py`` (either tab with an SDXL model); so do these tests, through ``train_network.main`` with the
script's name, as our entry scripts do. The files parse, validate, name the GUI's own fields in one info line, and
train 2 steps on the tiny model into the checkpoint their ``save_model_as`` asks for. The command line overrides
what the LoRA GUI tests override, for speed: ``--max_train_steps 2 --resolution 64 --min_bucket_reso 64
--max_data_loader_n_workers 0``. For the Finetune files the test first makes the caption metadata that the GUI makes
before training (``finetune/merge_captions_to_metadata.py`` with the GUI's arguments).

What the GUI's values must do here (read off the files, as sd-scripts 48d368fa reads them):
``stop_text_encoder_training`` is a flag of ``train_db.py`` (the DreamBooth tab writes its "Stop TE" slider's number
unchanged) and stops the text encoder after that many updates; ``learning_rate_te`` is its learning rate;
``train_text_encoder`` / ``learning_rate_te1`` / ``learning_rate_te2`` choose what ``sdxl_train.py`` trains;
``in_json`` and ``dataset_repeats`` make the Finetune tab's dataset. Where a GUI field asks for what the script
lacks, the run stops with exit code 2 and a message that names the fix.
"""

from __future__ import annotations

import importlib.util
import logging
import tomllib
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import train_network
from finetune import merge_captions_to_metadata
from library.config import validate
from tests.config_helpers import parse_args
from tests.e2e.gui_configs import fill_gui_config

ROOT = Path(__file__).resolve().parents[2]
GUI_DIR = ROOT / "tests" / "data" / "kohya_gui"
SPEED_OVERRIDES = ["--max_train_steps", "2", "--resolution", "64", "--min_bucket_reso", "64",
                   "--max_data_loader_n_workers", "0"]
# The script the GUI runs for each file (dreambooth_gui.py / finetune_gui.py train_model), and the tiny model.
SCRIPTS = {"train_db.py": ("sd", "builtin:tiny-sd15"), "fine_tune.py": ("sd", "builtin:tiny-sd15"),
           "sdxl_train.py": ("sdxl", "builtin:tiny-sdxl")}
CONFIGS = {"dreambooth/sd15_default": "train_db.py", "dreambooth/sd15_stop_te_lr_te": "train_db.py",
           "dreambooth/sdxl_default": "sdxl_train.py", "finetune/sd15_caption_metadata": "fine_tune.py",
           "finetune/sdxl_caption_metadata": "sdxl_train.py"}
# Key prefixes of a single-file checkpoint in the original (Stability AI) layout: U-Net, text encoder(s), VAE.
LAYOUT = {"sd": ("model.diffusion_model.", "cond_stage_model.transformer.", "first_stage_model."),
          "sdxl": ("model.diffusion_model.", "conditioner.embedders.0.transformer.", "conditioner.embedders.1.model.",
                   "first_stage_model.")}
XFORMERS_RUNS = importlib.util.find_spec("xformers") is not None and torch.cuda.is_available()
ARCHITECTURE = {"sd": "stable-diffusion-v1", "sdxl": "stable-diffusion-xl-v1-base"}
# A second run of the "Stop TE" file, to see what each update trained: it also saves after update 1, in fp32 (an update
# at the GUI's learning rates, 1e-5, is below fp16's resolution, so its save_precision = "fp16" would hide it), and
# trains without mixed precision: under the GUI's fp16 the dynamic loss scaling skips update 2 as non-finite under
# some seeds (the GUI writes none), and the U-Net then does not move in it either.
STOP_TE = "dreambooth/sd15_stop_te_lr_te"
STOP_TE_SAVES = ("--save_every_n_steps", "1", "--save_precision", "float", "--mixed_precision", "no")


def gui_values(name: str) -> dict:
    return tomllib.loads((GUI_DIR / f"{name}.toml").read_text(encoding="utf-8"))


def materialise(name: str, where: Path, images: Path) -> Path:
    """The GUI file with its placeholders filled in, in a fresh folder. A Finetune file's image folder is flat
    (``@TRAIN_DATA_DIR@``) and its metadata is made in ``@TRAIN_DIR@`` as the GUI makes it: ``--caption_extension
    <its caption extension> IMAGES TRAIN_DIR/meta_cap.json --full_path``."""
    model = SCRIPTS[CONFIGS[name]][1]
    placeholders = {}
    if name.startswith("finetune/"):
        placeholders = {"@TRAIN_DATA_DIR@": where / "data" / "10_shapes", "@TRAIN_DIR@": where / "train"}
    file = fill_gui_config(GUI_DIR / f"{name}.toml", where, images, model, placeholders=placeholders)
    if placeholders:
        (where / "train").mkdir()
        values = gui_values(name)
        rc = merge_captions_to_metadata.main(["--caption_extension", values["caption_extension"],
                                              str(placeholders["@TRAIN_DATA_DIR@"]),
                                              str(where / "train" / "meta_cap.json"), "--full_path"])
        assert rc == 0
    return file


class Run:
    """One training run of a GUI file: its exit code, output folder and what it printed (stderr, then stdout)."""

    def __init__(self, rc: int, out: Path, printed: str) -> None:
        self.rc, self.out, self.printed = rc, out, printed


@pytest.fixture(scope="module")
def trained(tmp_path_factory, images):
    """``(name, extra flags) -> Run``: each GUI file trained once for the module with the same flags."""
    runs: dict[tuple[str, tuple[str, ...]], Run] = {}

    def run(name: str, capsys, extra: tuple[str, ...] = ()) -> Run:
        if (name, extra) not in runs:
            where = tmp_path_factory.mktemp("gui_ft") / name.replace("/", "_")
            file = materialise(name, where, images)
            capsys.readouterr()
            rc = train_network.main(["--config_file", str(file), *SPEED_OVERRIDES, *extra],
                                    family=SCRIPTS[CONFIGS[name]][0], script=CONFIGS[name])
            captured = capsys.readouterr()
            runs[name, extra] = Run(rc, where / "out", captured.err + captured.out)
        return runs[name, extra]

    return run


def test_every_file_is_here_with_its_header():
    found = {f"{p.parent.name}/{p.stem}" for d in ("dreambooth", "finetune") for p in (GUI_DIR / d).glob("*.toml")}
    # the FLUX.1 files (flux_train.py) are test_kohya_gui_flux_fine_tuning.py's
    assert {n for n in found if not n.split("/")[1].startswith("flux1_")} == set(CONFIGS)
    for name in CONFIGS:
        tab = "DreamBooth" if name.startswith("dreambooth/") else "Finetune"
        text = (GUI_DIR / f"{name}.toml").read_text(encoding="utf-8")
        assert text.startswith(f"# kohya_ss GUI (bmaltais/kohya_ss 45088f04), {tab} tab, ")
        assert CONFIGS[name] in text.split("\n# The --config_file")[0]  # the header names the script the GUI runs


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_parses_and_validates(name, tmp_path, images, caplog):
    file = materialise(name, tmp_path / "cfg", images)
    with caplog.at_level(logging.INFO, logger="library.config.cli"):
        cfg, _ = parse_args(["--config_file", str(file)], script=CONFIGS[name])
    validate(cfg)
    gui_lines = [r.getMessage() for r in caplog.records if "kohya_ss GUI field" in r.getMessage()]
    assert len(gui_lines) == 1
    values = gui_values(name)
    gui_only = {"noise_offset_type", "wandb_run_name"} | ({"epoch"} if "epoch" in values else set())
    assert all(f"{k}: " in gui_lines[0] for k in gui_only)
    assert cfg.optimizer.learning_rate == values["learning_rate"]
    section = cfg.family_config
    for key in ("learning_rate_te", "learning_rate_te1", "learning_rate_te2", "train_text_encoder",
                "stop_text_encoder_training"):
        if key in values:  # a flag of this script: read as the flag, not as a GUI field
            assert getattr(section, key) == values[key] and f"{key}: " not in gui_lines[0]
    if "in_json" in values:
        assert cfg.data.in_json == str(tmp_path / "cfg" / "train" / "meta_cap.json")
        assert cfg.data.dataset_repeats == values["dataset_repeats"]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_trains_two_steps_into_the_checkpoint_asked_for(name, trained, capsys):
    run = trained(name, capsys)
    assert run.rc == 0, run.printed[-2000:]
    values = gui_values(name)
    family = SCRIPTS[CONFIGS[name]][0]
    assert values["save_model_as"] == "safetensors"  # one file in the original layout, as sd-scripts writes it
    checkpoint = run.out / f"{values['output_name']}.safetensors"
    with safe_open(str(checkpoint), "pt") as f:
        keys = list(f.keys())
        meta = f.metadata()
    assert all(any(k.startswith(p) for k in keys) for p in LAYOUT[family])
    assert meta["modelspec.architecture"] == ARCHITECTURE[family]
    if not XFORMERS_RUNS:  # the GUI's default xformers = true: PyTorch's attention instead, said once
        assert run.printed.count("--xformers: the xformers") == 1


def _parts(file: Path, prefix: str) -> dict[str, torch.Tensor]:
    return {k: v for k, v in load_file(str(file)).items() if k.startswith(prefix)}


def test_stop_te_and_te_learning_rate_are_honoured(trained, capsys):
    """``stop_text_encoder_training = 1``: the text encoder trains in update 1 only (its weights after updates 1
    and 2 are equal, the U-Net's are not); ``learning_rate_te = 5e-6`` is its learning rate (the U-Net's 1e-5)."""
    values = gui_values(STOP_TE)
    assert values["stop_text_encoder_training"] == 1 and values["learning_rate_te"] == 5e-6
    run = trained(STOP_TE, capsys, STOP_TE_SAVES)
    assert run.rc == 0
    assert "0 updates skipped as non-finite" in run.printed
    assert "text_encoder: trained for 1 updates; not trained from update 2 on" in run.printed
    assert "unet (lr 1e-05), text_encoder (lr 5e-06)" in run.printed
    (step1,) = run.out.glob("*-step00000001.safetensors")
    last = run.out / "last.safetensors"
    te_1, te_2 = _parts(step1, "cond_stage_model."), _parts(last, "cond_stage_model.")
    assert te_1 and all(torch.equal(te_1[k], te_2[k]) for k in te_1)
    unet_1, unet_2 = _parts(step1, "model.diffusion_model."), _parts(last, "model.diffusion_model.")
    assert any(not torch.equal(unet_1[k], unet_2[k]) for k in unet_1)


def test_the_default_dreambooth_trains_the_text_encoder_throughout(trained, capsys):
    """Without "Stop TE" the GUI writes no stop_text_encoder_training: train_db.py trains both, as upstream's."""
    run = trained("dreambooth/sd15_default", capsys)
    assert run.rc == 0
    assert "unet (lr 1e-05), text_encoder (lr 1e-05)" in run.printed and "not trained from update" not in run.printed


def test_sdxl_dreambooth_fields_of_train_db_are_named_and_change_nothing(tmp_path, images, caplog):
    """The DreamBooth tab writes its "No token padding" box and "Stop TE" slider for sdxl_train.py too (this state:
    both set, the GUI's lines ``no_token_padding = true`` and ``stop_text_encoder_training = 50``); sd-scripts'
    sdxl_train.py has neither flag and ignores them: accepted here, named in the GUI info line."""
    file = materialise("dreambooth/sdxl_default", tmp_path / "x", images)
    text = file.read_text(encoding="utf-8")
    file.write_text(text + "no_token_padding = true\nstop_text_encoder_training = 50\n", encoding="utf-8")
    with caplog.at_level(logging.INFO, logger="library.config.cli"):
        cfg, _ = parse_args(["--config_file", str(file)], script="sdxl_train.py")
    validate(cfg)
    (line,) = [r.getMessage() for r in caplog.records if "kohya_ss GUI field" in r.getMessage()]
    assert "no_token_padding: " in line and "stop_text_encoder_training: " in line


@pytest.mark.parametrize(("name", "line", "fix"), [
    ("finetune/sd15_caption_metadata", 'block_lr = "1e-5,1e-5,1e-5"',
     '"block_lr" is an option for SDXL (sdxl_train.py); fine_tune.py trains'),
    ("dreambooth/sd15_default", "train_inpainting = true", 'untick "Train inpainting model" in the GUI'),
])
def test_a_field_the_script_lacks_stops_with_exit_2_naming_the_fix(name, line, fix, tmp_path, images, capsys):
    """The Finetune tab's "Block LR (SDXL)" box filled in for SD 1.5 (sd-scripts' fine_tune.py has no block_lr),
    and the DreamBooth tab's "Train inpainting model" (a flag of sd-scripts after 48d368fa): exit code 2, no model."""
    file = materialise(name, tmp_path / "x", images)
    file.write_text(file.read_text(encoding="utf-8") + line + "\n", encoding="utf-8")
    rc = train_network.main(["--config_file", str(file), *SPEED_OVERRIDES], script=CONFIGS[name])
    assert rc == 2
    err = capsys.readouterr().err
    assert fix in err and str(file) in err
    assert not list((tmp_path / "x" / "out").glob("*.safetensors"))


def test_the_sdxl_tabs_fused_optimizer_groups_trains_with_the_default_adamw8bit(tmp_path, images, capsys,
                                                                              monkeypatch):
    """The SDXL options' "Fused optimizer groups" box (the GUI writes the number; its default optimizer is
    AdamW8bit, which sd-scripts steps group by group): the weights are stepped inside backward in spans of
    ceil(tensors / 4), and the run writes its checkpoint."""
    from library.train.update import FusedUpdater

    file = materialise("finetune/sdxl_caption_metadata", tmp_path / "x", images)
    file.write_text(file.read_text(encoding="utf-8") + "fused_optimizer_groups = 4\n", encoding="utf-8")
    cfg, _ = parse_args(["--config_file", str(file)], script="sdxl_train.py")
    assert cfg.family_config.fused_optimizer_groups == 4 and cfg.optimizer.optimizer_type == "AdamW8bit"
    made: list[FusedUpdater] = []
    original = FusedUpdater.__post_init__
    monkeypatch.setattr(FusedUpdater, "__post_init__", lambda self: (original(self), made.append(self))[0])
    rc = train_network.main(["--config_file", str(file), *SPEED_OVERRIDES], family="sdxl", script="sdxl_train.py")
    assert rc == 0, capsys.readouterr().err[-2000:]
    [updater] = made
    assert updater.span == -(-len(updater.params) // 4) and updater.updates == 2
    assert list((tmp_path / "x" / "out").glob("*.safetensors"))
