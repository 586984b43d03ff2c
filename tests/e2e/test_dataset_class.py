"""``--dataset_class``: a user's class in sd-scripts' MinimalDataset shape, constructed as sd-scripts'
``load_arbitrary_dataset`` does (``Class(tokenizer, max_token_length, resolution, debug_dataset)``)."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

import train_network
from library.base.errors import UserError
from library.config import DataConfig, validate
from library.data.dataset import build_train_data
from tests.config_helpers import parse_args

HERE = "tests.e2e.test_dataset_class"


class SquaresDataset:
    """Three batches of two 64x64 images with captions; records how it was built and driven."""

    built: list[tuple] = []

    def __init__(self, tokenizer, max_token_length, resolution, debug_dataset):
        SquaresDataset.built.append((tokenizer, max_token_length, resolution, debug_dataset))
        self.tokenizer = tokenizer
        self.epochs: list[int] = []

    def __len__(self):
        return 3

    def set_current_epoch(self, epoch):
        self.epochs.append(epoch)

    def __getitem__(self, index):
        g = torch.Generator().manual_seed(index)
        return {"images": torch.rand(2, 3, 64, 64, generator=g) * 2 - 1, "captions": [f"square {index}"] * 2,
                "latents": None, "image_keys": [f"item{index}a", f"item{index}b"]}


class TokenIdsDataset(SquaresDataset):
    """Token ids as sd-scripts' input_ids_list ([B, n, 77] in a one-element list), weights of its own."""

    def __getitem__(self, index):
        batch = super().__getitem__(index)
        ids = self.tokenizer(batch.pop("captions"), padding="max_length", max_length=77, truncation=True,
                             return_tensors="pt").input_ids
        batch["input_ids_list"] = [ids.reshape(2, 1, 77)]
        batch["loss_weights"] = torch.tensor([1.0, 0.5])
        return batch


class MaskedDataset(SquaresDataset):
    def __getitem__(self, index):
        return {**super().__getitem__(index), "alpha_masks": torch.ones(2, 64, 64)}


class NoImagesDataset(SquaresDataset):
    def __getitem__(self, index):
        return {"captions": ["a", "b"]}


class OneCaptionDataset(SquaresDataset):
    def __getitem__(self, index):
        return {**super().__getitem__(index), "captions": ["only one"]}


class EmptyDataset(SquaresDataset):
    def __len__(self):
        return 0


def custom(name: str, **kw) -> DataConfig:
    return DataConfig(dataset_class=f"{HERE}.{name}", max_data_loader_n_workers=0, **kw)


def test_built_as_sd_scripts_builds_it_and_batches_adapted():
    SquaresDataset.built.clear()
    data = build_train_data(custom("SquaresDataset", resolution=(64, 64)), seed=3, max_token_length=150)
    tokenizer, max_token_length, resolution, debug = SquaresDataset.built[0]
    assert tokenizer.model_max_length == 77 and tokenizer.pad_token == "<|endoftext|>"  # SD1's CLIP tokenizer
    assert (max_token_length, resolution, debug) == (150, (64, 64), False)
    assert (len(data), data.batch_size, data.num_train_images, data.resolution) == (3, 2, 6, (64, 64))
    data.set_epoch(2)
    batches = list(data.dataloader(0))
    assert sorted(b["captions"][0] for b in batches) == ["square 0", "square 1", "square 2"]
    assert all(b["images"].shape == (2, 3, 64, 64) and torch.equal(b["loss_weights"], torch.ones(2))
               for b in batches)
    assert batches[0]["image_paths"][0].startswith("item")
    assert data.source.dataset.epochs[-3:] == [2, 2, 2]  # set_current_epoch before each batch, as the collator


def test_epoch_order_is_shuffled_from_the_seed():
    def order(seed, epoch):
        data = build_train_data(custom("SquaresDataset"), seed=seed)
        data.set_epoch(epoch)
        return [b["captions"][0] for b in data.dataloader(0)]

    assert order(0, 1) == order(0, 1)
    assert len({tuple(order(0, e)) for e in range(1, 7)}) > 1


def test_token_ids_are_reshaped_to_the_trainers_form():
    data = build_train_data(custom("TokenIdsDataset"), seed=0)
    batch = next(iter(data.dataloader(0)))
    assert batch["input_ids"].shape == (2, 77) and batch["input_ids"].dtype == torch.long
    assert int(batch["input_ids"][0, 0]) == 49406  # CLIP's BOS
    assert batch["loss_weights"].tolist() == [1.0, 0.5]


def test_alpha_masks_become_loss_masks_and_masked_loss_needs_them():
    batch = next(iter(build_train_data(custom("MaskedDataset"), seed=0, masked_loss=True).dataloader(0)))
    assert batch["loss_masks"].shape == (2, 64, 64)
    with pytest.raises(UserError, match='batch 0 has no "alpha_masks" \\[B, H, W\\], which --masked_loss needs'):
        build_train_data(custom("SquaresDataset"), seed=0, masked_loss=True)


def test_sd2_gets_the_sd2_tokenizer():
    SquaresDataset.built.clear()
    build_train_data(custom("SquaresDataset"), seed=0, v2=True)
    assert SquaresDataset.built[0][0].pad_token == "!"


@pytest.mark.parametrize("name, needle", [
    ("nodots", "expected package.module.Class"),
    ("no_such_module_xyz.Thing", "cannot import no_such_module_xyz"),
    (f"{HERE}.Missing", "has no class Missing"),
    (f"{HERE}.NoImagesDataset", 'batch 0 has neither "images" [B, 3, H, W] nor "latents"'),
    (f"{HERE}.OneCaptionDataset", '"captions" must be a list of 2 strings'),
    (f"{HERE}.EmptyDataset", "len() is 0"),
])
def test_unusable_class_or_batch_is_a_user_error(name, needle):
    with pytest.raises(UserError) as info:
        build_train_data(DataConfig(dataset_class=name), seed=0)
    assert needle in str(info.value) and name in str(info.value)


def test_validate_refuses_latent_caching_and_warns_about_ignored_flags(caplog):
    base = ["--pretrained_model_name_or_path", "builtin:tiny-sd15", "--output_dir", "out",
            "--dataset_class", f"{HERE}.SquaresDataset"]
    validate(parse_args(base + ["--flip_aug", "--train_data_dir", "x"])[0])  # no data folder needed
    assert "--train_data_dir, --flip_aug: no effect with --dataset_class" in caplog.text
    with pytest.raises(UserError, match="--cache_latents with --dataset_class .*return \"latents\""):
        validate(parse_args(base + ["--cache_latents"])[0])


def _train(tmp_path, name, *extra):
    return ["--pretrained_model_name_or_path", "builtin:tiny-sd15", "--dataset_class", f"{HERE}.{name}",
            "--output_dir", str(tmp_path), "--output_name", "lora", "--network_dim", "4", "--learning_rate", "1e-3",
            "--max_train_steps", "2", "--seed", "1", "--max_data_loader_n_workers", "0", *extra]


@pytest.mark.parametrize("name", ["SquaresDataset", "TokenIdsDataset"])
def test_trains_end_to_end(tmp_path, name):
    assert train_network.main(_train(tmp_path, name)) == 0
    with safe_open(str(tmp_path / "lora.safetensors"), "pt") as f:
        meta = f.metadata()
    assert meta["ss_dataset_class"] == f"{HERE}.{name}" and meta["ss_num_batches_per_epoch"] == "3"
    assert meta["modelspec.resolution"] == "64x64"


def test_debug_dataset_with_a_class(tmp_path, capsys):
    assert train_network.main(_train(tmp_path / "out", "SquaresDataset", "--debug_dataset")) == 0
    out = capsys.readouterr().out
    assert "the 3 batches of epoch 1" in out and 'item0a, loss weight 1, caption "square 0"' in out
    assert not (tmp_path / "out").exists()


def test_token_ids_win_over_captions_except_with_weighted_captions():
    from types import SimpleNamespace

    from library.train.batch_loss import BatchLoss

    batch = {"input_ids": torch.zeros(1, 77, dtype=torch.long), "captions": ["a (cat:1.2)"]}
    fake = SimpleNamespace(weighted_captions=False, encode_ids=lambda ids: "ids", conditioning=lambda c: "captions")
    assert BatchLoss.text_states(fake, batch) == "ids"  # sd-scripts: input_ids_list unless weighted_captions
    fake.weighted_captions = True
    assert BatchLoss.text_states(fake, batch) == "captions"
    with pytest.raises(UserError, match="--weighted_captions parses caption text"):
        BatchLoss.text_states(fake, {"input_ids": batch["input_ids"]})
