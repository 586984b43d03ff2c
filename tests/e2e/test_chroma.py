"""End to end (issue 31): ``--model_type chroma`` on the built-in tiny Chroma, with ``flux_train_network.py`` (a
LoRA) and ``flux_train.py`` (the whole transformer).

Facts from upstream 48d368fa: the LoRA of ``networks/lora_flux.py`` on Chroma has 8 modules per double block and 2
per single block (no modulation layers exist) and none on the text encoders (``train_clip_l`` is False for Chroma);
its metadata has ``ss_model_type`` chroma, ``ss_base_model_version`` chroma (``MODEL_VERSION_CHROMA``) and ModelSpec
``chroma/lora`` with Chroma's implementation (``sai_model_spec``); sample images take a negative prompt with a CFG
scale (``--n``, ``--l``), as Chroma is sampled; a full fine-tuning checkpoint is the transformer's state dict
(``flux_train_utils.save_models``), architecture ``chroma``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

import train_network
from tests.e2e.test_fine_tune import images

CHROMA = ["--pretrained_model_name_or_path", "builtin:tiny-chroma", "--model_type", "chroma", "--apply_t5_attn_mask",
          "--guidance_scale", "0.0", "--timestep_sampling", "sigmoid", "--model_prediction_type", "raw"]


def common(out: Path, data: Path, *extra: str) -> list[str]:
    return [*CHROMA, "--train_data_dir", str(data), "--resolution", "64", "--output_dir", str(out), "--output_name",
            "out", "--train_batch_size", "2", "--seed", "3", "--max_data_loader_n_workers", "0", "--caption_extension",
            ".txt", "--cache_latents", "--max_train_steps", "2", *extra]


def test_a_chroma_lora_trains_samples_and_names_its_base_model(tmp_path):
    data = images(tmp_path / "data")
    (tmp_path / "prompts.txt").write_text("a red square --w 64 --h 64 --d 1 --s 2 --g 0 --l 4.0 --n blurry\n",
                                          encoding="utf-8")
    args = common(tmp_path / "out", data, "--network_module", "networks.lora_flux", "--network_dim", "4",
                  "--network_alpha", "2", "--learning_rate", "1e-3", "--sample_prompts", str(tmp_path / "prompts.txt"),
                  "--sample_every_n_steps", "2")
    assert train_network.main(args, family="flux") == 0
    path = tmp_path / "out" / "out.safetensors"
    lora = load_file(path)
    modules = {key.split(".")[0] for key in lora}
    assert len(modules) == 2 * 8 + 2 * 2 and all(name.startswith("lora_unet_") for name in modules)
    assert any(tensor.abs().max() > 0 for key, tensor in lora.items() if key.endswith("lora_up.weight"))
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    assert (meta["ss_model_type"], meta["ss_base_model_version"], meta["modelspec.architecture"]) == (
        "chroma", "chroma", "chroma/lora")
    assert meta["modelspec.implementation"] == "https://huggingface.co/lodestones/Chroma"
    assert len(list((tmp_path / "out" / "sample").glob("*.png"))) == 1


def test_flux_train_fine_tunes_chromas_transformer(tmp_path):
    from library.families.flux.builtin import build_builtin_flux
    from library.families.flux.checkpoints import load_transformer
    from library.families.flux.chroma import ChromaTransformer

    data = images(tmp_path / "data")
    args = common(tmp_path / "out", data, "--mixed_precision", "bf16", "--optimizer_type", "StochasticAdamW",
                  "--learning_rate", "1e-3", "--fused_backward_pass", "--cache_text_encoder_outputs")
    assert train_network.main(args, family="flux", script="flux_train.py") == 0
    path = tmp_path / "out" / "out.safetensors"
    trained = load_transformer(path, model_type="chroma")
    start = build_builtin_flux("builtin:tiny-chroma", 0).unet.state_dict()
    assert isinstance(trained, ChromaTransformer) and trained.state_dict().keys() == start.keys()
    moved = [k for k, v in trained.state_dict().items() if not torch.equal(v, start[k].bfloat16())]
    approximator = [k for k in start if k.startswith("distilled_guidance_layer.")]
    # upstream computes the modulation vectors under no_grad: the approximator never trains, the rest does
    assert not set(approximator) & set(moved) and len(moved) > (len(start) - len(approximator)) // 2
    with safe_open(str(path), "pt") as f:
        assert f.metadata()["modelspec.architecture"] == "chroma"
