"""``--debug_dataset``: show what the data loader yields, then stop; nothing is trained, loaded or written.

sd-scripts (``train_util.debug_dataset``) logs each example's image key, size, caption, crop and flip and shows the
images in an OpenCV window (on Windows only; elsewhere it loops over the epochs until interrupted). Here one epoch's
batches are printed, each with its images as the loop would receive them: file, size, resize, bucket, the caption
after shuffling, dropout and the other transforms, whether it was flipped, and the loss weight; then the trainer
exits with code 0 without loading the model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def _shape(batch: dict) -> str:
    for key in ("images", "latents"):
        value = batch.get(key)
        if isinstance(value, torch.Tensor):
            return f"{key} {list(value.shape)}"
    return "no images or latents"


def _bucket(batch: dict) -> str:
    if isinstance(batch.get("images"), torch.Tensor):
        h, w = batch["images"].shape[-2:]
    elif isinstance(batch.get("latents"), torch.Tensor):
        h, w = (8 * n for n in batch["latents"].shape[-2:])
    else:
        return "?"
    return f"{w}x{h}"


def show_batches(data, max_train_steps: int, write: Callable[[str], None] = print) -> int:
    """Print one epoch of ``data``'s batches (``TrainData`` or a ``--dataset_class`` adapter); returns the count.

    ``data.image_details()`` maps an image path to a description of its size and bucket (empty when unknown).
    """
    details = data.image_details()
    data.set_epoch(1)
    data.set_current_step(0, max_train_steps)
    loader = data.dataloader(num_workers=0)
    total = len(loader)
    write(f"--debug_dataset: the {total} batches of epoch 1 (nothing is trained or written)")
    for index, batch in enumerate(loader):
        captions = batch.get("captions") or []
        count = len(captions) or len(batch.get("loss_weights", []))
        write(f"batch {index + 1}/{total}: {count} image(s), bucket {_bucket(batch)}, {_shape(batch)}")
        paths = batch.get("image_paths") or [None] * count
        flips = batch.get("flipped") or [None] * count
        weights = batch.get("loss_weights")
        for slot in range(count):
            parts = [str(paths[slot]) if paths[slot] is not None else f"image {slot}"]
            if paths[slot] in details:
                parts.append(details[paths[slot]])
            if flips[slot] is not None:
                parts.append("flipped" if flips[slot] else "not flipped")
            if weights is not None:
                parts.append(f"loss weight {float(weights[slot]):g}")
            if captions:
                parts.append(f'caption "{captions[slot]}"')
            elif "input_ids" in batch:
                parts.append(f"input ids {list(batch['input_ids'][slot].shape)}")
            write("  " + ", ".join(parts))
    return total
