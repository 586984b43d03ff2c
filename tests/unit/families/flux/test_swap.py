"""``--blocks_to_swap``: upstream's split and limit, the exact exchanges of a training step and of a sampling
forward (written out by hand from upstream's ``ModelOffloader`` schedule), and results equal bit for bit to no
swapping on the CPU (both sides of the move on the CPU), with and without gradient checkpointing, LoRA attached."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from library.base.errors import UserError
from library.families.block_swap import disable_block_swap
from library.families.flux.model import FluxTransformer
from library.families.flux.params import TINY
from library.families.flux.swap import check_blocks_to_swap, enable_block_swap, max_blocks_to_swap, swap_split
from networks.lora_flux import create_network

PARAMS = replace(TINY, depth=4, depth_single_blocks=8)  # largest N: 5 (2 double + 6 single)


def _model_and_lora(seed: int = 0):
    torch.manual_seed(seed)
    model = FluxTransformer(PARAMS)
    model.requires_grad_(False)
    network = create_network(1.0, 2, 1.0, None, [None, None], model)
    network.apply_to(None, model, apply_text_encoder=False, apply_unet=True)
    for lora in network.unet_loras:  # a zero lora_up would give lora_down no gradient
        torch.nn.init.normal_(lora.lora_up.weight, std=0.1)
    return model, network


def _inputs(b: int = 2, n: int = 6, txt_len: int = 3, seed: int = 1) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {
        "img": torch.randn(b, n, PARAMS.in_channels, generator=gen),
        "img_ids": torch.rand(b, n, 3, generator=gen) * 4,
        "txt": torch.randn(b, txt_len, PARAMS.context_in_dim, generator=gen),
        "txt_ids": torch.zeros(b, txt_len, 3),
        "timesteps": torch.rand(b, generator=gen),
        "y": torch.randn(b, PARAMS.vec_in_dim, generator=gen),
        "guidance": torch.full((b,), 3.5),
    }


def _step(model, network, inputs: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
    network.zero_grad(set_to_none=True)
    out = model(**inputs)
    weight = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
    (out * weight).sum().backward()
    return out.detach(), [p.grad.clone() for p in network.parameters()]


def _linear_weights(block) -> list[torch.Tensor]:
    return [m.weight for m in block.modules() if isinstance(m, torch.nn.Linear)]


def _watch_device_memory(model, blocks_to_swap: int) -> set[int]:
    """The storage of the Linear weights of the blocks that start on the device (all but the last swapped ones of
    each stack); before each block runs, its weights must live there (the device never gets new weight storage)."""
    host = set(_swapped(blocks_to_swap))
    return {w.data_ptr() for stack, blocks in (("double", model.double_blocks), ("single", model.single_blocks))
            for i, block in enumerate(blocks) if (stack, i) not in host for w in _linear_weights(block)}


def _check_before_blocks(model, resident: set[int], seen: list[int]):
    def pre_hook(module, args):
        assert all(w.data_ptr() in resident for w in _linear_weights(module))
        seen.append(1)

    for block in list(model.double_blocks) + list(model.single_blocks):
        block.register_forward_pre_hook(pre_hook)


def test_split_and_limit_as_upstream():
    assert swap_split(1) == (0, 2)
    assert swap_split(18) == (9, 18)
    assert swap_split(35) == (17, 36)
    assert max_blocks_to_swap(19, 38) == 35  # FLUX.1-dev, upstream's docs: up to 35
    assert max_blocks_to_swap(4, 8) == 5
    assert max_blocks_to_swap(2, 2) == 0  # builtin:tiny-flux cannot swap
    with pytest.raises(UserError, match="cannot swap more than 17 double blocks and 36 single blocks; requested "
                                        "18 double blocks and 36 single blocks.*largest N .* is 35"):
        check_blocks_to_swap(36, 19, 38)


def test_above_the_limit_is_refused():
    model, _ = _model_and_lora()
    with pytest.raises(UserError, match="cannot swap more than 2 double blocks and 6 single blocks; requested "
                                        "3 double blocks and 6 single blocks"):
        enable_block_swap(model, 6, "cpu")
    assert model.block_hooks is None


def test_a_trained_weight_gets_its_gradient_while_its_block_is_on_the_device():
    """flux_train.py's fused backward pass steps each weight from its post-accumulate-grad hook: every trained Linear
    weight of a block must then be in the device memory the blocks share (the storages the resident blocks start
    in), including those of swapped blocks."""
    torch.manual_seed(0)
    model = FluxTransformer(PARAMS)
    resident = _watch_device_memory(model, 5)
    enable_block_swap(model, 5, "cpu")
    arrived, outside = [], []
    for stack in (model.double_blocks, model.single_blocks):
        for block in stack:
            for weight in _linear_weights(block):
                weight.register_post_accumulate_grad_hook(
                    lambda w: (arrived if w.data_ptr() in resident else outside).append(w))
    model(**_inputs()).square().mean().backward()
    assert len(arrived) == sum(len(_linear_weights(b)) for b in [*model.double_blocks, *model.single_blocks])
    assert outside == []


# Hand-written from upstream's schedule: forward (i, n-k+i) for i < k; backward hooks of blocks n-2 .. n-k-1
# move (i+1, i+k+1-n); single stack's backward runs before the double stack's.
TRAIN_MOVES = {
    1: [("single", "forward", 0, 6), ("single", "forward", 1, 7),
        ("single", "backward", 7, 1), ("single", "backward", 6, 0)],
    5: [("double", "forward", 0, 2), ("double", "forward", 1, 3)]
    + [("single", "forward", i, i + 2) for i in range(6)]
    + [("single", "backward", 7, 5), ("single", "backward", 6, 4), ("single", "backward", 5, 3),
       ("single", "backward", 4, 2), ("single", "backward", 3, 1), ("single", "backward", 2, 0),
       ("double", "backward", 3, 1), ("double", "backward", 2, 0)],
}
STARTING = {1: ([0, 1, 2, 3], [0, 1, 2, 3, 4, 5]), 5: ([0, 1], [0, 1])}


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("blocks_to_swap", [1, 5])
def test_training_equals_no_swap(blocks_to_swap: int, checkpointing: bool):
    reference, ref_net = _model_and_lora()
    model, network = _model_and_lora()
    for m in (reference, model):
        m.train()
        if checkpointing:
            m.enable_gradient_checkpointing()
    swap = enable_block_swap(model, blocks_to_swap, "cpu")
    swap.moves = []
    resident, seen = _watch_device_memory(model, blocks_to_swap), []
    assert len(resident) == sum(len(_linear_weights(b)) for b in model.double_blocks) + sum(
        len(_linear_weights(b)) for b in model.single_blocks) - sum(
        len(_linear_weights(model.block(*key))) for key in _swapped(blocks_to_swap))
    _check_before_blocks(model, resident, seen)
    lora_storage = [p.data_ptr() for p in network.parameters()]
    for step in range(2):
        inputs = _inputs(seed=step)
        want_out, want_grads = _step(reference, ref_net, inputs)
        out, grads = _step(model, network, inputs)
        assert torch.equal(out, want_out)
        assert len(grads) == len(want_grads) and all(torch.equal(g, w) for g, w in zip(grads, want_grads, strict=True))
        assert all(g.abs().sum() > 0 for g in grads)
        assert [(m.stack, m.phase, m.out, m.into) for m in swap.moves] == TRAIN_MOVES[blocks_to_swap]
        assert (swap.device_blocks("double"), swap.device_blocks("single")) == STARTING[blocks_to_swap]
        swap.moves.clear()
    assert len(seen) == 2 * 12 * (1 + checkpointing)  # recomputed blocks checked too
    assert [p.data_ptr() for p in network.parameters()] == lora_storage  # LoRA parameters never move


def _swapped(blocks_to_swap: int) -> list[tuple[str, int]]:
    double, single = swap_split(blocks_to_swap)
    return [("double", 4 - 1 - i) for i in range(double)] + [("single", 8 - 1 - i) for i in range(single)]


def test_sampling_forward_equals_and_turns_the_window():
    reference, _ = _model_and_lora()
    model, _ = _model_and_lora()
    swap = enable_block_swap(model, 5, "cpu")
    swap.moves = []
    resident, seen = _watch_device_memory(model, 5), []
    _check_before_blocks(model, resident, seen)
    with torch.no_grad():
        for step in range(2):
            inputs = _inputs(seed=10 + step)
            assert torch.equal(model(**inputs), reference(**inputs))
            double = [("double", "sample", i, (i + 2) % 4) for i in range(4)]
            single = [("single", "sample", i, (i + 2) % 8) for i in range(8)]
            assert [(m.stack, m.phase, m.out, m.into) for m in swap.moves] == double + single
            assert (swap.device_blocks("double"), swap.device_blocks("single")) == ([0, 1], [0, 1])
            swap.moves.clear()
    assert len(seen) == 24


def test_sampling_between_training_steps_and_forward_without_backward():
    reference, ref_net = _model_and_lora()
    model, network = _model_and_lora()
    swap = enable_block_swap(model, 5, "cpu")
    _step(model, network, _inputs(seed=0))
    with torch.no_grad():
        assert torch.equal(model(**_inputs(seed=3)), reference(**_inputs(seed=3)))
    model(**_inputs(seed=4))  # a training forward whose backward never runs
    swap.moves = []
    out, grads = _step(model, network, _inputs(seed=5))
    want_out, want_grads = _step(reference, ref_net, _inputs(seed=5))
    assert torch.equal(out, want_out) and all(torch.equal(g, w) for g, w in zip(grads, want_grads, strict=True))
    # left after a training forward: double 2, 3 and single 6, 7 on the device; back to 0, 1 in each stack
    assert [(m.stack, m.phase, m.out, m.into) for m in swap.moves[:4]] == [
        ("double", "prepare", 2, 0), ("double", "prepare", 3, 1),
        ("single", "prepare", 6, 0), ("single", "prepare", 7, 1)]


def test_backward_after_another_forward_is_refused():
    model, network = _model_and_lora()
    enable_block_swap(model, 5, "cpu")
    out = model(**_inputs(seed=0))
    with torch.no_grad():
        model(**_inputs(seed=1))
    with pytest.raises(RuntimeError, match="backward must run before the next forward"):
        out.sum().backward()


def test_disable_restores_plain_forward():
    reference, _ = _model_and_lora()
    model, _ = _model_and_lora()
    enable_block_swap(model, 5, "cpu")
    disable_block_swap(model, "cpu")
    assert model.block_hooks is None
    with torch.no_grad():
        assert torch.equal(model(**_inputs(seed=7)), reference(**_inputs(seed=7)))
