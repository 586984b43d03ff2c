"""The kohya_ss GUI's FLUX.1 DreamBooth and Finetune TOMLs run with ``flux_train.py``:
``tests/data/kohya_gui/dreambooth/flux1_*.toml`` and ``tests/data/kohya_gui/finetune/flux1_*.toml``.

Each file is the ``--config_file`` TOML that the GUI's ``train_model`` (bmaltais/kohya_ss 45088f04,
``dreambooth_gui.py`` / ``finetune_gui.py``) writes with "Flux.1" ticked (see its header), with only the paths as
placeholders; the GUI runs it with sd-scripts' ``flux_train.py``, and so do these tests, through
``train_network.main`` with that script's name, as our ``flux_train.py`` does. The model paths are filled as a FLUX
user fills them, with the tiny FLUX written as its four files (``write_tiny_flux``: the BFL transformer as the
pretrained model, ``clip_l``, ``t5xxl``, ``ae``), as in ``test_kohya_gui_flux_config.py``. The files parse, validate
and train 2 steps into one ``.safetensors`` file of the transformer in BFL's layout, with the command-line overrides
of the other GUI tests, for speed: ``--max_train_steps 2 --resolution 64 --min_bucket_reso 64
--max_data_loader_n_workers 0``. The Finetune file's caption metadata is made first, as the GUI makes it.

What the GUI's values must do here (sd-scripts 48d368fa ``flux_train.py`` reads the file into its arguments and
keeps keys it has no flag for unused): ``learning_rate_te`` (both tabs) and ``train_text_encoder`` (the Finetune
tab) are not flags of ``flux_train.py``, which never trains a text encoder: accepted and named in the one GUI info
line. The memory-saving file's ``blocks_to_swap = 18`` is more than the tiny transformer has (exit code 2 when it
loads, with the largest N for the model); with ``--blocks_to_swap 0`` it trains with Adafactor stepped inside
backward (the GUI's "Fused backward pass"). Swapping trained blocks: ``test_flux_fine_tune_swap.py``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from library.config import validate
from library.families.flux.tiny_files import FLUX_FILES, write_tiny_flux
from tests.config_helpers import parse_args
from tests.e2e.gui_configs import ModelFilesGui

ROOT = Path(__file__).resolve().parents[2]
GUI_DIR = ROOT / "tests" / "data" / "kohya_gui"
SCRIPT = "flux_train.py"
SPEED_OVERRIDES = ["--max_train_steps", "2", "--resolution", "64", "--min_bucket_reso", "64",
                   "--max_data_loader_n_workers", "0"]
DEFAULT, MEMORY_SAVING = "dreambooth/flux1_default", "dreambooth/flux1_memory_saving"
FINETUNE = "finetune/flux1_caption_metadata"
CONFIGS = (DEFAULT, MEMORY_SAVING, FINETUNE)
NO_SWAP = ("--blocks_to_swap", "0")  # the memory-saving file without its blocks_to_swap = 18 (too deep)
# GUI fields that flux_train.py has no flag for, by file: named in the GUI info line
GUI_ONLY = {DEFAULT: {"epoch", "noise_offset_type", "wandb_run_name", "learning_rate_te"},
            MEMORY_SAVING: {"epoch", "noise_offset_type", "wandb_run_name", "learning_rate_te"},
            FINETUNE: {"noise_offset_type", "wandb_run_name", "learning_rate_te", "train_text_encoder"}}
GUI = ModelFilesGui(GUI_DIR, "flux", dict.fromkeys(CONFIGS, SCRIPT), FINETUNE, SPEED_OVERRIDES)
SAVE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# Until the config layer accepts learning_rate_te / train_text_encoder for flux_train.py (every file writes the
# first; today: exit 2, '"learning_rate_te" is an option for SD 1.x/2.x ...'): strict, so it fails once they pass.


@pytest.fixture(scope="module")
def flux_files(tmp_path_factory) -> dict[str, Path]:
    """The tiny FLUX as its four files, by the placeholder each fills."""
    folder = tmp_path_factory.mktemp("tiny_flux_ft_files")
    write_tiny_flux(folder)
    transformer, clip_l, t5xxl, ae = (folder / name for name in FLUX_FILES)
    return {"@PRETRAINED_MODEL@": transformer, "@CLIP_L@": clip_l, "@T5XXL@": t5xxl, "@AE@": ae}


def test_every_flux_file_is_here_with_its_header():
    found = {f"{d}/{p.stem}" for d in ("dreambooth", "finetune") for p in (GUI_DIR / d).glob("flux1_*.toml")}
    assert found == set(CONFIGS)
    for name in CONFIGS:
        tab = "DreamBooth" if name.startswith("dreambooth/") else "Finetune"
        text = (GUI_DIR / f"{name}.toml").read_text(encoding="utf-8")
        assert text.startswith(f"# kohya_ss GUI (bmaltais/kohya_ss 45088f04), {tab} tab, FLUX.1, {SCRIPT}: ")
        values = GUI.values(name)
        assert {values[k] for k in ("pretrained_model_name_or_path", "clip_l", "t5xxl", "ae")} == \
            {"@PRETRAINED_MODEL@", "@CLIP_L@", "@T5XXL@", "@AE@"}


@pytest.mark.parametrize("name", CONFIGS)
def test_parses_and_validates(name, tmp_path, images, flux_files, caplog):
    file = GUI.materialise(name, tmp_path / "cfg", images, flux_files)
    with caplog.at_level(logging.INFO, logger="library.config.cli"):
        cfg, _ = parse_args(["--config_file", str(file)], script=SCRIPT)
    gui_lines = [r.getMessage() for r in caplog.records if "kohya_ss GUI field" in r.getMessage()]
    assert len(gui_lines) == 1
    assert all(f"{k}: " in gui_lines[0] for k in GUI_ONLY[name])
    values = GUI.values(name)
    section = cfg.family_config
    assert cfg.optimizer.learning_rate == values["learning_rate"]
    assert cfg.optimizer.optimizer_type == values["optimizer_type"]
    assert cfg.optimizer.fused_backward_pass == values.get("fused_backward_pass", False)
    for key in ("guidance_scale", "timestep_sampling", "discrete_flow_shift", "model_prediction_type",
                "t5xxl_max_token_length"):
        assert getattr(section, key) == values[key]
    assert (section.clip_l, section.t5xxl, section.ae) == tuple(str(flux_files[k]) for k in ("@CLIP_L@", "@T5XXL@",
                                                                                              "@AE@"))
    if name == FINETUNE:
        assert cfg.data.in_json == str(tmp_path / "cfg" / "train" / "meta_cap.json")
        assert cfg.data.dataset_repeats == values["dataset_repeats"]
    assert section.swapped_blocks == values["blocks_to_swap"]
    validate(cfg)  # the swap's depth is checked against the model when it loads


@pytest.mark.parametrize(("name", "extra"), [(DEFAULT, ()), (FINETUNE, ()), (MEMORY_SAVING, NO_SWAP)])
def test_trains_two_steps_into_one_transformer_checkpoint(name, extra, tmp_path, images, flux_files, capsys):
    """2 steps, then ``output_name``.safetensors: the tiny transformer's own keys and shapes in BFL's layout (no
    text encoder, no VAE), in ``save_precision``, finite, with FLUX.1 dev's ModelSpec architecture."""
    rc, printed = GUI.train(name, tmp_path / "run", images, flux_files, capsys, *extra)
    assert rc == 0, printed[-2000:]
    values = GUI.values(name)
    assert values["save_model_as"] == "safetensors"
    with safe_open(str(flux_files["@PRETRAINED_MODEL@"]), "pt") as f:
        shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
    with safe_open(str(tmp_path / "run" / "out" / f"{values['output_name']}.safetensors"), "pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
        meta = f.metadata()
    assert {k: list(v.shape) for k, v in state.items()} == shapes
    assert {v.dtype for v in state.values()} == {SAVE_DTYPES[values["save_precision"]]}
    assert all(torch.isfinite(v).all() for v in state.values())
    assert meta["modelspec.architecture"] == "flux-1-dev"
    assert "2 steps" in printed and "0 updates skipped as non-finite" in printed


def test_memory_saving_steps_adafactor_inside_backward(tmp_path, images, flux_files, capsys, monkeypatch):
    """The Flux.1 section's "Fused backward pass" (fused_backward_pass = true, optimizer Adafactor, full bf16):
    the transformer's weights are stepped inside backward, 32 tensors a span, in both updates."""
    from library.train.update.fused import FUSED_SPAN, FusedUpdater

    values = GUI.values(MEMORY_SAVING)
    assert values["fused_backward_pass"] and values["optimizer_type"] == "Adafactor" and values["full_bf16"]
    made: list[FusedUpdater] = []
    original = FusedUpdater.__post_init__
    monkeypatch.setattr(FusedUpdater, "__post_init__", lambda self: (original(self), made.append(self))[0])
    rc, printed = GUI.train(MEMORY_SAVING, tmp_path / "run", images, flux_files, capsys, *NO_SWAP)
    assert rc == 0, printed[-2000:]
    [updater] = made
    assert updater.span == FUSED_SPAN == 32 and updater.updates == 2
    assert "trained in bfloat16" in printed


def test_memory_saving_blocks_to_swap_is_checked_against_the_model(tmp_path, images, flux_files, capsys):
    """The file as written, "Blocks to swap" 18 (with its fused backward pass, as swapping trained blocks needs):
    the tiny transformer (2 double, 2 single blocks) has no block to swap, so exit code 2 with upstream's limit and
    the largest N for this model, and no checkpoint."""
    rc, printed = GUI.train(MEMORY_SAVING, tmp_path / "run", images, flux_files, capsys)
    assert rc == 2
    assert "--blocks_to_swap 18: cannot swap more than 0 double blocks and 0 single blocks" in printed
    assert "The largest N for this model (2 double, 2 single blocks) is 0." in printed
    assert not list((tmp_path / "run" / "out").glob("*.safetensors"))
