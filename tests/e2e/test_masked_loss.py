"""End to end: masked loss (``--masked_loss``, ``--alpha_mask``, ``conditioning_data_dir``) on the tiny model."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open

import train_network
from library.config import LossConfig, ModelConfig, NetworkConfig, NoiseConfig, PrecisionConfig
from library.families.model_setup import load_model
from library.families.precision import precision_policy
from library.families.registry import model_family
from library.train.batch_loss import BatchLoss
from library.train.network_setup import build_network
from tests.e2e.test_train_network import train_args

torch.set_num_threads(1)


def write_rgba_folder(folder, count: int, size=(64, 64)) -> None:
    """RGBA images, opaque on the right half only, with captions."""
    folder.mkdir(parents=True, exist_ok=True)
    w, h = size
    for i in range(count):
        rgb = np.random.default_rng(i).integers(0, 256, (h, w, 3), dtype=np.uint8)
        alpha = np.zeros((h, w), np.uint8)
        alpha[:, w // 2:] = 255
        Image.fromarray(np.dstack([rgb, alpha]), "RGBA").save(folder / f"img{i}.png")
        (folder / f"img{i}.txt").write_text(f"sks shape {i}", encoding="utf-8")


def write_masks(folder, names, size=(64, 64)) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        mask = np.zeros((size[1], size[0]), np.uint8)
        mask[: size[1] // 2] = 255
        Image.fromarray(mask, "L").save(folder / f"{name}.png")


def ss_datasets(path) -> list:
    with safe_open(str(path), "pt") as f:
        return json.loads(f.metadata()["ss_datasets"])


def test_alpha_mask_trains_with_and_without_cached_latents(tmp_path):
    write_rgba_folder(tmp_path / "data/2_sks", 3, size=(96, 64))
    for extra in ([], ["--cache_latents_to_disk"]):
        out = tmp_path / ("out" + "".join(extra))
        args = train_args(out, "--masked_loss", "--alpha_mask", "--enable_bucket", "--min_bucket_reso", "64",
                          "--max_bucket_reso", "128", "--flip_aug", "--max_train_steps", "2", *extra,
                          data=tmp_path / "data")
        assert train_network.main(args) == 0
        assert (out / "lora.safetensors").is_file()
    with np.load(tmp_path / "data/2_sks/img0_0096x0064_sd.npz") as npz:
        assert npz["alpha_mask"].shape == (64, 64) and npz["alpha_mask"].dtype == np.float32


def test_conditioning_masks_train_from_the_cli_and_a_dataset_config(tmp_path):
    write_rgba_folder(tmp_path / "data/2_sks", 2)
    write_masks(tmp_path / "masks/2_sks", ["img0", "img1"])
    out = tmp_path / "cli"
    args = train_args(out, "--masked_loss", "--conditioning_data_dir", str(tmp_path / "masks"), "--max_train_steps",
                      "2", data=tmp_path / "data")
    assert train_network.main(args) == 0
    config = tmp_path / "dataset.toml"
    config.write_text(f"""
        [general]
        resolution = 64
        caption_extension = ".txt"
        [[datasets]]
        batch_size = 2
        [[datasets.subsets]]
        image_dir = "{tmp_path / 'data/2_sks'}"
        conditioning_data_dir = "{tmp_path / 'masks/2_sks'}"
        num_repeats = 2
    """, encoding="utf-8")
    out = tmp_path / "toml"
    args = [a for a in train_args(out, "--masked_loss", "--dataset_config", str(config), "--max_train_steps", "2")]
    assert train_network.main(args) == 0
    (dataset,) = ss_datasets(out / "lora.safetensors")
    assert dataset["subsets"][0]["conditioning_data_dir"] == "2_sks"


def test_masked_loss_without_a_mask_stops_before_training(tmp_path, capsys):
    write_rgba_folder(tmp_path / "data/1_sks", 1)
    out = tmp_path / "out"
    assert train_network.main(train_args(out, "--masked_loss", data=tmp_path / "data")) == 2
    assert "--masked_loss: no subset has a loss mask; add --alpha_mask" in capsys.readouterr().err
    assert not out.exists()


@pytest.fixture(scope="module")
def batch_loss():
    device = torch.device("cpu")
    policy = precision_policy(PrecisionConfig())
    model = load_model(ModelConfig(pretrained_model_name_or_path="builtin:tiny-sd15"), PrecisionConfig(), policy,
                       device, family=model_family("sd"))
    network, train_te = build_network(NetworkConfig(network_dim=4, network_alpha=4.0), model, policy, device,
                                      family=model_family("sd"))
    torch.manual_seed(0)
    for p in network.parameters():  # LoRA up-projections start at zero; give every parameter a gradient path
        torch.nn.init.normal_(p, std=0.05)
    return BatchLoss(model, network, NoiseConfig(), LossConfig(), policy, device, torch.Generator(), None, None,
                     train_te, model_family("sd"))


def grads(batch_loss, images, masks):
    batch_loss.generator.manual_seed(1)
    batch_loss.network.zero_grad(set_to_none=True)
    batch = {"images": images, "captions": ["sks a", "sks b"], "loss_weights": torch.ones(2), "loss_masks": masks}
    loss = batch_loss(batch)
    loss.backward()
    return loss, [p.grad.clone() for p in batch_loss.network.parameters() if p.grad is not None]


def test_a_fully_masked_image_contributes_zero_gradient(batch_loss):
    gen = torch.Generator().manual_seed(0)
    images = torch.rand(2, 3, 64, 64, generator=gen) * 2 - 1
    other = images.clone()
    other[0] = torch.rand(3, 64, 64, generator=gen) * 2 - 1  # a different first image, still fully masked
    masks = torch.stack([torch.zeros(64, 64), torch.ones(64, 64)])
    loss_a, grads_a = grads(batch_loss, images, masks)
    loss_b, grads_b = grads(batch_loss, other, masks)
    assert loss_a.item() > 0 and grads_a and any(g.abs().sum() > 0 for g in grads_a)
    assert torch.equal(loss_a, loss_b)
    assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-9) for a, b in zip(grads_a, grads_b, strict=True))
    loss_zero, grads_zero = grads(batch_loss, images, torch.zeros(2, 64, 64))
    assert loss_zero.item() == 0.0 and all(torch.count_nonzero(g) == 0 for g in grads_zero)
