"""``anima_train_network.py`` end to end on ``builtin:tiny-anima`` (every module kind, tiny widths): the LoRA file has
upstream's ``networks.lora_anima`` keys and Anima's metadata and loads back with ``create_network_from_weights``;
cached latents and text-encoder outputs, full bf16 with stochastic rounding, and a sample image."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import train_network
from tests.e2e.test_train_network import SAMPLES

FULL_BF16 = ("--mixed_precision", "bf16", "--full_bf16", "--optimizer_type", "StochasticAdamW")


def anima_args(out: Path, *extra: str) -> list[str]:
    return ["--pretrained_model_name_or_path", "builtin:tiny-anima", "--train_data_dir", str(SAMPLES),
            "--caption_extension", ".txt", "--resolution", "64", "--output_dir", str(out), "--output_name", "lora",
            "--network_module", "networks.lora_anima", "--network_dim", "4", "--network_alpha", "2",
            "--learning_rate", "1e-3", "--train_batch_size", "2", "--max_train_steps", "2", "--seed", "1",
            "--max_data_loader_n_workers", "0", "--qwen3_max_token_length", "64", "--t5_max_token_length", "64",
            *extra]


def train(args: list[str]) -> int:
    return train_network.main(args, family="anima")


@pytest.fixture(scope="module")
def fp32_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("anima-fp32")
    assert train(anima_args(out, "--max_train_steps", "3", "--timestep_sampling", "shift",
                            "--discrete_flow_shift", "3.0", "--weighting_scheme", "cosmap")) == 0
    return out / "lora.safetensors"


def test_keys_are_lora_anima_names_for_the_dit_and_qwen3(fp32_run):
    modules = {key.split(".")[0] for key in load_file(fp32_run)}
    # tiny-anima: 2 blocks x 10 Linear layers (self/cross q, k, v, output_proj, mlp layer1/2); Qwen3 2 layers x 7
    assert sum(m.startswith("lora_unet_blocks_") for m in modules) == 20
    assert sum(m.startswith("lora_te_layers_") for m in modules) == 14
    assert {"lora_unet_blocks_0_self_attn_q_proj", "lora_unet_blocks_1_cross_attn_output_proj",
            "lora_unet_blocks_1_mlp_layer2", "lora_te_layers_0_self_attn_q_proj",
            "lora_te_layers_1_mlp_gate_proj"} <= modules
    assert not any("llm_adapter" in m or "modulation" in m or "embedder" in m for m in modules)


def test_metadata_names_anima_and_its_training_settings(fp32_run):
    with safe_open(str(fp32_run), "pt") as f:
        meta = f.metadata()
    assert meta["ss_base_model_version"] == "anima"
    assert meta["modelspec.architecture"] == "anima-preview/lora"
    assert meta["modelspec.implementation"] == "https://huggingface.co/circlestone-labs/Anima"
    assert meta["ss_network_module"] == "networks.lora_anima"
    assert (meta["ss_timestep_sampling"], meta["ss_discrete_flow_shift"], meta["ss_weighting_scheme"]) == \
        ("shift", "3.0", "cosmap")


def test_the_lora_trained_and_loads_back(fp32_run):
    from library.families.anima.builtin import build_tiny_parts
    from networks.lora_anima import create_network_from_weights

    state = load_file(fp32_run)
    ups = {k: v for k, v in state.items() if k.endswith("lora_up.weight")}
    assert any(float(v.abs().max()) > 0 for v in ups.values())
    assert all(torch.isfinite(v).all() for v in ups.values())
    dit, qwen3, _ = build_tiny_parts()
    network, weights = create_network_from_weights(1.0, str(fp32_run), None, [qwen3], dit)
    assert len(network.unet_loras) == 20 and len(network.text_encoder_loras) == 14
    network.apply_to([qwen3], dit, True, True)
    assert network.load_state_dict(weights, strict=True)


def test_full_bf16_with_cached_latents_and_text_outputs(tmp_path):
    out = tmp_path / "out"
    assert train(anima_args(out, *FULL_BF16, "--cache_latents", "--cache_text_encoder_outputs",
                            "--network_train_unet_only", "--gradient_checkpointing")) == 0
    state = load_file(out / "lora.safetensors")
    assert {v.dtype for v in state.values() if v.dim() > 0} == {torch.bfloat16}
    assert not any(k.startswith("lora_te") for k in state)
    ups = [v for k, v in state.items() if k.endswith("lora_up.weight")]
    assert any(float(v.abs().max()) > 0 for v in ups) and all(torch.isfinite(v).all() for v in ups)


def test_a_sample_prompt_draws_an_image(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red square --w 64 --h 64 --s 3 --d 5 --l 4.0 --n blurry --fs 5\n")
    out = tmp_path / "out"
    assert train(anima_args(out, "--max_train_steps", "1", "--sample_prompts", str(prompts),
                            "--sample_every_n_steps", "1")) == 0
    assert "sample 00: 64x64, 3 steps, Euler, CFG 4, flow shift 5, seed 5" in caplog.text  # --fs read, not ignored
    assert "--fs (flow_shift)" not in caplog.text
    (image,) = (out / "sample").iterdir()
    assert image.name.startswith("lora_000001_00") and image.name.endswith("_5.png")
    from PIL import Image

    with Image.open(image) as im:
        assert im.size == (64, 64)


def test_caching_without_unet_only_is_refused(tmp_path, capsys):
    assert train(anima_args(tmp_path / "out", "--cache_text_encoder_outputs")) == 2
    assert "--network_train_unet_only" in capsys.readouterr().err


def test_validation_loss_is_logged_and_changes_nothing(tmp_path):
    """``--validation_split`` on Anima (cached latents and text outputs, validation images cached alike): the
    validation loss is logged at each step, finite, and validating leaves the LoRA bit for bit as it was."""
    from tests.e2e.test_validation import scalars

    common = ("--validation_split", "0.25", "--cache_latents", "--cache_text_encoder_outputs",
              "--network_train_unet_only")
    assert train(anima_args(tmp_path / "val", *common, "--validate_every_n_steps", "1", "--logging_dir",
                            str(tmp_path / "logs"))) == 0
    assert train(anima_args(tmp_path / "silent", *common, "--validate_every_n_epochs", "100")) == 0
    validating, silent = (load_file(tmp_path / run / "lora.safetensors") for run in ("val", "silent"))
    assert validating.keys() == silent.keys() and all(torch.equal(validating[k], silent[k]) for k in silent)
    logged = scalars(tmp_path / "logs")["loss/validation/step_average"]
    assert [step for step, _ in logged] == [1, 2] and all(0 < value < float("inf") for _, value in logged)
