"""End to end (issue 31): ``flux_train.py``, FLUX.1 full fine-tuning, on the built-in tiny FLUX.1: the transformer
trains and the text encoders stay frozen; the checkpoint is one ``.safetensors`` file of the transformer under BFL's
names with upstream's ModelSpec entries, which loads back as a transformer and trains on from there (with the tiny
model's CLIP-L, T5-XXL and AE files, as a FLUX.1 file needs ``--clip_l``, ``--t5xxl``, ``--ae``); samples, the
validation loss and ``lr/unet`` are logged as in a LoRA run; a resume from a step's state equals the uninterrupted
run.

Expected facts come from upstream 48d368fa: ``flux_train_utils.save_models`` (``flux.state_dict()`` as it is, no
prefix, each tensor in the save dtype), ``get_sai_model_spec(..., is_stable_diffusion_ckpt=True, flux="dev")``
(architecture flux-1-dev, BFL's implementation, no ``ss_*`` entries), ``append_lr_to_logs`` (``lr/unet``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import train_network
from tests.e2e.test_fine_tune import images
from tests.e2e.test_validation import scalars

MODEL = "builtin:tiny-flux"


def common(out: Path, data: Path, *extra: str) -> list[str]:
    return ["--train_data_dir", str(data), "--resolution", "64", "--output_dir", str(out), "--output_name", "model",
            "--learning_rate", "1e-3", "--train_batch_size", "2", "--seed", "3", "--max_data_loader_n_workers", "0",
            "--mixed_precision", "bf16", "--optimizer_type", "StochasticAdamW", "--cache_latents",
            "--caption_extension", ".txt", *extra]


def start_transformer() -> torch.nn.Module:
    from library.families.flux.builtin import build_builtin_flux

    return build_builtin_flux(MODEL, 0).unet


@pytest.fixture(scope="module")
def fine_tuned(tmp_path_factory):
    """Two updates of the transformer (``--mixed_precision bf16``: bf16 weights, as upstream's flux_train.py), a
    state saved after the first, samples and the validation loss after each."""
    root = tmp_path_factory.mktemp("flux_train")
    data = images(root / "data")
    (root / "prompts.txt").write_text("a red square --w 64 --h 64 --d 1 --s 2\n", encoding="utf-8")
    args = ["--pretrained_model_name_or_path", MODEL, "--max_train_steps", "2", "--save_every_n_steps", "1",
            "--save_state", "--cache_text_encoder_outputs", "--sample_prompts", str(root / "prompts.txt"),
            "--sample_every_n_steps", "1", "--logging_dir", str(root / "logs"), "--validation_split", "0.25",
            "--validate_every_n_steps", "1"]
    assert train_network.main(common(root / "out", data, *args), script="flux_train.py") == 0
    return root, data, args


def test_the_transformer_trains_in_bf16_and_is_saved_under_bfl_names(fine_tuned):
    from library.families.flux.checkpoints import load_transformer

    root, _, _ = fine_tuned
    path = root / "out" / "model.safetensors"
    start = start_transformer()
    saved = load_file(path)
    assert saved.keys() == start.state_dict().keys()  # upstream's flux.state_dict(): no prefix, nothing else
    assert {tensor.dtype for tensor in saved.values()} == {torch.bfloat16}  # as trained (no --save_precision)
    trained = load_transformer(path)
    changed = [k for k, v in trained.state_dict().items() if not torch.equal(v, start.state_dict()[k].bfloat16())]
    assert len(changed) > len(saved) // 2


def test_checkpoint_metadata_is_upstreams_modelspec(fine_tuned):
    root, _, _ = fine_tuned
    with safe_open(str(root / "out" / "model.safetensors"), "pt") as f:
        meta = f.metadata()
    assert meta["modelspec.architecture"] == "flux-1-dev"
    assert meta["modelspec.implementation"] == "https://github.com/black-forest-labs/flux"
    assert meta["modelspec.resolution"] == "64x64" and meta["modelspec.title"] == "model"
    assert "modelspec.prediction_type" not in meta and not [key for key in meta if key.startswith("ss_")]


def test_samples_validation_and_the_learning_rate_are_logged(fine_tuned):
    root, _, _ = fine_tuned
    steps = sorted(path.name.split("_")[1] for path in (root / "out" / "sample").glob("model_*.png"))
    assert steps == ["000001", "000002"]
    logged = scalars(root / "logs")
    assert [step for step, _ in logged["lr/unet"]] == [1, 2]
    assert any(tag.startswith("loss/validation") for tag in logged)


def test_resume_from_the_step_state_equals_the_uninterrupted_run(fine_tuned, tmp_path):
    root, data, args = fine_tuned
    resumed = [*args, "--resume", str(root / "out" / "model-step00000001-state")]
    assert train_network.main(common(tmp_path, data, *resumed), script="flux_train.py") == 0
    a, b = load_file(root / "out" / "model.safetensors"), load_file(tmp_path / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_checkpoint_trains_on_with_the_text_encoder_and_ae_files(fine_tuned, tmp_path):
    """A FLUX.1 single file holds the transformer alone: training on from it takes ``--clip_l``, ``--t5xxl`` and
    ``--ae`` (here the tiny model's, as ``python -m library.tiny_model --flux`` writes them), with fp32 saving."""
    from library.families.flux.tiny_files import write_tiny_flux

    root, data, _ = fine_tuned
    write_tiny_flux(tmp_path / "tiny")
    files = {"--clip_l": "clip_l", "--t5xxl": "t5xxl", "--ae": "ae"}
    argv = ["--pretrained_model_name_or_path", str(root / "out" / "model.safetensors"), "--max_train_steps", "1",
            "--save_precision", "float",
            *[item for flag, name in files.items() for item in (flag, str(tmp_path / "tiny" / f"{name}.safetensors"))]]
    assert train_network.main(common(tmp_path / "out", data, *argv), script="flux_train.py") == 0
    after, before = load_file(tmp_path / "out" / "model.safetensors"), load_file(root / "out" / "model.safetensors")
    assert {tensor.dtype for tensor in after.values()} == {torch.float32}
    assert sum(not torch.equal(after[k].bfloat16(), before[k]) for k in before) > len(before) // 2
