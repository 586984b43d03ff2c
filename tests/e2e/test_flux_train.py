"""``flux_train_network.py`` end to end on ``builtin:tiny-flux`` (every real module name, tiny widths): the LoRA file
has upstream's ``networks.lora_flux`` keys and FLUX.1's metadata, full bf16 with stochastic rounding trains with
accumulation, cached latents and text-encoder outputs, a resumed run equals the uninterrupted one bit for bit, and
sample images are drawn with upstream's file names."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import train_network
from tests.e2e.test_train_network import SAMPLES

FULL_BF16 = ("--mixed_precision", "bf16", "--full_bf16", "--optimizer_type", "StochasticAdamW")


def flux_args(out: Path, *extra: str) -> list[str]:
    return ["--pretrained_model_name_or_path", "builtin:tiny-flux", "--train_data_dir", str(SAMPLES),
            "--caption_extension", ".txt", "--resolution", "64", "--output_dir", str(out), "--output_name", "lora",
            "--network_module", "networks.lora_flux", "--network_dim", "4", "--network_alpha", "2",
            "--learning_rate", "1e-3", "--train_batch_size", "2", "--max_train_steps", "3", "--seed", "1",
            "--max_data_loader_n_workers", "0", *extra]


def train(args: list[str]) -> int:
    return train_network.main(args, family="flux")


@pytest.fixture(scope="module")
def fp32_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("flux-fp32")
    assert train(flux_args(out, "--timestep_sampling", "shift", "--model_prediction_type", "raw")) == 0
    return out / "lora.safetensors"


def test_keys_are_lora_flux_names_for_clip_l_and_every_block(fp32_run):
    modules = {key.split(".")[0] for key in load_file(fp32_run)}
    # tiny-flux: 2 double blocks x 10 Linear layers, 2 single blocks x 3, CLIP-L 12 layers x 6 (upstream's targets)
    assert sum(m.startswith("lora_unet_double_blocks_") for m in modules) == 20
    assert sum(m.startswith("lora_unet_single_blocks_") for m in modules) == 6
    assert sum(m.startswith("lora_te1_text_model_encoder_layers_") for m in modules) == 72
    assert {"lora_unet_double_blocks_0_img_attn_qkv", "lora_unet_double_blocks_1_txt_mlp_2",
            "lora_unet_single_blocks_1_linear1", "lora_unet_single_blocks_0_modulation_lin"} <= modules
    assert not any(m.startswith("lora_te3_") for m in modules)  # T5 only with train_t5xxl=True, as upstream


def test_metadata_names_flux_and_its_training_settings(fp32_run):
    with safe_open(str(fp32_run), "pt") as f:
        meta = f.metadata()
    assert meta["ss_base_model_version"] == "flux1"
    assert meta["modelspec.architecture"] == "flux-1-dev/lora"
    assert meta["modelspec.implementation"] == "https://github.com/black-forest-labs/flux"
    assert "modelspec.prediction_type" not in meta  # upstream build_metadata writes none for FLUX.1
    assert meta["ss_network_module"] == "networks.lora_flux"
    assert (meta["ss_timestep_sampling"], meta["ss_model_prediction_type"]) == ("shift", "raw")
    assert (meta["ss_guidance_scale"], meta["ss_discrete_flow_shift"], meta["ss_apply_t5_attn_mask"]) == \
        ("3.5", "3.0", "False")


def test_training_moved_the_flux_weights(fp32_run):
    ups = {k: v for k, v in load_file(fp32_run).items() if k.endswith("lora_up.weight")}
    assert any(float(v.abs().max()) > 0 for k, v in ups.items() if k.startswith("lora_unet_single_blocks_"))
    assert all(torch.isfinite(v).all() for v in ups.values())


def test_full_bf16_with_sr_accumulation_and_caches(tmp_path):
    out = tmp_path / "out"
    assert train(flux_args(out, *FULL_BF16, "--gradient_accumulation_steps", "2", "--cache_latents",
                           "--cache_text_encoder_outputs", "--network_train_unet_only", "--gradient_checkpointing",
                           "--apply_t5_attn_mask", "--timestep_sampling", "flux_shift")) == 0
    state = load_file(out / "lora.safetensors")
    assert {v.dtype for v in state.values() if v.dim() > 0} == {torch.bfloat16}
    assert not any(k.startswith("lora_te") for k in state)
    ups = [v for k, v in state.items() if k.endswith("lora_up.weight")]
    assert any(float(v.abs().max()) > 0 for v in ups) and all(torch.isfinite(v).all() for v in ups)


def test_resume_is_bit_exact(tmp_path):
    common = ("--max_train_steps", "4", "--save_every_n_steps", "2", "--save_state", *FULL_BF16,
              "--gradient_accumulation_steps", "2", "--timestep_sampling", "sigmoid")
    assert train(flux_args(tmp_path / "whole", *common)) == 0
    state = tmp_path / "whole" / "lora-step00000002-state"
    assert train(flux_args(tmp_path / "resumed", *common, "--resume", str(state))) == 0
    whole = load_file(tmp_path / "whole" / "lora.safetensors")
    resumed = load_file(tmp_path / "resumed" / "lora.safetensors")
    assert whole.keys() == resumed.keys()
    assert [k for k in whole if not torch.equal(whole[k], resumed[k])] == []


def test_sample_images_with_upstreams_names(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red square --w 64 --h 64 --s 3 --d 5\na blue circle --w 64 --h 64 --s 2 --d 6 --g 2.5\n")
    out = tmp_path / "out"
    assert train(flux_args(out, "--max_train_steps", "2", "--sample_prompts", str(prompts),
                           "--sample_every_n_steps", "2")) == 0
    names = sorted(p.name for p in (out / "sample").iterdir())
    assert [n.split("_")[:3] for n in names] == [["lora", "000002", "00"], ["lora", "000002", "01"]]
    assert names[0].endswith("_5.png") and names[1].endswith("_6.png")


def test_blocks_to_swap_with_fp8_trains_the_same_lora(tmp_path, caplog):
    """--blocks_to_swap moves the frozen blocks' weights around their use (here host and device are both the CPU,
    the same code path): the LoRA comes out bit for bit as without swapping, CLIP-L's too (its gradient arrives
    through the vector input, whose sum over the blocks swapping must not reorder)."""
    common = ("--pretrained_model_name_or_path", "builtin:tiny-flux:double=4,single=8", *FULL_BF16, "--fp8_base",
              "--gradient_checkpointing", "--max_train_steps", "2")
    assert train(flux_args(tmp_path / "plain", *common)) == 0
    caplog.set_level("INFO", logger="library.families.flux.family")
    assert train(flux_args(tmp_path / "swapped", *common, "--blocks_to_swap", "5")) == 0
    assert "--blocks_to_swap 5: 2 double and 6 single blocks" in caplog.text
    plain, swapped = (load_file(tmp_path / name / "lora.safetensors") for name in ("plain", "swapped"))
    assert plain.keys() == swapped.keys()
    assert len([k for k in plain if k.startswith("lora_unet")]) == 3 * (4 * 10 + 8 * 3)
    assert [k for k in plain if k.startswith("lora_te1")]
    assert [k for k in plain if not torch.equal(plain[k], swapped[k])] == []


def test_validation_loss_of_a_flux_run(tmp_path, caplog):
    """The validation split works for FLUX.1: 4 passes per batch as upstream (whose flow-matching samplers ignore
    the fixed timesteps), drawn from the validation's seeded generator."""
    caplog.set_level("INFO", logger="library.train.validation")
    assert train(flux_args(tmp_path / "out", "--max_train_steps", "2", "--validation_split", "0.25",
                           "--validate_every_n_steps", "1")) == 0
    losses = [float(line.rsplit(": ", 1)[1]) for line in caplog.text.splitlines() if "validation loss at step" in line]
    assert len(losses) == 2 and all(0 < loss < 10 for loss in losses)
