"""The held-out batches come in the order sd-scripts 48d368fa's validation visits them, so each gets its noise.

The expected order is sd-scripts' code written out below, not ours: ``split_train_val`` (library/train_util.py)
gives the validation dataset its images in the shuffled order; ``DreamBoothDataset`` registers them in that order;
``make_buckets`` adds each to the bucket of its resolution (buckets sorted by resolution, ``BucketManager.sort``),
builds ``buckets_indices`` (bucket by bucket, batch by batch) and calls ``shuffle_buckets`` while the dataset's seed
and epoch are 0: ``random.seed(0)``, ``random.shuffle(buckets_indices)``, then ``random.shuffle`` of each bucket;
``val_dataloader`` (``shuffle=False``) reads index 0, 1, ... and ``__getitem__`` takes
``bucket[batch_index * batch_size:][:batch_size]``. The images' sizes here are bucket resolutions themselves, which
sd-scripts' ``select_bucket`` keeps as they are (``reso in self.predefined_resos_set``).
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from library.config import DataConfig, ValidationConfig
from library.data.dataset import build_train_data
from library.train.validation import build_validation
from tests.unit.data.images import write_image


def upstream_split_train_val(paths: list[str], sizes: list, is_training_dataset: bool, validation_split: float,
                             validation_seed: int) -> tuple[list[str], list]:
    """sd-scripts' ``split_train_val`` with a ``validation_seed``."""
    dataset = list(zip(paths, sizes, strict=True))
    prevstate = random.getstate()
    random.seed(validation_seed)
    random.shuffle(dataset)
    random.setstate(prevstate)
    paths, sizes = (list(x) for x in zip(*dataset, strict=True))
    if is_training_dataset:
        split = math.ceil(len(paths) * (1 - validation_split))
        return paths[0:split], sizes[0:split]
    split = len(paths) - round(len(paths) * validation_split)
    return paths[split:], sizes[split:]


def upstream_visits(paths: list[str], sizes: list[tuple[int, int]], split: float, seed: int,
                    batch_size: int) -> list[list[str]]:
    """The batches sd-scripts' validation loop visits, in order (file names)."""
    val_paths, val_sizes = upstream_split_train_val(paths, sizes, False, split, seed)
    resos = sorted(set(val_sizes))
    buckets = [[p for p, s in zip(val_paths, val_sizes, strict=True) if s == reso] for reso in resos]
    buckets_indices = [(b, i) for b, bucket in enumerate(buckets) for i in range(math.ceil(len(bucket) / batch_size))]
    state = random.getstate()
    random.seed(0 + 0)  # self.seed + self.current_epoch when make_buckets shuffles
    random.shuffle(buckets_indices)
    for bucket in buckets:
        random.shuffle(bucket)
    random.setstate(state)
    return [[Path(p).name for p in buckets[b][i * batch_size:(i + 1) * batch_size]] for b, i in buckets_indices]


def our_visits(tmp_path: Path, split: float, seed: int, **kw) -> list[list[str]]:
    data = build_train_data(DataConfig(train_data_dir=str(tmp_path / "train"), validation_split=split,
                                       validation_seed=seed, **kw), seed=1)
    batch_loss = SimpleNamespace(noise=SimpleNamespace(min_timestep=None, max_timestep=None),
                                 objective=SimpleNamespace(num_train_timesteps=1000))
    validation = build_validation(data.validation, ValidationConfig(), batch_loss, (), max_train_steps=10)
    batches = validation.data.fixed_batches(len(validation.data), 10)
    return [[Path(p).name for p in batch["image_paths"]] for batch in batches]


def test_eight_held_out_images_in_upstreams_order(tmp_path):
    folder = tmp_path / "train" / "1_thing"
    names = [f"img{i:02d}.png" for i in range(16)]
    for i, name in enumerate(names):
        write_image(folder / name, (64, 64), (15 * i, 40, 90))
    want = upstream_visits([str(folder / n) for n in names], [(64, 64)] * 16, 0.5, 7, 1)
    # sd-scripts' order, as the code above gives it (folder order would be 00 01 02 06 08 10 12 15)
    assert [b[0] for b in want] == ["img00.png", "img12.png", "img01.png", "img15.png", "img08.png", "img06.png",
                                    "img02.png", "img10.png"]
    assert our_visits(tmp_path, 0.5, 7, resolution=(64, 64)) == want


@pytest.mark.parametrize("seed", [3, 11])
def test_two_buckets_batches_of_two_in_upstreams_order(tmp_path, seed):
    folder = tmp_path / "train" / "1_thing"
    sizes = [(128, 128) if i % 3 else (256, 64) for i in range(12)]
    names = [f"img{i:02d}.png" for i in range(12)]
    for i, (name, size) in enumerate(zip(names, sizes, strict=True)):
        write_image(folder / name, size, (15 * i, 40, 90))
    want = upstream_visits([str(folder / n) for n in names], sizes, 0.75, seed, 2)
    assert len({len(b) for b in want}) == 2  # some batch is the short end of a bucket
    got = our_visits(tmp_path, 0.75, seed, resolution=(128, 128), enable_bucket=True, min_bucket_reso=64,
                     max_bucket_reso=256, train_batch_size=2)
    assert got == want
