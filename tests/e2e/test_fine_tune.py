"""End to end: the full fine-tuning scripts (``fine_tune.py``, ``train_db.py``, ``sdxl_train.py``) on the built-in
tiny models: what each trains and leaves frozen, the checkpoint formats of sd-scripts' ``--save_model_as`` read back
by diffusers' own loaders, the ModelSpec metadata upstream writes into a checkpoint, and an exact resume.

Expected facts come from upstream 48d368fa: ``model_util.save_stable_diffusion_checkpoint`` (a ``.ckpt`` holds
``state_dict``, ``epoch`` and ``global_step``), ``sai_model_spec.build_metadata`` with ``is_stable_diffusion_ckpt``
(architecture without "/lora", Stability AI's implementation, no ``ss_*`` entries), and diffusers' converters.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import train_network
from tests.e2e.test_train_network import SAMPLES
from tests.e2e.test_validation import scalars

ROOT = Path(__file__).resolve().parents[2]


def images(root: Path) -> Path:
    """Four of the bundled images with their captions in one DreamBooth folder (1 repeat)."""
    folder = root / "1_shapes"
    folder.mkdir(parents=True)
    for image in sorted((SAMPLES / "10_shapes").glob("*.png"))[:4]:
        shutil.copy(image, folder)
        shutil.copy(image.with_suffix(".txt"), folder)
    return root


def common(out: Path, *extra: str) -> list[str]:
    return ["--resolution", "64", "--output_dir", str(out), "--output_name", "model", "--learning_rate", "1e-3",
            "--train_batch_size", "2", "--seed", "3", "--max_data_loader_n_workers", "0", "--mixed_precision", "bf16",
            "--full_bf16", "--optimizer_type", "StochasticAdamW", *extra]


def same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k].float(), sb[k].float()) for k in sa)


def start_sd():
    from library.families.sd.loading import load_sd_model

    return load_sd_model("builtin:tiny-sd15", v2=False, v_parameterization=False, vae=None)


@pytest.fixture(scope="module")
def fine_tuned(tmp_path_factory):
    """``fine_tune.py`` from an ``--in_json`` made by ``finetune/merge_captions_to_metadata.py``: two updates of
    the U-Net and text encoder in full bf16, a state saved after the first."""
    root = tmp_path_factory.mktemp("fine_tune")
    data = images(root / "data") / "1_shapes"
    subprocess.run([sys.executable, "finetune/merge_captions_to_metadata.py", str(data), str(root / "meta.json"),
                    "--caption_extension", ".txt"], check=True, cwd=ROOT)
    (root / "prompts.txt").write_text("a red square --w 64 --h 64 --d 1 --s 2\n", encoding="utf-8")
    args = ["--pretrained_model_name_or_path", "builtin:tiny-sd15", "--in_json", str(root / "meta.json"),
            "--train_data_dir", str(data), "--train_text_encoder", "--save_model_as", "safetensors",
            "--max_train_steps", "2", "--save_every_n_steps", "1", "--save_state", "--sample_prompts",
            str(root / "prompts.txt"), "--sample_every_n_steps", "1", "--logging_dir", str(root / "logs")]
    assert train_network.main(common(root / "out", *args), family="sd", script="fine_tune.py") == 0
    return root, args


def test_samples_and_the_report_of_a_fine_tuning_run(fine_tuned):
    """The sample images of each step and the report picture (``library/report``), as a LoRA run has them."""
    from library.report.cli import build_report

    root, _ = fine_tuned
    steps = sorted(path.name.split("_")[1] for path in (root / "out" / "sample").glob("model_*.png"))
    assert steps == ["000001", "000002"]
    picture = build_report(root / "logs", samples=root / "out" / "sample", prompts=root / "prompts.txt",
                           out=root / "report.png")
    assert picture.stat().st_size > 10_000


def test_fine_tune_trains_unet_and_text_encoder_and_keeps_the_vae(fine_tuned):
    from library.families.sd.loading import load_sd_model

    root, _ = fine_tuned
    trained = load_sd_model(str(root / "out" / "model.safetensors"), v2=False, v_parameterization=False, vae=None)
    start = start_sd()
    assert not same(trained.unet, start.unet) and not same(trained.text_encoder, start.text_encoder)
    assert same(trained.vae, start.vae.to(torch.bfloat16).float())
    with safe_open(str(root / "out" / "model.safetensors"), "pt") as f:
        unet_key = "model.diffusion_model.out.2.weight"
        assert f.get_tensor(unet_key).dtype == torch.bfloat16  # saved as trained (no --save_precision)


def test_checkpoint_metadata_is_upstreams_modelspec(fine_tuned):
    root, _ = fine_tuned
    with safe_open(str(root / "out" / "model.safetensors"), "pt") as f:
        meta = f.metadata()
    assert meta["modelspec.architecture"] == "stable-diffusion-v1"
    assert meta["modelspec.implementation"] == "https://github.com/Stability-AI/generative-models"
    assert meta["modelspec.title"] == "model" and meta["modelspec.prediction_type"] == "epsilon"
    assert meta["modelspec.resolution"] == "64x64"
    assert not [key for key in meta if key.startswith("ss_")]


def test_diffusers_reads_the_single_file(fine_tuned, tmp_path):
    from diffusers import StableDiffusionPipeline

    from library.families.sd.loading import load_sd_model
    from library.families.sd.tiny_files import save_diffusers_folder

    root, _ = fine_tuned
    save_diffusers_folder(start_sd(), tmp_path / "config")
    path = root / "out" / "model.safetensors"
    pipe = StableDiffusionPipeline.from_single_file(str(path), config=str(tmp_path / "config"),
                                                    local_files_only=True, safety_checker=None)
    ours = load_sd_model(str(path), v2=False, v_parameterization=False, vae=None)
    for part in ("unet", "text_encoder", "vae"):
        assert same(getattr(pipe, part), getattr(ours, part)), part


def test_resume_from_the_step_state_equals_the_uninterrupted_run(fine_tuned, tmp_path):
    root, args = fine_tuned
    resumed = [*args, "--resume", str(root / "out" / "model-step00000001-state")]
    assert train_network.main(common(tmp_path, *resumed), family="sd", script="fine_tune.py") == 0
    a, b = load_file(root / "out" / "model.safetensors"), load_file(tmp_path / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_dreambooth_without_the_text_encoder_writes_upstreams_ckpt(tmp_path):
    data, reg = images(tmp_path / "data"), images(tmp_path / "reg")
    args = ["--pretrained_model_name_or_path", "builtin:tiny-sd15", "--train_data_dir", str(data),
            "--reg_data_dir", str(reg), "--caption_extension", ".txt", "--stop_text_encoder_training", "-1",
            "--save_model_as", "ckpt", "--max_train_steps", "1"]
    assert train_network.main(common(tmp_path / "out", *args), family="sd", script="train_db.py") == 0
    checkpoint = torch.load(tmp_path / "out" / "model.ckpt", weights_only=True)
    assert sorted(checkpoint) == ["epoch", "global_step", "state_dict"] and checkpoint["global_step"] == 1
    state = checkpoint["state_dict"]
    start = start_sd().text_encoder.state_dict()
    prefix = "cond_stage_model.transformer.text_model."
    for key, tensor in start.items():
        if key.startswith("text_model.") and prefix + key.removeprefix("text_model.") in state:
            assert torch.equal(state[prefix + key.removeprefix("text_model.")].float(),
                               tensor.to(torch.bfloat16).float()), key


def test_dreambooth_stops_training_the_text_encoder_after_n_updates(tmp_path):
    """``--stop_text_encoder_training 2``: the text encoder moves in updates 1 and 2 only (upstream freezes it when
    ``global_step`` reaches 2), the U-Net in every update; a run resumed after update 3 keeps it frozen, its result
    the uninterrupted run's. The run validates on a held-out image every 2 updates, as a LoRA run does."""
    args = ["--pretrained_model_name_or_path", "builtin:tiny-sd15", "--train_data_dir", str(images(tmp_path / "d")),
            "--caption_extension", ".txt", "--stop_text_encoder_training", "2", "--save_model_as", "safetensors",
            "--max_train_steps", "4", "--train_batch_size", "1", "--save_every_n_steps", "1", "--save_state",
            "--validation_split", "0.25", "--validate_every_n_steps", "2", "--logging_dir", str(tmp_path / "logs")]
    assert train_network.main(common(tmp_path / "out", *args), family="sd", script="train_db.py") == 0
    validation = scalars(tmp_path / "logs")["loss/validation/step_average"]
    assert [step for step, _ in validation] == [2, 4] and all(0 < loss < 10 for _, loss in validation)
    out = tmp_path / "out"
    files = [load_file(out / f"model-step0000000{step}.safetensors") for step in (1, 2, 3)]
    files.append(load_file(out / "model.safetensors"))
    text = [key for key in files[0] if key.startswith("cond_stage_model.") and "position_ids" not in key]
    unet = [key for key in files[0] if key.startswith("model.diffusion_model.")]
    start = {"cond_stage_model.transformer.text_model." + k.removeprefix("text_model."): v.to(torch.bfloat16)
             for k, v in start_sd().text_encoder.state_dict().items()}

    def moved(a, b, keys):
        return sum(not torch.equal(a[k].float(), b[k].float()) for k in keys)

    assert moved(start, files[0], [k for k in text if k in start]) > len(text) // 2
    assert moved(files[0], files[1], text) > len(text) // 2
    assert moved(files[1], files[2], text) == moved(files[2], files[3], text) == 0
    assert all(moved(a, b, unet) > len(unet) // 2 for a, b in zip(files, files[1:], strict=False))
    resumed = [*args, "--resume", str(out / "model-step00000003-state")]
    assert train_network.main(common(tmp_path / "resumed", *resumed), family="sd", script="train_db.py") == 0
    again = load_file(tmp_path / "resumed" / "model.safetensors")
    assert again.keys() == files[3].keys() and moved(again, files[3], list(again)) == 0


def test_sdxl_train_writes_a_diffusers_folder_with_the_chosen_text_encoder_trained(tmp_path):
    from diffusers import StableDiffusionXLPipeline

    from library.families.sdxl.loading import build_builtin_sdxl

    args = ["--pretrained_model_name_or_path", "builtin:tiny-sdxl", "--train_data_dir", str(images(tmp_path / "d")),
            "--caption_extension", ".txt", "--train_text_encoder", "--learning_rate_te1", "0",
            "--save_model_as", "diffusers_safetensors", "--max_train_steps", "1"]
    assert train_network.main(common(tmp_path / "out", *args), family="sdxl", script="sdxl_train.py") == 0
    pipe = StableDiffusionXLPipeline.from_pretrained(str(tmp_path / "out" / "model"), local_files_only=True)
    start = build_builtin_sdxl("builtin:tiny-sdxl", 0)
    assert same(pipe.text_encoder, start.text_encoder.to(torch.bfloat16))
    assert not same(pipe.text_encoder_2, start.text_encoder_2.to(torch.bfloat16))
    assert not same(pipe.unet, start.unet.to(torch.bfloat16))


@pytest.mark.parametrize(("script", "family", "flags", "needle"), [
    ("fine_tune.py", "sd", ["--network_dim", "4"], "train_network.py"),
    ("sdxl_train.py", "sdxl", ["--block_lr", ",".join(["1e-4"] * 22)], "--block_lr: 22 values given"),
    ("train_db.py", "sd", ["--fp8_base"], "--fp8_base"),
])
def test_refused_before_anything_loads(tmp_path, capsys, script, family, flags, needle):
    args = ["--pretrained_model_name_or_path", "builtin:tiny-sd15", "--train_data_dir", str(SAMPLES), *flags]
    assert train_network.main(common(tmp_path / "out", *args), family=family, script=script) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()
