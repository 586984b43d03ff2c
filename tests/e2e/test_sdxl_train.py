"""End to end: the real ``sdxl_train_network.py`` on the built-in tiny SDXL and the bundled sample images: upstream's
LoRA key set and SDXL metadata, both text encoders trained in full bf16 with stochastic rounding and SR gradient
accumulation, cached text encoder outputs giving the same LoRA as live encoding, disk-cached outputs, and an exact
resume."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import train_network
from tests.e2e.test_train_network import SAMPLES

UPSTREAM = json.loads((Path(__file__).resolve().parents[1] / "data" / "upstream_sdxl_lora_modules.json").read_text())


def sdxl_args(out: Path, *extra: str, data: Path = SAMPLES) -> list[str]:
    return ["--pretrained_model_name_or_path", "builtin:tiny-sdxl", "--train_data_dir", str(data),
            "--caption_extension", ".txt", "--resolution", "64", "--output_dir", str(out), "--output_name", "lora",
            "--network_module", "networks.lora", "--network_dim", "4", "--network_alpha", "2",
            "--learning_rate", "1e-3", "--train_batch_size", "2", "--max_train_steps", "2", "--seed", "1",
            "--max_data_loader_n_workers", "0", *extra]


def train(args: list[str]) -> int:
    return train_network.main(args, family="sdxl")


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("sdxl-bf16")
    assert train(sdxl_args(out, "--text_encoder_lr", "1e-3", "5e-4", "--mixed_precision", "bf16", "--full_bf16",
                           "--optimizer_type", "StochasticAdamW", "--gradient_accumulation_steps", "2")) == 0
    return out / "lora.safetensors"


def test_keys_are_upstreams_and_every_part_trained(full_run):
    state = load_file(full_run)
    modules = {key.split(".")[0] for key in state}
    assert modules == set(UPSTREAM["modules"]) - set(UPSTREAM["conv_only"])
    assert {v.dtype for v in state.values() if v.dim() > 0} == {torch.bfloat16}
    for prefix in ("lora_te1_", "lora_te2_", "lora_unet_"):
        ups = [v for k, v in state.items() if k.startswith(prefix) and k.endswith("lora_up.weight")]
        assert any(float(v.abs().max()) > 0 for v in ups), prefix
        assert all(torch.isfinite(v).all() for v in ups)


def test_metadata_names_sdxl(full_run):
    with safe_open(str(full_run), "pt") as f:
        meta = f.metadata()
    assert meta["ss_base_model_version"] == "sdxl_base_v1-0" and meta["ss_v2"] == "False"
    assert meta["modelspec.architecture"] == "stable-diffusion-xl-v1-base/lora"
    assert meta["modelspec.implementation"] == "https://github.com/Stability-AI/generative-models"
    assert meta["ss_full_bf16"] == "True" and meta["ss_stochastic_rounding"] == "True"


def test_cached_text_encoder_outputs_train_the_same_lora(tmp_path):
    common = ("--network_train_unet_only",)
    assert train(sdxl_args(tmp_path / "live", *common)) == 0
    assert train(sdxl_args(tmp_path / "cached", *common, "--cache_text_encoder_outputs")) == 0
    live = load_file(tmp_path / "live" / "lora.safetensors")
    cached = load_file(tmp_path / "cached" / "lora.safetensors")
    assert live.keys() == cached.keys() and not any(k.startswith("lora_te") for k in live)
    for key in live:
        torch.testing.assert_close(cached[key], live[key], rtol=0, atol=0)


def test_weighted_captions_live_and_cached_alike(tmp_path):
    """--weighted_captions for SDXL (upstream's ``encode_tokens_with_weights``, cached weighted as its ``is_weighted``
    caching strategy): cached and live give the same LoRA, and the weights change it."""
    data = tmp_path / "data"
    shutil.copytree(SAMPLES, data)
    for caption in (data / "10_shapes").glob("*.txt"):
        text = caption.read_text().replace("shapes, a ", "(shapes:1.6), a [[")
        caption.write_text(text.replace(", white", "]], white"))
    common = ("--network_train_unet_only", "--max_train_steps", "1")
    runs = {"live": ("--weighted_captions",), "cached": ("--weighted_captions", "--cache_text_encoder_outputs"),
            "unweighted": ()}
    for name, flags in runs.items():
        assert train(sdxl_args(tmp_path / name, *common, *flags, data=data)) == 0
    live, cached, unweighted = (load_file(tmp_path / name / "lora.safetensors") for name in runs)
    for key in live:
        torch.testing.assert_close(cached[key], live[key], rtol=0, atol=0)
    assert any(not torch.equal(live[k], unweighted[k]) for k in live)


def test_full_bf16_from_disk_caches_and_exact_resume(tmp_path):
    """Without gradient accumulation: the SR accumulator's rounding stream is not part of the saved state yet, so
    a resume with SR accumulation is not bit-exact (SD 1.x alike)."""
    data = tmp_path / "data"
    shutil.copytree(SAMPLES, data)
    common = ("--mixed_precision", "bf16", "--full_bf16", "--optimizer_type", "StochasticAdamW",
              "--gradient_checkpointing", "--network_train_unet_only",
              "--cache_text_encoder_outputs_to_disk", "--cache_latents_to_disk", "--max_train_steps", "4",
              "--save_every_n_steps", "2", "--save_state")
    assert train(sdxl_args(tmp_path / "a", *common, data=data)) == 0
    files = sorted((data / "10_shapes").glob("*_te_outputs.npz"))
    assert len(files) == 8
    # latents as sd-scripts' SdSdxlLatentsCachingStrategy names SDXL's, apart from SD 1.x/2.x's _sd.npz
    assert len(list((data / "10_shapes").glob("*_sdxl.npz"))) == 8 and not list((data / "10_shapes").glob("*_sd.npz"))
    with np.load(files[0]) as npz:
        assert {"hidden_state1", "hidden_state2", "pool2"} <= set(npz.files)
        assert npz["hidden_state1"].shape == (77, 32) and npz["pool2"].shape == (32,)
    whole = load_file(tmp_path / "a" / "lora.safetensors")
    assert {v.dtype for v in whole.values() if v.dim() > 0} == {torch.bfloat16}
    assert all(torch.isfinite(v).all() for v in whole.values())
    state = tmp_path / "a" / "lora-step00000002-state"
    assert train(sdxl_args(tmp_path / "b", *common, "--resume", str(state), data=data)) == 0
    resumed = load_file(tmp_path / "b" / "lora.safetensors")
    assert whole.keys() == resumed.keys()
    for key in whole:
        torch.testing.assert_close(resumed[key], whole[key], rtol=0, atol=0)


def test_bucket_steps_of_32_are_accepted(tmp_path):
    """sdxl_train_network.py takes ``--bucket_reso_steps 32`` (upstream's ``verify_bucket_reso_steps(32)``), which
    train_network.py refuses."""
    bucketed = ("--enable_bucket", "--bucket_reso_steps", "32", "--min_bucket_reso", "32")
    assert train(sdxl_args(tmp_path / "xl", *bucketed, "--network_train_unet_only")) == 0
    sd = ["builtin:tiny-sd15" if a == "builtin:tiny-sdxl" else a for a in sdxl_args(tmp_path / "sd", *bucketed)]
    assert train_network.main(sd) == 2 and not (tmp_path / "sd").exists()


def test_sample_images_leave_the_lora_bit_identical(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red (circle:1.2) --w 64 --h 96 --d 1 --s 2\na blue square --n red --d 2 --s 2 --l 4\n")
    common = ("--network_dropout", "0.2", "--network_train_unet_only")
    assert train(sdxl_args(tmp_path / "plain", *common)) == 0
    assert train(sdxl_args(tmp_path / "sampled", *common, "--sample_prompts", str(prompts), "--sample_at_first",
                           "--sample_every_n_steps", "1")) == 0
    plain, sampled = (load_file(tmp_path / run / "lora.safetensors") for run in ("plain", "sampled"))
    for key in plain:
        assert torch.equal(plain[key], sampled[key]), key
    names = sorted(p.name.split("_")[1:3] for p in (tmp_path / "sampled" / "sample").glob("*.png"))
    assert names == [[when, index] for when in ("000001", "000002", "e000000") for index in ("00", "01")]


def test_v_parameterization_trains_a_v_prediction_model(tmp_path):
    """sd-scripts' SDXL trainer shares train_network.py's loss, so ``--v_parameterization`` (v-prediction SDXL models
    such as NoobAI-XL v-pred) trains against the velocity; the same seed with epsilon gives another LoRA."""
    from library.config import ModelConfig
    from library.families.registry import model_family
    from library.families.sdxl.config import SDXLConfig

    cfg = ModelConfig(pretrained_model_name_or_path="builtin:tiny-sdxl", v_parameterization=True)
    model = model_family("sdxl").load(cfg, SDXLConfig(), torch.float32)
    assert model.v_parameterization and model.noise_scheduler.config.prediction_type == "v_prediction"
    common = ("--network_train_unet_only", "--max_train_steps", "1")
    assert train(sdxl_args(tmp_path / "v", *common, "--v_parameterization", "--zero_terminal_snr")) == 0
    assert train(sdxl_args(tmp_path / "eps", *common)) == 0
    v, eps = (load_file(tmp_path / run / "lora.safetensors") for run in ("v", "eps"))
    assert any(not torch.equal(v[k], eps[k]) for k in v)
    with safe_open(str(tmp_path / "v" / "lora.safetensors"), "pt") as f:
        assert f.metadata()["modelspec.prediction_type"] == "v"  # upstream build_metadata: PRED_TYPE_V
