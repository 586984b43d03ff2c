"""End to end: the real ``train_network.py`` on the built-in tiny model and the bundled sample images."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import train_network

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = ROOT / "configs" / "sample_data"


def train_args(out: Path, *extra: str, data: Path = SAMPLES) -> list[str]:
    return ["--pretrained_model_name_or_path", "builtin:tiny-sd15", "--train_data_dir", str(data),
            "--caption_extension", ".txt", "--resolution", "64", "--output_dir", str(out), "--output_name", "lora",
            "--network_module", "networks.lora", "--network_dim", "4", "--network_alpha", "2",
            "--learning_rate", "1e-3", "--train_batch_size", "2", "--max_train_steps", "3", "--seed", "1",
            "--max_data_loader_n_workers", "0", *extra]


@pytest.fixture(scope="module")
def fp32_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("fp32")
    assert train_network.main(train_args(out)) == 0
    return out / "lora.safetensors"


def test_lora_has_the_sd15_key_set(fp32_run):
    state = load_file(fp32_run)
    modules = {key.split(".")[0] for key in state}
    assert sum(m.startswith("lora_unet_") for m in modules) == 192
    assert sum(m.startswith("lora_te_text_model_encoder_layers_") for m in modules) == 72
    assert len(state) == 3 * 264
    assert state["lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q.lora_down.weight"].shape[0] == 4
    assert float(state["lora_te_text_model_encoder_layers_11_mlp_fc2.alpha"]) == 2.0


def test_training_moved_the_weights(fp32_run):
    ups = [v for k, v in load_file(fp32_run).items() if k.endswith("lora_up.weight")]
    assert any(float(v.abs().max()) > 0 for v in ups)  # lora_up starts at zero
    assert all(torch.isfinite(v).all() for v in ups)


def test_metadata_is_kohya_shaped(fp32_run):
    with safe_open(str(fp32_run), "pt") as f:
        meta = f.metadata()
    assert meta["ss_network_module"] == "networks.lora"
    assert meta["ss_network_dim"] == "4" and meta["ss_network_alpha"] == "2.0"
    assert meta["ss_steps"] == "3" and meta["ss_max_train_steps"] == "3"
    assert meta["ss_num_train_images"] == "80"  # 8 images x 10 repeats (folder 10_shapes)
    assert meta["ss_num_batches_per_epoch"] == "40"
    assert meta["ss_base_model_version"] == "sd_v1" and meta["ss_v2"] == "False"
    assert meta["modelspec.architecture"] == "stable-diffusion-v1/lora"
    assert len(meta["sshs_model_hash"]) == 64
    assert json.loads(meta["ss_tag_frequency"])


def test_diffusers_loads_every_key_and_matches_our_network(fp32_run):
    from diffusers import StableDiffusionPipeline

    from library.families.sd.tiny_files import build_tiny_sd15
    from networks.lora import create_network_from_weights

    base = build_tiny_sd15()
    pipe = StableDiffusionPipeline(vae=base.vae, text_encoder=base.text_encoder, tokenizer=base.tokenizer,
                                   unet=base.unet, scheduler=base.noise_scheduler, safety_checker=None,
                                   feature_extractor=None, requires_safety_checker=False)
    torch.manual_seed(0)
    latents, t, cond = torch.randn(1, 4, 8, 8), torch.tensor([500]), torch.randn(1, 77, 32)
    with torch.no_grad():
        before = pipe.unet(latents, t, cond).sample
        pipe.load_lora_weights(str(fp32_run))
        loaded = pipe.unet(latents, t, cond).sample
    assert not torch.allclose(before, loaded)

    ours = build_tiny_sd15()
    network, _ = create_network_from_weights(1.0, str(fp32_run), ours.vae, ours.text_encoder, ours.unet)
    network.apply_to(ours.text_encoder, ours.unet)
    network.load_weights(str(fp32_run))
    with torch.no_grad():
        mine = ours.unet(latents, t, cond).sample
    assert torch.allclose(mine, loaded, atol=1e-4)


def test_bf16_mixed_precision(tmp_path):
    assert train_network.main(train_args(tmp_path, "--mixed_precision", "bf16")) == 0
    state = load_file(tmp_path / "lora.safetensors")
    assert all(v.dtype == torch.float32 for v in state.values())  # LoRA stays fp32 without --full_bf16


def test_exported_single_file_trains(tmp_path):
    subprocess.run([sys.executable, "-m", "library.tiny_model", str(tmp_path / "model")], check=True, cwd=ROOT)
    model = tmp_path / "model" / "model.safetensors"
    args = train_args(tmp_path / "out", "--max_train_steps", "1", "--vae", str(tmp_path / "model" / "vae"))
    args[1] = str(model)
    assert train_network.main(args) == 0
    with safe_open(str(tmp_path / "out" / "lora.safetensors"), "pt") as f:
        meta = f.metadata()
    # sd-scripts: ss_sd_model_hash = train_util.model_hash (sha256 of the 64 KiB at 1 MiB, 8 hex digits),
    # ss_new_sd_model_hash = calculate_sha256 (the whole file); a VAE folder is only named
    data = model.read_bytes()
    assert meta["ss_sd_model_name"] == "model.safetensors"
    assert meta["ss_sd_model_hash"] == hashlib.sha256(data[0x100000:0x110000]).hexdigest()[:8]
    assert meta["ss_new_sd_model_hash"] == hashlib.sha256(data).hexdigest()
    assert meta["ss_vae_name"] == "vae" and "ss_vae_hash" not in meta


def refused(capsys, args: list[str], *needles: str) -> str:
    """Run ``train_network.main(args)``; it must exit 2 with every needle in stderr and no traceback."""
    assert train_network.main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, err
    return err


def _fails_cleanly(capsys, out: Path, args: list[str], needle: str) -> None:
    assert train_network.main(args) == 2
    assert needle in capsys.readouterr().err
    assert not out.exists() or not any(out.iterdir())


def test_missing_model_path(tmp_path, capsys):
    args = train_args(tmp_path / "out")
    args[1] = str(tmp_path / "nowhere.safetensors")
    _fails_cleanly(capsys, tmp_path / "out", args, "nowhere.safetensors")


def test_empty_data_folder(tmp_path, capsys):
    (tmp_path / "data").mkdir()
    data = tmp_path / "data"
    _fails_cleanly(capsys, tmp_path / "out", train_args(tmp_path / "out", data=data), str(data))


def test_corrupt_image_is_named(tmp_path, capsys):
    folder = tmp_path / "data" / "5_thing"
    folder.mkdir(parents=True)
    (folder / "broken.png").write_bytes(b"not a png at all")
    _fails_cleanly(capsys, tmp_path / "out", train_args(tmp_path / "out", data=tmp_path / "data"), "broken.png")


def test_misspelled_config_key(tmp_path, capsys):
    toml = tmp_path / "args.toml"
    toml.write_text("network_dimm = 4\n")
    _fails_cleanly(capsys, tmp_path / "out", train_args(tmp_path / "out", "--config_file", str(toml)),
                   'did you mean "network_dim"')


def test_help_and_config_errors_do_not_import_torch():
    """Every family's parser and record answer without torch (its behaviour is loaded only to train)."""
    code = ("import sys; import train_network; from library.config import cli; "
            "from library.families.registry import FAMILIES; "
            "[cli.build_parser(spec).format_help() for spec in FAMILIES.values()]; "
            "print('torch' in sys.modules, 'diffusers' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert result.stdout.strip() == "False False"


def test_unet_only_and_ckpt_format(tmp_path):
    args = train_args(tmp_path, "--network_train_unet_only", "--save_model_as", "ckpt", "--max_train_steps", "1")
    assert train_network.main(args) == 0
    state = torch.load(tmp_path / "lora.ckpt", weights_only=True)
    modules = {key.split(".")[0] for key in state}
    assert len(modules) == 192 and all(m.startswith("lora_unet_") for m in modules)


def test_epoch_saves_and_pruning(tmp_path):
    # 8 images x 10 repeats / batch 16 = 5 steps per epoch; 4 epochs, a save every epoch, keep the last 2.
    args = train_args(tmp_path, "--train_batch_size", "16", "--max_train_epochs", "4", "--save_every_n_epochs", "1",
                      "--save_last_n_epochs", "2")
    assert train_network.main(args) == 0
    names = sorted(p.name for p in tmp_path.iterdir())
    # epochs 1..3 are saved by the epoch rule (the last epoch is the final file); 1 is pruned after 3
    assert names == ["lora-000002.safetensors", "lora-000003.safetensors", "lora.safetensors"]
    with safe_open(str(tmp_path / "lora-000002.safetensors"), "pt") as f:
        assert f.metadata()["ss_epoch"] == "2" and f.metadata()["ss_steps"] == "10"
