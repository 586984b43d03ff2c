"""The kohya_ss GUI's Anima TOMLs run with ``anima_train_network.py`` and ``anima_train.py``:
``tests/data/kohya_gui/anima/*.toml``.

Each file is the ``--config_file`` TOML that the GUI's ``train_model`` (bmaltais/kohya_ss 45088f04, ``lora_gui.py``
with LoRA type "Anima", ``finetune_gui.py``; "Anima" ticked) writes (see its header), with only the paths as
placeholders; the GUI runs it with sd-scripts' ``anima_train_network.py`` or ``anima_train.py``, and so do these tests,
through ``train_network.main`` with that script's name. The files sit in a folder of their own (the SD 1.5 tests run
every TOML directly in ``tests/data/kohya_gui``). The model paths are filled as an Anima user fills them, with the
tiny Anima written as its three files (``write_tiny_anima``: the DiT as the pretrained model, the Qwen3 folder as the
Anima section's "Qwen3 Path", the Qwen-Image VAE as its "VAE Path"). The files parse, validate, name the GUI's own
fields in one info line and train 2 steps, with the command-line overrides of the other GUI tests, for speed:
``--max_train_steps 2 --resolution 64 --min_bucket_reso 64 --max_data_loader_n_workers 0``. The Finetune file's
caption metadata is made first, as the GUI makes it.

The fields of the GUI's Anima section that ask for a newer sd-scripts than 48d368fa (per-block ``compile`` and its
options, ``qwen_image_vae_2d``, ``show_timesteps``) are written only when set, and are then refused with what to do;
``unsloth_offload_checkpointing``, ``split_attn`` and an ``attn_mode`` other than torch are Anima flags of 48d368fa
that this trainer refuses (``library/families/anima/config.py``); the LoRA types "Kohya LoHa" / "Kohya LoKr" (the
GUI's only other types with Anima: sd-scripts' own ``networks.loha`` / ``networks.lokr``, newer than 48d368fa) are
refused naming LyCORIS's LoHa / LoKr. The GUI's default ``xformers = true`` runs on PyTorch's attention with one
warning (sd-scripts' anima_train_network.py would pick its xformers attention from it).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import train_network
from library.config import validate
from library.families.anima.tiny_files import ANIMA_FILES, write_tiny_anima
from tests.config_helpers import parse_args
from tests.e2e.gui_configs import ModelFilesGui

GUI_DIR = Path(__file__).resolve().parents[2] / "tests" / "data" / "kohya_gui" / "anima"
SPEED_OVERRIDES = ["--max_train_steps", "2", "--resolution", "64", "--min_bucket_reso", "64",
                   "--max_data_loader_n_workers", "0"]
LORA, CACHED, FINETUNE = "lora_default", "lora_cached_bf16", "finetune_caption_metadata"
CONFIGS = {LORA: "anima_train_network.py", CACHED: "anima_train_network.py", FINETUNE: "anima_train.py"}
# GUI fields that the script has no flag for, by file: named in the GUI info line
GUI_ONLY = {LORA: {"epoch", "noise_offset_type", "wandb_run_name"},
            CACHED: {"epoch", "noise_offset_type", "wandb_run_name"},
            FINETUNE: {"noise_offset_type", "wandb_run_name", "learning_rate_te", "train_text_encoder"}}
# The Anima section's fields, by the key the GUI writes them as
SECTION_KEYS = ("qwen3_max_token_length", "t5_max_token_length", "discrete_flow_shift", "timestep_sampling",
                "sigmoid_scale")
GUI = ModelFilesGui(GUI_DIR, "anima", CONFIGS, FINETUNE, SPEED_OVERRIDES)
SAVE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# tiny-anima: 2 blocks x 10 Linear layers in the DiT, 2 Qwen3 layers x 7
DIT_MODULES, QWEN3_MODULES = 20, 14


@pytest.fixture(scope="module")
def anima_files(tmp_path_factory) -> dict[str, Path]:
    """The tiny Anima as its three files, by the placeholder each fills."""
    folder = tmp_path_factory.mktemp("tiny_anima_files")
    write_tiny_anima(folder)
    dit, qwen3, vae = (folder / name for name in ANIMA_FILES)
    return {"@PRETRAINED_MODEL@": dit, "@QWEN3@": qwen3, "@VAE@": vae}


def test_every_anima_file_is_here_with_its_header():
    assert {p.stem for p in GUI_DIR.glob("*.toml")} == set(CONFIGS)
    for name, script in CONFIGS.items():
        tab = "Finetune" if name == FINETUNE else "LoRA"
        text = (GUI_DIR / f"{name}.toml").read_text(encoding="utf-8")
        assert text.startswith(f"# kohya_ss GUI (bmaltais/kohya_ss 45088f04), {tab} tab, Anima, {script}: ")
        values = GUI.values(name)
        assert (values["pretrained_model_name_or_path"], values["qwen3"], values["vae"]) == \
            ("@PRETRAINED_MODEL@", "@QWEN3@", "@VAE@")
        assert not {"clip_skip", "max_token_length", "v2"} & set(values)  # the GUI leaves SD's out for Anima


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_parses_and_validates(name, tmp_path, images, anima_files, caplog):
    file = GUI.materialise(name, tmp_path / "cfg", images, anima_files)
    with caplog.at_level(logging.INFO, logger="library.config.cli"):
        cfg, _ = parse_args(["--config_file", str(file)], script=CONFIGS[name])
    validate(cfg)
    gui_lines = [r.getMessage() for r in caplog.records if "kohya_ss GUI field" in r.getMessage()]
    assert len(gui_lines) == 1
    named = gui_lines[0].split(": kohya_ss GUI field")[0].rsplit(": ", 1)[1]
    assert set(named.split(", ")) == GUI_ONLY[name]
    values, section = GUI.values(name), cfg.family_config
    for key in SECTION_KEYS:
        assert getattr(section, key) == values[key]
    assert (section.qwen3, cfg.model.vae) == (str(anima_files["@QWEN3@"]), str(anima_files["@VAE@"]))
    assert cfg.optimizer.learning_rate == values["learning_rate"]
    assert cfg.optimizer.optimizer_type == values["optimizer_type"]
    assert section.vae_chunk_size == values.get("vae_chunk_size")
    assert section.vae_disable_cache == values.get("vae_disable_cache", False)
    assert section.cache_text_encoder_outputs == values.get("cache_text_encoder_outputs", False)
    if name == FINETUNE:
        assert cfg.data.in_json == str(tmp_path / "cfg" / "train" / "meta_cap.json")
        assert cfg.data.dataset_repeats == values["dataset_repeats"]
        assert section.blocks_to_swap == values["blocks_to_swap"] == 0
    else:
        assert cfg.network.network_module == values["network_module"] == "networks.lora_anima"
        assert cfg.network.network_train_unet_only == values.get("network_train_unet_only", False)


@pytest.mark.parametrize("name", [LORA, CACHED])
def test_a_lora_file_trains_two_steps_into_a_lora_anima_file(name, tmp_path, images, anima_files, capsys):
    """2 steps, then ``output_name``.safetensors: upstream's ``networks.lora_anima`` modules of the DiT, and of Qwen3
    unless the file trains the DiT only (text_encoder_lr 0: ``network_train_unet_only``), in ``save_precision``,
    finite, with Anima's metadata; cached text-encoder outputs in upstream's ``_anima_te.npz`` files."""
    rc, printed = GUI.train(name, tmp_path / "run", images, anima_files, capsys)
    assert rc == 0, printed[-2000:]
    values = GUI.values(name)
    with safe_open(str(tmp_path / "run" / "out" / f"{values['output_name']}.safetensors"), "pt") as f:
        meta = f.metadata()
        state = {k: f.get_tensor(k) for k in f.keys()}
    modules = {k.split(".")[0] for k in state}
    qwen3 = 0 if values.get("network_train_unet_only") else QWEN3_MODULES
    assert sum(m.startswith("lora_unet_blocks_") for m in modules) == DIT_MODULES
    assert sum(m.startswith("lora_te_layers_") for m in modules) == qwen3
    assert len(modules) == DIT_MODULES + qwen3
    assert {v.dtype for v in state.values() if v.dim() > 0} == {SAVE_DTYPES[values["save_precision"]]}
    assert all(torch.isfinite(v).all() for v in state.values())
    assert (meta["ss_steps"], meta["ss_network_module"], meta["ss_base_model_version"]) == \
        ("2", "networks.lora_anima", "anima")
    assert (meta["ss_network_dim"], meta["ss_timestep_sampling"]) == \
        (str(values["network_dim"]), values["timestep_sampling"])
    cached = {p.name for p in (tmp_path / "run" / "data").rglob("*.npz")}
    assert any(n.endswith("_anima_te.npz") for n in cached) == values.get("cache_text_encoder_outputs_to_disk", False)
    assert "0 updates skipped as non-finite" in printed
    # the GUI's default attention, xformers = true: PyTorch's attention, said once
    assert values["xformers"] and printed.count("--xformers: no effect on Anima training") == 1


def test_the_finetune_file_trains_two_steps_into_one_dit_checkpoint(tmp_path, images, anima_files, capsys):
    """2 steps, then ``output_name``.safetensors: the tiny DiT's own ``net.`` keys and shapes (no text encoder, no
    VAE), in ``save_precision``, finite, with Anima's ModelSpec architecture."""
    rc, printed = GUI.train(FINETUNE, tmp_path / "run", images, anima_files, capsys)
    assert rc == 0, printed[-2000:]
    values = GUI.values(FINETUNE)
    assert values["save_model_as"] == "safetensors"
    with safe_open(str(anima_files["@PRETRAINED_MODEL@"]), "pt") as f:
        shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
    with safe_open(str(tmp_path / "run" / "out" / f"{values['output_name']}.safetensors"), "pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
        meta = f.metadata()
    assert {k: list(v.shape) for k, v in state.items()} == shapes
    assert {v.dtype for v in state.values()} == {SAVE_DTYPES[values["save_precision"]]}
    assert all(torch.isfinite(v).all() for v in state.values())
    assert meta["modelspec.architecture"] == "anima-preview"
    assert "2 steps" in printed and "0 updates skipped as non-finite" in printed


# What the Anima section writes for a box set beyond the defaults (lora_gui.py / finetune_gui.py train_model, 45088f04)
# and the fix the refusal names.
NEWER_FIELDS = [
    ('compile = true\ncompile_backend = "inductor"\ncompile_mode = "default"\n', 'compile = True: per-block torch'
     '.compile of the DiT (sd-scripts after 48d368fa) is not provided here; untick "Per-block Torch Compile"'),
    ("qwen_image_vae_2d = true\n", 'untick "Qwen-Image VAE 2D" in the GUI'),
    ('show_timesteps = "console"\nshow_timesteps_resolution = "1024"\n', 'empty "Show timesteps" in the GUI'),
    ("unsloth_offload_checkpointing = true\n", "--unsloth_offload_checkpointing is not provided here"),
    ("split_attn = true\n", "--split_attn is not provided here"),
    ('attn_mode = "flash"\n', "--attn_mode flash: not provided here"),
]


@pytest.mark.parametrize(("lines", "fix"), NEWER_FIELDS)
@pytest.mark.parametrize("name", [LORA, FINETUNE])
def test_an_anima_box_this_trainer_lacks_stops_with_exit_2_naming_the_fix(name, lines, fix, tmp_path, images,
                                                                          anima_files, capsys):
    """The Anima section's boxes for what this trainer does not provide, as the GUI writes them when set: exit code
    2 before any model loads, the one problem named with its fix, no output."""
    file = GUI.materialise(name, tmp_path / "x", images, anima_files)
    file.write_text(file.read_text(encoding="utf-8") + lines, encoding="utf-8")
    capsys.readouterr()
    rc = train_network.main(["--config_file", str(file), *SPEED_OVERRIDES], family="anima", script=CONFIGS[name])
    assert rc == 2
    problems = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(problems) == 1 and fix in problems[0]  # the options the GUI writes with the box are no problem
    assert not list((tmp_path / "x" / "out").glob("*.safetensors"))


@pytest.mark.parametrize("algo", ["loha", "lokr"])
def test_the_kohya_loha_and_lokr_types_are_refused_naming_lycoris(algo, tmp_path, images, anima_files, capsys):
    """LoRA type "Kohya LoHa" / "Kohya LoKr" with Anima ticked (the GUI allows them with Anima: its only other types
    there): the GUI writes ``network_module = "networks.loha"`` / ``"networks.lokr"`` (sd-scripts' own modules, newer
    than 48d368fa) and ``network_args = [ "conv_dim=1", "conv_alpha=1",]``; refused before anything loads, naming
    LyCORIS's algorithm (which trains on Anima here) and the plain LoRA module."""
    file = GUI.materialise(LORA, tmp_path / "x", images, anima_files)
    text = file.read_text(encoding="utf-8").replace('"networks.lora_anima"', f'"networks.{algo}"')
    file.write_text(text.replace("network_args = []", 'network_args = [ "conv_dim=1", "conv_alpha=1",]'),
                    encoding="utf-8")
    capsys.readouterr()
    rc = train_network.main(["--config_file", str(file), *SPEED_OVERRIDES], family="anima", script=CONFIGS[LORA])
    assert rc == 2
    captured = capsys.readouterr()
    (problem,) = [line for line in captured.err.splitlines() if line.startswith("error: ")]
    assert f"--network_module networks.{algo}: " in problem and f"lycoris.kohya with --network_args algo={algo}" in \
        problem and "networks.lora_anima" in problem
    assert "caching latents" not in captured.err + captured.out  # stopped before the models load


def test_the_legacy_torch_compile_box_is_read_as_torch_compile(tmp_path, images, anima_files):
    """"Legacy Torch Compile" (``torch_compile = true``) is the shared ``--torch_compile``; with the GUI's
    ``dynamo_backend = "no"`` it compiles nothing, as in sd-scripts."""
    file = GUI.materialise(LORA, tmp_path / "x", images, anima_files)
    file.write_text(file.read_text(encoding="utf-8") + "torch_compile = true\n", encoding="utf-8")
    cfg, _ = parse_args(["--config_file", str(file)], script=CONFIGS[LORA])
    validate(cfg)
    assert cfg.precision.torch_compile and cfg.precision.dynamo_backend == GUI.values(LORA)["dynamo_backend"]
