"""The save gating of a multi-process run, as sd-scripts' ``train_network.py`` does it under accelerate: every save
is preceded by a barrier, and only the main process (rank 0) writes. Here the barrier is a sync point that also
checks that the weights are the same on every process (``fingerprint``; the main process's are sent to all when they
are not) and gathers every process's random state, which ``--save_state`` stores.

``SaveGate`` holds the methods; ``Processes`` (``library/runtime/processes.py``) inherits them and provides the sync
point, the broadcast and the byte gather they use, and the ``rank_rngs`` they fill.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from library.saving.state_file import decode, encode
from library.train.position import Position, SaveHooks

log = logging.getLogger(__name__)

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def fingerprint(tensors: Sequence[torch.Tensor]) -> int:
    """A 48-bit hash of the tensors' bits (equal tensors, equal hash), to compare replicas."""
    total = torch.zeros((), dtype=torch.int64, device=tensors[0].device if tensors else "cpu")
    for index, t in enumerate(tensors):
        bits = t.detach().reshape(-1)
        bits = bits.view(_INT_OF_SIZE[bits.element_size()]).to(torch.int64)
        weights = torch.arange(1, bits.numel() + 1, device=bits.device, dtype=torch.int64) * (2 * index + 1)
        total += (bits * weights).sum()
    return int(total) & ((1 << 48) - 1)


def _pack(obj: Any) -> bytes:
    """Bytes of a tree of tensors and plain values, without pickle (``library/saving/state_file.py``'s encoding)."""
    from safetensors.torch import save

    tree, tensors = encode(obj)
    return save({**tensors, "tree": torch.frombuffer(bytearray(json.dumps(tree).encode()), dtype=torch.uint8)})


def _unpack(data: bytes) -> Any:
    from safetensors.torch import load

    tensors = load(data)
    return decode(json.loads(bytes(tensors.pop("tree").tolist()).decode()), tensors)


class SaveGate:
    """The save callbacks of ``Processes``, which inherits them (its ``_sync_point``, ``_broadcast``,
    ``_all_gather_bytes`` and ``rank_rngs``)."""

    def gate_saves(self, hooks: SaveHooks, params: Sequence[torch.Tensor], local_rng: Callable[[], Any]) -> SaveHooks:
        """The save callbacks as every process calls them: a sync point (the barrier before a save) that checks
        that the weights are the same everywhere and collects every process's random state (for ``--save_state``),
        then the save itself on the main process only. A single process gets ``hooks`` unchanged."""
        if not self.distributed:
            return hooks

        def gated(save: Callable[[Position], None]) -> Callable[[Position], None]:
            def call(pos: Position) -> None:
                self._before_save(params, local_rng())
                if self.is_main:
                    save(pos)
            return call

        return SaveHooks(hooks.every_n_steps, hooks.every_n_epochs, gated(hooks.step_save), gated(hooks.epoch_save),
                         gated(hooks.final_save))

    def _before_save(self, params: Sequence[torch.Tensor], rng: Any) -> None:
        blob = _pack(rng)
        with self._sync_point(own=[fingerprint(params), len(blob)]) as outcome:
            prints = {own[0] for own in outcome.own}
            if len(prints) > 1:
                if self.is_main:
                    log.warning("the processes' LoRA weights differ (an optimizer drawing rounding bits from "
                                "torch's global generator?); the main process's weights are sent to all")
                self._broadcast(params)
            gathered = self._all_gather_bytes(blob, max(own[1] for own in outcome.own))
        if self.is_main:
            self.rank_rngs = [_unpack(data[:own[1]]) for data, own in zip(gathered, outcome.own, strict=True)][1:]
