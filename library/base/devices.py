"""Host-to-device moves that do not wait.

A host-to-device move of pageable memory is a sync (CUDA copies it through a staging buffer and waits);
``to_device`` copies from pinned memory without blocking (batches come pinned from the DataLoader on CUDA). The
device-to-host reads of a training step are gathered in ``library/train/readout.py``.
"""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``; a CPU tensor goes to CUDA from pinned memory without blocking the host."""
    if tensor.device == device:
        return tensor
    if device.type == "cuda" and tensor.device.type == "cpu":
        return (tensor if tensor.is_pinned() else tensor.pin_memory()).to(device, non_blocking=True)
    return tensor.to(device)
