"""End to end on the tiny model: input that would exhaust the machine (an image header of 20000 x 20000, a folder
``1000000000_x``, an 8 MB caption) and sample prompt options that crash at the first sample stop the run at the
start, exit 2, naming the file, folder or prompt line and what to change (round-3 reliability, classes 3 and 4);
values at the limits still run exactly as before."""

from __future__ import annotations

import logging
import struct
import zlib
from pathlib import Path

import pytest
from PIL import Image

import train_network
from library.config import DataConfig
from library.data.dataset import build_train_data
from library.data.images import load_image
from tests.e2e.test_train_network import SAMPLES, train_args
from tests.e2e.test_train_network import refused as _fails

BIGGEST_SEED = 2**64 - 1  # torch.Generator.manual_seed's largest


@pytest.fixture
def no_model(monkeypatch):
    """Every case below must stop before the model loads."""
    from library.families import model_setup

    monkeypatch.setattr(model_setup, "load_model", lambda *a: pytest.fail("the model loaded first"))


def _png_header(path: Path, width: int, height: int) -> Path:
    """A PNG whose header says ``width`` x ``height`` (1-bit grey) with almost no pixel data: a decompression bomb
    as far as its header goes."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
                     + chunk(b"IEND", b""))
    return path


def _folder(root: Path, name: str, captions: dict[str, str] | None = None) -> Path:
    """``root/name`` holding one 64 x 64 image ``a.png`` (and ``a.txt`` etc. from ``captions``)."""
    folder = root / name
    folder.mkdir(parents=True)
    Image.new("RGB", (64, 64), (200, 40, 40)).save(folder / "a.png")
    for file, text in (captions or {}).items():
        (folder / file).write_text(text, encoding="utf-8")
    return folder


def test_image_over_the_pixel_limit_is_named_at_the_scan(tmp_path, capsys, no_model):
    data = _folder(tmp_path / "data", "1_x").parent
    bomb = _png_header(data / "1_x" / "bomb.png", 20000, 20000)
    _fails(capsys, train_args(tmp_path / "out", data=data), f"{bomb}: 20000x20000 = 400000000 pixels, more than "
           "--max_image_pixels 178956970", "raise --max_image_pixels")
    bomb.unlink()
    _fails(capsys, train_args(tmp_path / "out", "--max_image_pixels", "4095", data=data),
           f"{data / '1_x' / 'a.png'}: 64x64 = 4096 pixels, more than --max_image_pixels 4095")
    assert not (tmp_path / "out").exists()


def test_a_raised_pixel_limit_opens_what_pil_would_refuse(tmp_path, monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # PIL refuses above 2000 pixels: these 96 x 64 images
    data = build_train_data(DataConfig(train_data_dir=str(SAMPLES), resolution=(64, 64), enable_bucket=True,
                                       min_bucket_reso=64, max_image_pixels=6144), seed=0)
    item = data.datasets[0].items[0]
    assert item.size == (96, 64) and load_image(item.path).size == (96, 64)
    assert Image.MAX_IMAGE_PIXELS == 1000  # PIL's own setting is left as it was
    with pytest.raises(Image.DecompressionBombError):
        Image.open(item.path)


def test_billion_repeats_folder_stops_before_any_list_is_built(tmp_path, capsys, no_model):
    data = tmp_path / "data"
    folder = _folder(data, "1000000000_x")
    _fails(capsys, train_args(tmp_path / "out", data=data),
           f'--train_data_dir "{folder}": 1000000000 repeats is more than --max_images_per_epoch 10000000',
           'rename the folder with a smaller repeat count (the number before "_"), or raise --max_images_per_epoch')


def test_dataset_config_num_repeats_that_large(tmp_path, capsys, no_model):
    folder = _folder(tmp_path / "data", "x")
    config = tmp_path / "dataset.toml"
    config.write_text(f'[general]\nresolution = 64\n[[datasets]]\n[[datasets.subsets]]\nimage_dir = "{folder}"\n'
                      "num_repeats = 1000000000000\n", encoding="utf-8")
    args = train_args(tmp_path / "out", "--dataset_config", str(config))
    del args[args.index("--train_data_dir"):args.index("--train_data_dir") + 2]
    _fails(capsys, args, f"{config}", "1000000000000 repeats is more than --max_images_per_epoch 10000000",
           "lower its num_repeats, or raise --max_images_per_epoch")


def test_images_per_epoch_count_repeats_times_images(tmp_path, capsys, no_model):
    folder = SAMPLES / "10_shapes"  # 8 images x 10 repeats
    _fails(capsys, train_args(tmp_path / "out", "--max_images_per_epoch", "79"),
           "80 training images per epoch (repeats x images) is more than --max_images_per_epoch 79 "
           f'(--train_data_dir "{folder}": 10 repeats x 8 images)')
    data = build_train_data(DataConfig(train_data_dir=str(SAMPLES), resolution=(64, 64), max_images_per_epoch=80),
                            seed=0)
    assert data.num_train_images == 80


def test_long_caption_is_cut_at_the_scan_and_tokenizes_as_before(tmp_path, caplog):
    from library.families.tokenizers import load_tokenizer
    from library.text.tokens import tokenize

    caplog.set_level(logging.WARNING)
    huge = ", ".join(f"tag{i % 1000}" for i in range(1_000_000))  # about 8 MB on one line
    exact = "b" * 10_000
    root = tmp_path / "data"
    _folder(root, "1_huge", {"a.txt": huge})
    _folder(root, "1_exact", {"a.txt": exact})
    data = build_train_data(DataConfig(train_data_dir=str(root), resolution=(64, 64), caption_extension=".txt"),
                            seed=0)
    captions = {Path(item.path).parent.name: item.caption for item in data.datasets[0].items}
    assert captions == {"1_huge": huge[:10_000], "1_exact": exact}
    assert f"{root / '1_huge' / 'a.png'} ({len(huge)} characters)" in caplog.text
    assert "--max_caption_length 10000" in caplog.text and str(root / "1_exact") not in caplog.text
    # The tiny model's tokenizer reads the whole string before it truncates (seconds per MB): the uncut caption is
    # represented by its first 100000 characters, ten times the cut and far past the 227 tokens kept.
    tokenizer = load_tokenizer(v2=False)
    for max_token_length in (None, 225):
        assert tokenize(tokenizer, [huge[:100_000]], max_token_length).equal(tokenize(tokenizer, [huge[:10_000]],
                                                                                      max_token_length))
    raised = build_train_data(DataConfig(train_data_dir=str(root), resolution=(64, 64), caption_extension=".txt",
                                         max_caption_length=20_000), seed=0)
    assert max(len(item.caption) for item in raised.datasets[0].items) == 20_000


def test_each_wildcard_line_is_cut_on_its_own(tmp_path):
    root = tmp_path / "data"
    _folder(root, "1_x", {"a.txt": "a" * 30 + "\nshort {x|y}\n"})
    data = build_train_data(DataConfig(train_data_dir=str(root), resolution=(64, 64), caption_extension=".txt",
                                       enable_wildcard=True, max_caption_length=20), seed=0)
    assert data.datasets[0].items[0].caption == "a" * 20 + "\nshort {x|y}"


def test_limit_flags_take_whole_numbers_of_at_least_one(tmp_path, capsys, no_model):
    for flag in ("--max_image_pixels", "--max_images_per_epoch", "--max_caption_length"):
        _fails(capsys, train_args(tmp_path / "out", flag, "0"), f"{flag} '0': expected a whole number of at least 1")


def test_prompt_options_out_of_bounds_are_named_before_anything_loads(tmp_path, capsys, no_model):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a --w 100000000000000000000\n"
                       "b --d 100000000000000000000000000\n"
                       "c --h 20000 --l 1e30\n"
                       f"d --n {'x' * 10_001}\n"
                       f"fine --w 16384 --h 64 --d {BIGGEST_SEED} --l 100 --s 1000000000000000000000000\n",
                       encoding="utf-8")
    out = tmp_path / "out"
    err = _fails(capsys, train_args(out, "--sample_prompts", str(prompts), "--sample_every_n_steps", "1"),
                 f"{prompts}:1: --w 100000000000000000000: expected a size of 1 to 16384 pixels",
                 f"{prompts}:2: --d 100000000000000000000000000: a seed must fit a torch generator: 0 to "
                 f"{BIGGEST_SEED}",
                 f"{prompts}:3: --h 20000: expected a size of 1 to 16384 pixels",
                 f"{prompts}:3: --l '1e30': expected a CFG scale of at most 100",
                 f"{prompts}:4: --n: 10001 characters, more than 10000")
    assert f"{prompts}:5:" not in err
    assert not out.exists()


def test_seed_must_fit_a_torch_generator_and_the_largest_draws(tmp_path, capsys, monkeypatch):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"a red circle --w 64 --h 64 --s 1 --d {BIGGEST_SEED + 1}\n", encoding="utf-8")
    args = ("--sample_prompts", str(prompts), "--sample_at_first", "--max_train_steps", "1")
    with monkeypatch.context() as patch:
        from library.families import model_setup

        patch.setattr(model_setup, "load_model", lambda *a: pytest.fail("the model loaded first"))
        _fails(capsys, train_args(tmp_path / "bad", *args), f"{prompts}:1: --d {BIGGEST_SEED + 1}: a seed must fit")
    prompts.write_text(f"a red circle --w 64 --h 64 --s 1 --d {BIGGEST_SEED}\n", encoding="utf-8")
    assert train_network.main(train_args(tmp_path / "good", *args)) == 0
    drawn = sorted((tmp_path / "good" / "sample").iterdir())
    assert [p.name.endswith(f"_{BIGGEST_SEED}.png") for p in drawn] == [True]


def test_sample_folder_that_is_a_file_is_found_at_the_start(tmp_path, capsys, no_model):
    out = tmp_path / "out"
    out.mkdir()
    (out / "sample").write_text("not a folder")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle --w 64 --h 64 --s 1\n", encoding="utf-8")
    _fails(capsys, train_args(out, "--sample_prompts", str(prompts), "--sample_every_n_steps", "1"),
           f"sample images go to {out / 'sample'}, which is not a folder")
    assert sorted(p.name for p in out.iterdir()) == ["sample"]
