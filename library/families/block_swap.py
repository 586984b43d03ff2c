"""``--blocks_to_swap``'s machinery, shared by the transformers that swap (FLUX.1 and Chroma in ``flux/swap.py``,
Anima in ``anima/swap.py``): block weights kept in host memory and moved to the compute device around their use, as
upstream sd-scripts 48d368fa ``library/custom_offloading_utils.py`` ``ModelOffloader`` (one per stack of blocks)
with the models' ``enable_block_swap`` / ``move_to_device_except_swap_blocks`` / ``prepare_block_swap_before_forward``.
A family says which stacks swap how many blocks; ``BlockSwap`` is then the model's ``block_hooks``
(``block_hooks.BlockHooks``), called by ``block_hooks.run_block``.

Limit: each stack keeps two blocks on the device (``most_swapped``: at most ``depth - 2`` swapped, upstream's
assertions). Each stack has its own schedule (``StackSwap``); with k of its n blocks swapped:

- Placement before a forward: blocks ``0 .. n-k-1`` on the device, the last k on the host.
- Training forward (grad enabled): before block i wait for its weights; after block i < k, block i leaves and block
  ``n-k+i`` comes in, into the same device memory. After the forward blocks ``k .. n-1`` are on the device.
- Backward: when block i's backward is done and before any of block i-1's runs, for ``n-k-1 <= i <= n-2`` block i+1
  leaves and block ``i+k+1-n`` comes in; for ``1 <= i <= k`` the compute waits for block i-1. After the backward the
  placement is the one a forward starts from. The ``k <= n-2`` limit is what lets each block arrive before the hook
  that waits for it. Upstream hooks the blocks' full backward, which wraps every input of a block in one more autograd
  node; that changes the order in which autograd sums the gradient of an input every block reads (FLUX.1's vector)
  over the blocks, 1e-7 apart in fp32, enough to change what trains it. Here a training forward hooks the gradients
  of the block's input tensors instead (no node added) and the first one to fire is the moment: each is a hook of an
  output node of block i-1 (or of what precedes the stack), and autograd runs the ready node created last first, so
  the first of those nodes runs after every node of block i and above, before any other of block i-1.
- Sampling forward (grad disabled, upstream's ``forward_only``, which the models' ``switch_block_swap_for_inference``
  sets around sampling): after every block i, block i leaves and block ``(n-k+i) mod n`` comes in; the window of
  resident blocks turns once round and ends where it started.
- ``before_forward`` restores the starting placement when a pass left it elsewhere (a training forward without its
  backward, e.g. a stack without LoRA modules whose blocks get no gradient), which upstream leaves to explicit
  ``prepare_block_swap_before_forward`` calls.

What moves: the weight of every ``nn.Linear`` inside a swapped block (biases, norm scales and every layer outside the
stacks stay on the device, as upstream). A LoRA attached to them keeps its own parameters on the device (the LoRA
modules only wrap the layer's ``forward``), so only the frozen base weights move. A full fine-tuning script swaps
trained weights (upstream's too): each is stepped inside the backward pass while its block is on the device (the
fused backward pass: a block's weight gradients are complete before the hook that moves the block out fires), by an
optimizer placed on the device, and its updated values leave with it.

Memory: each stack holds exactly n - k blocks' Linear weights on the device at all times. A move copies the
leaving block's weights into fresh pinned host memory and the arriving block's weights into the device memory it
vacated (upstream's in-place exchange), so tensors autograd saved in the forward (views of a weight) see their own
block's weights again by the time their backward runs. Host: k blocks per stack, pinned on CUDA.

Where we differ: upstream runs each exchange on a one-thread executor that synchronizes the host with the device
twice per move; here every copy is queued on a separate CUDA stream, ordered with events (the copy waits for the
compute that last read the memory, the compute waits for the copy), so the host never waits. On the CPU the same
code runs with both sides on the CPU and the copies done at once, which is how the tests check the schedule.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn

KEPT_ON_DEVICE = 2  # blocks of each stack that never leave the device (upstream's ``depth - 2`` limit)


@dataclass(frozen=True)
class Move:
    """One exchange in ``stack``: block ``out`` to the host, block ``into`` to the device; ``phase`` is
    ``forward``, ``sample``, ``backward`` or ``prepare``."""

    stack: str
    phase: str
    out: int
    into: int


def most_swapped(depth: int) -> int:
    """The most blocks of a stack of ``depth`` that may swap (upstream: ``depth - 2``; 0 for a shallower stack)."""
    return max(depth - KEPT_ON_DEVICE, 0)


def movable_weights(block: nn.Module) -> list[nn.Parameter]:
    """The weights that leave the device with ``block``: every ``nn.Linear`` weight in it."""
    return [m.weight for m in block.modules() if isinstance(m, nn.Linear)]


class Copier:
    """Queues copies on a side CUDA stream ordered by events; on the CPU copies at once (no streams, no events)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.compute = torch.cuda.current_stream(device) if self.cuda else None

    def begin(self) -> None:
        """Take the stream the coming forward (and its backward) computes on."""
        if self.cuda:
            self.compute = torch.cuda.current_stream(self.device)

    def host_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of ``tensor`` in host memory (pinned on CUDA), queued on the side stream there."""
        host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=self.cuda)
        host.copy_(tensor, non_blocking=self.cuda)
        return host

    def mark(self) -> torch.cuda.Event | None:
        """An event after the work queued so far on the compute stream (None on the CPU)."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(self.compute)
        return event

    def exchange(self, leaving: list[nn.Parameter], arriving: list[nn.Parameter]) -> torch.cuda.Event | None:
        """``leaving`` to fresh host memory, then ``arriving`` into the device memory it held (after the compute
        queued so far); returns the event the compute must wait for before using ``arriving``."""
        after = self.mark()
        if self.cuda:
            self.stream.wait_event(after)
        with torch.cuda.stream(self.stream) if self.cuda else nullcontext():
            for out, into in zip(leaving, arriving, strict=True):
                slot = out.data
                out.data = self.host_copy(slot)
                slot.copy_(into.data, non_blocking=self.cuda)
                into.data = slot
        if not self.cuda:
            return None
        ready = torch.cuda.Event()
        ready.record(self.stream)
        return ready

    def wait(self, ready: torch.cuda.Event | None) -> None:
        if ready is not None:
            self.compute.wait_event(ready)


class StackSwap:
    """The schedule of one stack with its last ``swapped`` blocks on the host before each forward (upstream
    ``ModelOffloader``; see the module docstring)."""

    def __init__(self, stack: str, blocks: nn.ModuleList, swapped: int, copier: Copier, owner: BlockSwap):
        self.stack, self.blocks, self.n, self.k = stack, blocks, len(blocks), swapped
        self.copier, self.owner = copier, owner
        self.weights = [movable_weights(block) if swapped else [] for block in blocks]
        self.on_device = [True] * self.n
        self.ready: dict[int, torch.cuda.Event | None] = {}
        self.training_pass = False

    def starting_placement(self) -> list[bool]:
        return [i < self.n - self.k for i in range(self.n)]

    def host_weights(self) -> list[nn.Parameter]:
        """The weights that start on the host."""
        return [w for i in range(self.n - self.k, self.n) for w in self.weights[i]]

    def placed(self) -> None:
        """Record that ``BlockSwap.place`` put the weights where a forward starts."""
        self.on_device = self.starting_placement()
        self.ready.clear()

    def prepare(self) -> None:
        """Back to the starting placement (upstream ``prepare_block_devices_before_forward``), by exchanges."""
        want = self.starting_placement()
        leaving = [i for i in range(self.n) if self.on_device[i] and not want[i]]
        arriving = [i for i in range(self.n) if want[i] and not self.on_device[i]]
        for out, into in zip(leaving, arriving, strict=True):
            self._exchange(out, into, "prepare")
        self.training_pass = torch.is_grad_enabled()

    def _exchange(self, out: int, into: int, phase: str) -> None:
        if not self.on_device[out] or self.on_device[into]:
            raise RuntimeError(
                f"block swap ({self.stack}): block {out} must be on the device and block {into} on the host for an "
                f"exchange (placement {self.on_device}): a training forward's backward must run before the next "
                "forward (run a no-grad pass first)")
        self.ready.pop(out, None)
        self.ready[into] = self.copier.exchange(self.weights[out], self.weights[into])
        self.on_device[out], self.on_device[into] = False, True
        self.owner.record(Move(self.stack, phase, out, into))

    def before_block(self, index: int, inputs: tuple = ()) -> None:
        """Let the compute wait for block ``index``'s weights (upstream ``wait_for_block``); in a training forward,
        hook the gradients of its ``inputs`` for what follows its backward (module docstring)."""
        if not self.on_device[index]:
            raise RuntimeError(f"block swap ({self.stack}): block {index} is on the host at its forward")
        self.copier.wait(self.ready.pop(index, None))
        if self.training_pass and (self._swaps_after(index) or self._waits_after(index)):
            backward_done = self._backward_hook(index)
            for tensor in inputs:
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    tensor.register_hook(backward_done)

    def after_block(self, index: int) -> None:
        """Start the exchange that follows block ``index`` (upstream ``submit_move_blocks``)."""
        if self.k == 0:
            return
        if not self.training_pass:
            self._exchange(index, (self.n - self.k + index) % self.n, "sample")
        elif index < self.k:
            self._exchange(index, self.n - self.k + index, "forward")

    def _swaps_after(self, index: int) -> bool:
        return 0 < self.n - index - 1 <= self.k

    def _waits_after(self, index: int) -> bool:
        return 0 < index <= self.k

    def _backward_hook(self, index: int):
        """A gradient hook for each input of block ``index`` that acts at the first call only."""
        fired = []

        def hook(grad: torch.Tensor) -> None:
            if fired:
                return
            fired.append(True)
            if self._swaps_after(index):
                self._exchange(index + 1, index + self.k + 1 - self.n, "backward")
            if self._waits_after(index):
                self.before_block(index - 1)

        return hook


class BlockSwap:
    """A model's ``block_hooks`` for ``--blocks_to_swap``: one ``StackSwap`` per stack, ``swapped`` maps each stack's
    name to its blocks and how many of them swap (the family checked the counts). ``moves`` records every exchange
    when it is a list (tests, logs)."""

    def __init__(self, swapped: dict[str, tuple[nn.ModuleList, int]], device: torch.device):
        self.device = torch.device(device)
        self.copier = Copier(self.device)
        self.moves: list[Move] | None = None
        self.stacks = {name: StackSwap(name, blocks, count, self.copier, self)
                       for name, (blocks, count) in swapped.items()}

    def record(self, move: Move) -> None:
        if self.moves is not None:
            self.moves.append(move)

    def place(self, model: nn.Module) -> None:
        """Everything on the device except the weights of the blocks that start on the host (upstream
        ``move_to_device_except_swap_blocks`` + ``prepare_block_swap_before_forward``): the device never holds
        more than the resident blocks, even while placing."""
        host = {id(w) for stack in self.stacks.values() for w in stack.host_weights()}
        for param in model.parameters():
            if id(param) in host:
                param.data = self.copier.host_copy(param.data)
            else:
                param.data = param.data.to(self.device)
        for module in model.modules():
            for name, buffer in module.named_buffers(recurse=False):
                setattr(module, name, buffer.to(self.device))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for stack in self.stacks.values():
            stack.placed()

    def device_blocks(self, stack: str) -> list[int]:
        """Indices of ``stack``'s blocks whose weights are on the device now."""
        return [i for i, here in enumerate(self.stacks[stack].on_device) if here]

    def before_forward(self, model: nn.Module) -> None:
        self.copier.begin()
        for stack in self.stacks.values():
            stack.prepare()

    def before_block(self, stack: str, index: int, inputs: tuple) -> None:
        self.stacks[stack].before_block(index, inputs)

    def after_block(self, stack: str, index: int) -> None:
        self.stacks[stack].after_block(index)


def install(model: nn.Module, swap: BlockSwap) -> BlockSwap:
    """Place ``model`` for ``swap`` and make it the model's ``block_hooks`` (an earlier swap's removed first)."""
    disable_block_swap(model)
    swap.place(model)
    model.block_hooks = swap
    return swap


def disable_block_swap(model: nn.Module, device: torch.device | str | None = None) -> None:
    """Remove the hooks; with ``device``, every weight goes back there."""
    if isinstance(model.block_hooks, BlockSwap):
        model.block_hooks = None
        if device is not None:
            model.to(device)
