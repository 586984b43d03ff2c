"""Every training TOML that the kohya_ss GUI writes for SD 1.5 runs here: ``tests/data/kohya_gui/*.toml``.

Each file is the ``--config_file`` TOML of the GUI's LoRA tab (bmaltais/kohya_ss 45088f04) for one preset or GUI
state (see its header), with only the paths as placeholders. The files parse, validate, give one info line for the
GUI's own fields, and train 2 steps on the tiny model into a LoRA file. The command line overrides only what a test
must for speed, after ``--config_file``: ``--max_train_steps 2`` (the GUI's are 113-6000), ``--resolution 64`` (the
GUI's are 512-768), ``--min_bucket_reso 64`` (the GUI's 256 must not exceed the resolution; sd-scripts asserts the
same) and ``--max_data_loader_n_workers 0`` (no worker processes in a test). The images are ``configs/sample_data``
resized to 64x64: the presets without bucketing need images at least as large as the resolution, as in sd-scripts,
and square 64 px images keep every bucket at 64x64 in a 64 px run.

``xformers = true`` (the GUI's default attention) runs as written: without the xformers package, which this project
does not install (sd-scripts fails with an ImportError there), the UNet uses PyTorch's scaled-dot-product attention
with one info line. The GUI's ``wandb_run_name`` (written into every file) is named in the GUI info line.

Where a GUI file cannot run unchanged, the test checks that it stops with exit code 2 and a message that names the
fix. The first case stops sd-scripts' own train_network.py too, and is then trained with the fix:

* ``bucket_reso_steps = 1`` (six old presets) is refused by sd-scripts for SD 1.x/2.x (``verify_bucket_reso_steps``:
  a multiple of 64); the run then adds ``--bucket_reso_steps 64``;
* ``networks.dylora`` (LoRA type "Kohya DyLoRA") is sd-scripts' own module, not provided here: refused naming the
  LyCORIS DyLoRA instead;
* ``train_inpainting = true`` ("Train inpainting model", a flag of sd-scripts after 48d368fa) asks for a 9-channel
  inpainting U-Net, which this trainer does not train: refused when the file is read;
* LyCORIS/BOFT at the GUI's default ranks cannot be built by LyCORIS on SD 1.5 (nor on the tiny model), here or under
  sd-scripts: refused with LyCORIS's reason and the options to change.
"""

from __future__ import annotations

import importlib.util
import logging
import tomllib
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import train_network
from library.base.errors import UserError
from library.config import validate
from tests.config_helpers import parse_args
from tests.e2e.gui_configs import fill_gui_config

ROOT = Path(__file__).resolve().parents[2]
GUI_DIR = ROOT / "tests" / "data" / "kohya_gui"
CONFIGS = sorted(p.stem for p in GUI_DIR.glob("*.toml"))
SPEED_OVERRIDES = ["--max_train_steps", "2", "--resolution", "64", "--min_bucket_reso", "64",
                   "--max_data_loader_n_workers", "0"]
XFORMERS_RUNS = importlib.util.find_spec("xformers") is not None and torch.cuda.is_available()
# What the GUI writes into output_dir/sample/prompt.txt: its "Sample prompts" box (empty unless set).
PROMPTS = {"standard_sample_images": "a red circle --w 64 --h 64 --s 2 --d 1\n"}
REFUSED = {"kohya_dylora": "--network_module networks.dylora"}  # by validate(), before anything loads
NOT_READ = {"standard_train_inpainting"}  # refused by the TOML reader
NOT_BUILT = {"lycoris_boft"}  # LyCORIS cannot build the network (see the file's header)


def gui_values(name: str) -> dict:
    return tomllib.loads((GUI_DIR / f"{name}.toml").read_text(encoding="utf-8"))


def needs_bucket_steps_fix(values: dict) -> bool:
    """sd-scripts' rule for SD 1.x/2.x with bucketing: bucket_reso_steps must be a multiple of 64."""
    return bool(values.get("enable_bucket")) and values.get("bucket_reso_steps", 64) % 64 != 0


def materialise(name: str, where: Path, images: Path) -> Path:
    """The GUI file with its placeholders filled in, in a fresh folder; the prompt file as the GUI creates it."""
    return fill_gui_config(GUI_DIR / f"{name}.toml", where, images, "builtin:tiny-sd15", PROMPTS.get(name, ""))


class Run:
    """The exit code of one training run and where its files are."""

    def __init__(self, name: str, where: Path, rc: int) -> None:
        self.rc = rc
        self.out = where / "out"
        self.lora = self.out / f"{gui_values(name).get('output_name', 'last')}.safetensors"


@pytest.fixture(scope="module")
def trained(tmp_path_factory, images):
    """``name -> Run``: each GUI file trained once for the module (with the fixes described above)."""
    runs: dict[str, Run] = {}

    def run(name: str) -> Run:
        if name not in runs:
            where = tmp_path_factory.mktemp("gui_run") / name
            file = materialise(name, where, images)
            extra = ["--bucket_reso_steps", "64"] if needs_bucket_steps_fix(gui_values(name)) else []
            rc = train_network.main(["--config_file", str(file), *SPEED_OVERRIDES, *extra])
            runs[name] = Run(name, where, rc)
        return runs[name]

    return run


def test_there_is_a_file_per_sd15_preset_and_the_default_state():
    presets = {"iA3-Prodigy-sd15", "ia3-sd15", "loha-sd15", "lokr-sd15", "sd15_EDG_LoConOptiSettings",
               "sd15_EDG_LoHaOptiSettings", "sd15_EDG_LoraOptiSettings", "sd15_LoKR_v1.0", "sd15_LoKr_v1.1",
               "sd15_LoKr_v2.0"}
    assert presets | {"standard_default"} <= set(CONFIGS)
    for name in CONFIGS:
        header = (GUI_DIR / f"{name}.toml").read_text(encoding="utf-8").splitlines()[0]
        assert header.startswith("# kohya_ss GUI (bmaltais/kohya_ss 45088f04), LoRA tab")


@pytest.mark.parametrize("name", [n for n in CONFIGS if n not in NOT_READ])
def test_parses_and_validates(name, tmp_path, images, caplog):
    file = materialise(name, tmp_path / "cfg", images)
    with caplog.at_level(logging.INFO, logger="library.config.cli"):
        cfg, _ = parse_args(["--config_file", str(file)])
    gui_lines = [r.getMessage() for r in caplog.records if "kohya_ss GUI field" in r.getMessage()]
    assert len(gui_lines) == 1
    assert all(k in gui_lines[0] for k in ("epoch", "noise_offset_type", "wandb_run_name"))
    values = gui_values(name)
    assert cfg.network.network_module == values["network_module"]
    assert cfg.network.network_args == values["network_args"]
    assert cfg.save.output_dir == str(tmp_path / "cfg" / "out")
    if name in REFUSED:
        with pytest.raises(UserError) as info:
            validate(cfg)
        assert [m.split(":")[0] for m in info.value.messages] == [REFUSED[name]]
    else:
        validate(cfg)


def test_gui_value_forms_reach_the_config(tmp_path, images):
    """The value forms in the GUI files (read off standard_default.toml and standard_common_options.toml)."""
    cfg, _ = parse_args(["--config_file", str(materialise("standard_default", tmp_path / "a", images))])
    assert cfg.optimizer.text_encoder_lr == [0.0001, 0.0001]  # one value per text encoder, both the TE LR box
    assert cfg.schedule.lr_warmup_steps == pytest.approx(0.1)  # LR warmup 10 % written as a ratio of the steps
    assert cfg.schedule.lr_scheduler_args == [] and cfg.optimizer.optimizer_args == []
    assert cfg.precision.dynamo_backend == "no" and cfg.data.resolution == (512, 512)
    assert cfg.data.prior_loss_weight == 1.0 and isinstance(cfg.loss.huber_scale, float)  # written as 1
    cfg, _ = parse_args(["--config_file", str(materialise("standard_common_options", tmp_path / "b", images))])
    assert cfg.data.persistent_data_loader_workers is True  # written as the integer 1
    assert cfg.model.highvram is True
    assert cfg.schedule.lr_warmup_steps == 10
    assert cfg.optimizer.optimizer_args == ["weight_decay=0.01", "betas=0.9,0.999"]
    assert cfg.network.network_args == ["rank_dropout=0.1", "module_dropout=0.1", "loraplus_lr_ratio=4"]


@pytest.mark.parametrize("name", [n for n in CONFIGS if n not in {*REFUSED, *NOT_BUILT, *NOT_READ}])
def test_trains_two_steps(name, trained):
    run = trained(name)
    assert run.rc == 0
    assert run.lora.is_file()
    with safe_open(str(run.lora), "pt") as f:
        meta = f.metadata()
        assert len(f.keys()) > 0
    assert meta["ss_steps"] == "2"
    assert meta["ss_network_module"] == gui_values(name)["network_module"]


def test_sample_images_are_written(trained):
    run = trained("standard_sample_images")
    assert run.rc == 0
    assert list((run.out / "sample").glob("*.png"))


@pytest.mark.skipif(XFORMERS_RUNS, reason="xformers is installed here, and there is a CUDA device")
def test_gui_default_attention_without_xformers_runs_on_sdpa(tmp_path, images, capsys):
    file = materialise("standard_default", tmp_path / "x", images)
    assert "\nxformers = true\n" in file.read_text(encoding="utf-8")
    assert train_network.main(["--config_file", str(file), *SPEED_OVERRIDES]) == 0
    err = capsys.readouterr().err
    assert err.count("--xformers: the xformers") == 1 and "PyTorch's scaled-dot-product attention instead" in err
    assert "--wandb_run_name" not in err
    assert (tmp_path / "x" / "out" / "last.safetensors").is_file()


def test_every_problem_of_a_gui_file_at_once(tmp_path, images, capsys):
    """A GUI preset with bucket_reso_steps = 1 (and xformers) and a flag that does not fit it: both reported."""
    file = materialise("loha-sd15", tmp_path / "two", images)
    assert train_network.main(["--config_file", str(file), *SPEED_OVERRIDES, "--full_fp16"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 2
    assert errors[0] == "error: --full_fp16 needs --mixed_precision fp16 (as in sd-scripts)"
    assert "bucket_reso_steps is 1; it must be a multiple of 64" in errors[1]


@pytest.mark.parametrize("name", [n for n in CONFIGS if needs_bucket_steps_fix(gui_values(n))])
def test_bucket_reso_steps_1_is_refused_as_sd_scripts_does(name, tmp_path, images, capsys):
    file = materialise(name, tmp_path / "s", images)
    assert train_network.main(["--config_file", str(file), *SPEED_OVERRIDES]) == 2
    err = capsys.readouterr().err
    assert "bucket_reso_steps is 1" in err and "multiple of 64" in err
    assert not list((tmp_path / "s" / "out").glob("*.safetensors"))


def test_kohya_dylora_is_refused_naming_lycoris_dylora(tmp_path, images, capsys):
    file = materialise("kohya_dylora", tmp_path / "d", images)
    assert train_network.main(["--config_file", str(file), *SPEED_OVERRIDES]) == 2
    err = capsys.readouterr().err
    assert "--network_module networks.dylora" in err
    assert "lycoris.kohya" in err and "algo=dylora" in err


def test_train_inpainting_is_refused_when_ticked(tmp_path, images, capsys):
    file = materialise("standard_train_inpainting", tmp_path / "i", images)
    assert train_network.main(["--config_file", str(file), *SPEED_OVERRIDES]) == 2
    err = capsys.readouterr().err
    assert f"{file}: train_inpainting = True: inpainting training" in err and "Train inpainting model" in err
    file.write_text(file.read_text(encoding="utf-8").replace("train_inpainting = true", "train_inpainting = false"),
                    encoding="utf-8")
    cfg, _ = parse_args(["--config_file", str(file)])  # off, as a hand-written file may say, is accepted
    assert cfg.data.cache_latents is False


def test_boft_at_the_gui_defaults_is_refused_with_lycoris_reason(tmp_path, images, capsys):
    file = materialise("lycoris_boft", tmp_path / "b", images)
    assert train_network.main(["--config_file", str(file), *SPEED_OVERRIDES]) == 2
    err = capsys.readouterr().err
    assert "algo=boft" in err and "LyCORIS cannot build this network" in err and "under BOFT constraints" in err
    assert not list((tmp_path / "b" / "out").glob("*.safetensors"))


@pytest.mark.parametrize(("typo", "meant"), [("gradient_accumulation_step", "gradient_accumulation_steps"),
                                             ("noise_offset_typ", "noise_offset_type")])
def test_a_misspelled_key_in_a_gui_file_still_fails(typo, meant, tmp_path, images, capsys):
    file = materialise("standard_default", tmp_path / "t", images)
    text = file.read_text(encoding="utf-8")
    assert f"\n{meant} = " in text
    file.write_text(text.replace(f"\n{meant} = ", f"\n{typo} = "), encoding="utf-8")
    assert train_network.main(["--config_file", str(file), *SPEED_OVERRIDES]) == 2
    err = capsys.readouterr().err
    assert f'unknown key "{typo}" (did you mean "{meant}"?)' in err
    assert str(file) in err
