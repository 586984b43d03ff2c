"""End to end: sample images while training the tiny model; the LoRA must come out bit-identical to a run without
samples, resume must stay exact, and a bad prompt file must stop the run before anything loads."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

import train_network
from tests.e2e.test_train_network import SAMPLES, train_args

PROMPTS = ("# two sample images\n"
           "a red square --w 64 --h 72 --d 1 --s 2\n"
           "a blue circle --n red --w 64 --h 64 --d 2 --s 2 --ss euler_a --l 4\n")
# dropouts on, so that drawing samples in training mode (or from the global RNG) would change the LoRA
COMMON = ("--max_train_steps", "4", "--save_every_n_steps", "2", "--save_state", "--cache_latents",
          "--network_dropout", "0.2", "--network_args", "rank_dropout=0.2", "module_dropout=0.2")


def sampling_args(prompts: Path, logs: Path) -> tuple[str, ...]:
    return ("--sample_prompts", str(prompts), "--sample_every_n_steps", "1", "--sample_at_first",
            "--logging_dir", str(logs))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sampling")
    prompts = root / "prompts.txt"
    prompts.write_text(PROMPTS, encoding="utf-8")
    assert train_network.main(train_args(root / "plain", *COMMON)) == 0
    assert train_network.main(train_args(root / "sampled", *COMMON, *sampling_args(prompts, root / "logs"))) == 0
    return root


def assert_same_lora(a: Path, b: Path) -> None:
    first, second = load_file(a), load_file(b)
    assert first.keys() == second.keys()
    for key in first:
        assert torch.equal(first[key], second[key]), key


def test_sampling_leaves_the_lora_bit_identical(runs):
    assert_same_lora(runs / "plain" / "lora.safetensors", runs / "sampled" / "lora.safetensors")
    assert_same_lora(runs / "plain" / "lora-step00000002.safetensors",
                     runs / "sampled" / "lora-step00000002.safetensors")


def test_sampling_leaves_the_saved_state_identical(runs):
    # LoRA weights, optimizer state and the generator states (global torch and Python RNGs included), byte for byte
    plain, sampled = ((runs / run / "lora-step00000002-state" / "state.safetensors").read_bytes()
                      for run in ("plain", "sampled"))
    assert plain == sampled


def test_sample_file_names_and_sizes(runs):
    files = sorted((runs / "sampled" / "sample").iterdir())
    stems = [f.name.split("_") for f in files]
    assert [s[:3] for s in stems] == [["lora", n, i] for n in ("000001", "000002", "000003", "000004", "e000000")
                                      for i in ("00", "01")]
    assert all(len(s[3]) == 14 and s[3].isdigit() for s in stems)  # YYYYmmddHHMMSS
    assert {s[2]: s[4] for s in stems} == {"00": "1.png", "01": "2.png"}  # the seeds
    assert {f.name.split("_")[2]: Image.open(f).size for f in files} == {"00": (64, 72), "01": (64, 64)}


def test_tensorboard_gets_the_images(runs):
    from tensorboard.backend.event_processing.event_accumulator import IMAGES, EventAccumulator

    events = EventAccumulator(str(next((runs / "logs").iterdir())), size_guidance={IMAGES: 0})
    events.Reload()
    assert [e.step for e in events.Images("sample_0")] == [0, 1, 2, 3, 4]
    assert [(e.width, e.height) for e in events.Images("sample_1")] == [(64, 64)] * 5


def test_resume_with_sampling_equals_uninterrupted(runs, tmp_path):
    args = train_args(tmp_path, *COMMON, *sampling_args(runs / "prompts.txt", tmp_path / "logs"), "--resume",
                      str(runs / "sampled" / "lora-step00000002-state"))
    assert train_network.main(args) == 0
    assert_same_lora(runs / "plain" / "lora.safetensors", tmp_path / "lora.safetensors")
    numbers = sorted({f.name.split("_")[1] for f in (tmp_path / "sample").iterdir()})
    assert numbers == ["000003", "000004", "e000000"]  # at first (epoch 0, as sd-scripts), then steps 3 and 4


def test_epochs_win_over_steps(tmp_path):
    data = tmp_path / "data" / "1_shapes"
    data.mkdir(parents=True)
    for name in ("00_red_circle", "01_blue_square"):
        for ext in (".png", ".txt"):
            shutil.copy(SAMPLES / "10_shapes" / f"{name}{ext}", data / f"{name}{ext}")
    prompts = tmp_path / "p.json"
    prompts.write_text('[{"prompt": "a red circle", "width": 64, "height": 64, "sample_steps": 1, "seed": 3}]')
    args = train_args(tmp_path / "out", "--train_batch_size", "1", "--max_train_epochs", "2", "--sample_prompts",
                      str(prompts), "--sample_every_n_epochs", "1", "--sample_every_n_steps", "1",
                      data=tmp_path / "data")
    assert train_network.main(args) == 0
    names = sorted(f.name.split("_")[1] for f in (tmp_path / "out" / "sample").iterdir())
    assert names == ["e000001", "e000002"]


def test_bad_prompt_file_stops_before_anything_loads(tmp_path, capsys, monkeypatch):
    import library.runtime.run

    def must_not_run(*args, **kwargs):
        raise AssertionError("loaded before the prompt file was checked")

    monkeypatch.setattr(library.runtime.run, "build_train_data", must_not_run)
    monkeypatch.setattr(library.runtime.run.model_setup, "load_model", must_not_run)
    prompts = tmp_path / "p.txt"
    prompts.write_text("fine --w 64\nbad --x 3 --s many\n", encoding="utf-8")
    out = tmp_path / "out"
    code = train_network.main(train_args(out, "--sample_prompts", str(prompts), "--sample_every_n_steps", "1"))
    err = capsys.readouterr().err
    assert code == 2
    assert f"{prompts}:2: unknown option --x" in err and f"{prompts}:2: --s 'many'" in err
    assert not out.exists()


def test_missing_prompt_file_is_named(tmp_path, capsys):
    missing = tmp_path / "nope.toml"
    code = train_network.main(train_args(tmp_path / "out", "--sample_prompts", str(missing), "--sample_at_first"))
    assert code == 2 and f"--sample_prompts {missing}: no such file" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_no_pipeline_import_without_sampling():
    code = ("import sys; import library.runtime.run; "
            "print(any(m.startswith(('diffusers.pipelines', 'diffusers.schedulers.scheduling_')) "
            "for m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            cwd=Path(__file__).resolve().parents[2])
    assert result.stdout.strip() == "False"


def test_full_bf16_with_half_vae_and_clip_skip(tmp_path):
    prompts = tmp_path / "p.toml"
    prompts.write_text('[prompt]\nwidth = 64\nheight = 64\nsample_steps = 2\n[[prompt.subset]]\n'
                       'prompt = "a red circle"\nnegative_prompt = "blue"\nseed = 4\nsample_sampler = "dpmsolver++"\n',
                       encoding="utf-8")
    args = train_args(tmp_path / "out", "--mixed_precision", "bf16", "--full_bf16", "--clip_skip", "2",
                      "--max_train_steps", "1", "--sample_prompts", str(prompts), "--sample_at_first")
    assert train_network.main(args) == 0
    (image,) = (tmp_path / "out" / "sample").iterdir()
    assert image.name.startswith("lora_e000000_00_") and image.name.endswith("_4.png")
    assert Image.open(image).size == (64, 64)
