"""``finetune/prepare_buckets_latents.py`` against upstream's: the same arguments, byte for byte the out_json and the
same kinds of warnings upstream's script gave for the same input (``tests/data/upstream_prepare_buckets.py`` ran it
with a random SD 1.5 VAE; ours runs with ``builtin:tiny-sd15``: the VAE does not change the file). Where ours does
more: the latent cache files it writes are those a ``fine_tune.py --cache_latents_to_disk`` run then reuses, holding
the VAE's encoding of the image resized and cropped to the bucket upstream picked; bad input ends in exit 2 naming
the path or flag, with nothing written."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from finetune import prepare_buckets_latents as tool
from tests.data.upstream_finetune_metadata import parser_arguments
from tests.data.upstream_prepare_buckets import CASES, MODEL, build_inputs

EXPECTED = Path(__file__).resolve().parents[2] / "data" / "upstream_prepare_buckets"
TINY = "builtin:tiny-sd15"
# what upstream warned about (a phrase of its message) -> the phrase of ours saying the same
WARNING_TOPICS = {"multiple of 8": "is not a multiple of 8", "divisible by 32": "is not a multiple of 32",
                  "ignored if bucket_no_upscale": "ignored with bucket_no_upscale"}


@pytest.fixture
def inputs(tmp_path, monkeypatch):
    build_inputs(tmp_path)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _ours(args: list[str], model: str = TINY) -> list[str]:
    return [model if arg == MODEL else arg for arg in args]


def _topics(messages: list[str], phrases) -> set[str]:
    return {phrase for phrase in phrases for message in messages if phrase in message}


def test_out_json_and_warnings_are_upstreams(inputs, caplog, monkeypatch):
    """The latents, not part of out_json, are not encoded here (the tests below look at them)."""
    record = json.loads((EXPECTED / "record.json").read_text(encoding="utf-8"))["cases"]
    monkeypatch.setattr(tool, "encode", lambda *args: None)
    wrong = []
    for case, args in CASES.items():
        caplog.clear()
        caplog.set_level(logging.INFO)
        assert tool.main(_ours(args)) == 0, case
        if (inputs / args[2]).read_bytes() != (EXPECTED / f"{case}.json").read_bytes():
            wrong.append(f"{case}: out_json {(inputs / args[2]).read_text()}")
        ours = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        upstream_topics = _topics(record[case]["warnings"], WARNING_TOPICS)
        if _topics(ours, WARNING_TOPICS.values()) != {WARNING_TOPICS[t] for t in upstream_topics}:
            wrong.append(f"{case}: warnings {ours}, upstream's {record[case]['warnings']}")
    assert wrong == []


def test_arguments_are_upstreams():
    assert parser_arguments(tool.setup_parser()) == json.loads((EXPECTED / "parser.json").read_text())


def _written(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in [*root.rglob("*.npz"), *(root / "out").iterdir()])


def _refused(capsys, root: Path, args: list[str], *words: str) -> None:
    assert tool.main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for word in words:
        assert word in err, err
    assert _written(root) == []


def test_missing_in_json(inputs, capsys):
    _refused(capsys, inputs, ["data", "gone.json", "out/x.json", TINY], "in_json gone.json",
             "merge_captions_to_metadata.py")


@pytest.mark.parametrize("text", ["512", "512,x", "512,512,3", "0,512"])
def test_max_resolution_not_width_height(inputs, capsys, text):
    _refused(capsys, inputs, ["data", "meta.json", "out/x.json", TINY, "--max_resolution", text],
             "--max_resolution", f'"{text}"', "WIDTH,HEIGHT")


def test_corrupt_image_is_named(inputs, capsys):
    (inputs / "data" / "07_broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not an image")
    _refused(capsys, inputs, ["data", "meta.json", "out/x.json", TINY], "data/07_broken.png", "cannot decode")


@pytest.mark.parametrize("model", ["missing/model", "builtin:nothing"])
def test_missing_model(inputs, capsys, model):
    _refused(capsys, inputs, ["data", "meta.json", "out/x.json", model], f"model_name_or_path {model}")


def test_image_smaller_than_the_steps_without_upscaling(inputs, capsys):
    """Upstream divides by zero here (``record.json``: ``no_upscale_tiny_image``)."""
    fact = json.loads((EXPECTED / "record.json").read_text(encoding="utf-8"))["facts"]["no_upscale_tiny_image"]
    assert fact["last_stderr_line"].startswith("ZeroDivisionError")
    _refused(capsys, inputs, ["data", "meta.json", "out/x.json", TINY, "--bucket_no_upscale", "--max_resolution",
                              "256,256"], "data/04_purple_square.png", "bucket_reso_steps")


def _caches(root: Path) -> dict[str, tuple[int, bytes]]:
    return {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in root.rglob("*.npz")}


def _encoded(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("caching latents:")]


def test_fine_tune_reuses_every_cache_file(inputs, caplog):
    import train_network

    (inputs / "captions.json").write_text(json.dumps({"00_red_circle": {"caption": "a red circle"}}))
    buckets = ["--min_bucket_reso", "64", "--max_bucket_reso", "256", "--flip_aug", "--mixed_precision", "bf16"]
    assert tool.main(["data", "captions.json", "out/meta.json", TINY, "--max_resolution", "128,128",
                      *buckets]) == 0
    made = _caches(inputs)
    assert sorted(made) == sorted(f"{p.stem}_{Image.open(p).width:04d}x{Image.open(p).height:04d}_sd.npz"
                                  for p in (inputs / "data").glob("*.png"))
    caplog.clear()
    caplog.set_level(logging.INFO)
    args = ["--pretrained_model_name_or_path", TINY, "--in_json", "out/meta.json", "--train_data_dir", "data",
            "--resolution", "128,128", "--enable_bucket", *buckets, "--cache_latents_to_disk", "--max_train_steps",
            "1", "--output_dir", "out/run", "--max_data_loader_n_workers", "0"]
    assert train_network.main(args, family="sd", script="fine_tune.py") == 0
    assert _caches(inputs) == made
    assert [m.split(" (")[0] for m in _encoded(caplog)] == [f"caching latents: 0 to encode, {len(made)} reused "
                                                            "from disk"]


def test_latents_are_the_vae_encoding_of_the_bucketed_image(inputs, monkeypatch):
    """One image (300x200), alone so that it takes the generator's first draws: its cache holds the tiny VAE's
    posterior sample, drawn from a generator seeded with 0 (as the tool documents), of the image resized to cover
    the bucket upstream chose (``small_buckets.json``) and centre-cropped, then of its mirror image; computed here
    with diffusers' ``AutoencoderKL`` directly. Both on the CPU (no TF32 convolutions of a GPU in the comparison)."""
    from diffusers import AutoencoderKL

    from library.families.sd.loading import load_sd_model

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    (inputs / "one").mkdir()
    (inputs / "data" / "03_yellow_circle.png").rename(inputs / "one" / "03_yellow_circle.png")
    (inputs / "empty.json").write_text("{}")
    assert tool.main(["one", "empty.json", "out/one.json", TINY, "--flip_aug", *CASES["small_buckets"][4:]]) == 0
    bucket = json.loads((EXPECTED / "small_buckets.json").read_text())["03_yellow_circle"]["train_resolution"]
    image = Image.open(inputs / "one" / "03_yellow_circle.png").convert("RGB")
    scale = max(bucket[0] / image.width, bucket[1] / image.height)
    resized = image.resize((int(image.width * scale + 0.5), int(image.height * scale + 0.5)), Image.LANCZOS)
    left, top = (resized.width - bucket[0]) // 2, (resized.height - bucket[1]) // 2
    pixels = np.asarray(resized.crop((left, top, left + bucket[0], top + bucket[1])), dtype=np.float32)
    x = torch.from_numpy(pixels).permute(2, 0, 1)[None] / 127.5 - 1
    tiny = load_sd_model(TINY).vae
    vae = AutoencoderKL.from_config(tiny.config)
    vae.load_state_dict(tiny.state_dict())
    generator = torch.Generator().manual_seed(0)
    with np.load(inputs / "one" / "03_yellow_circle_0300x0200_sd.npz") as cached:
        for name, view in (("latents", x), ("latents_flipped", x.flip(3))):
            with torch.no_grad():
                posterior = vae.encode(view).latent_dist
            noise = torch.randn(posterior.mean.shape, generator=generator)
            assert cached[name].shape == (4, bucket[1] // 8, bucket[0] // 8)
            expected = (posterior.mean + posterior.std * noise)[0].numpy()
            np.testing.assert_allclose(cached[name], expected, atol=2e-3, err_msg=name)


def test_every_form_of_the_model_gives_the_same_cache(inputs, caplog, tmp_path_factory, tiny_sdxl_dir):
    """The tiny models as a diffusers folder and as a single file load the VAE the built-in has (the files the
    built-in wrote are reused, ``--skip_existing`` or not); SDXL's (told by its folder or its file's tensors) gets
    ``_sdxl`` files."""
    from library.families.sd.tiny_files import write_tiny_model

    sd_dir = tmp_path_factory.mktemp("tiny-sd15")
    write_tiny_model(sd_dir)
    (inputs / "data" / "sub").rename(inputs / "sub")
    runs = [(TINY, "_sd", 5), (str(sd_dir), "_sd", 0), (str(sd_dir / "model.safetensors"), "_sd", 0),
            ("builtin:tiny-sdxl", "_sdxl", 5), (str(tiny_sdxl_dir), "_sdxl", 0),
            (str(tiny_sdxl_dir / "model.safetensors"), "_sdxl", 0)]
    for number, (model, suffix, encoded) in enumerate(runs):
        caplog.clear()
        caplog.set_level(logging.INFO)
        extra = ["--skip_existing"] if number % 2 else []
        assert tool.main(["data", "meta.json", f"out/{number}.json", model, "--max_resolution", "128,128",
                          "--min_bucket_reso", "64", "--max_bucket_reso", "256", *extra]) == 0, model
        assert _encoded(caplog) == [f"caching latents: {encoded} to encode, {5 - encoded} reused from disk"], model
        files = sorted(p.name for p in (inputs / "data").glob(f"*{suffix}.npz"))
        assert len(files) == 5, model
        with np.load(inputs / "data" / files[0]) as cached:
            assert cached["latents"].shape[0] == 4
