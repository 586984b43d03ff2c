"""``--blocks_to_swap`` on the Anima DiT (its one stack ``blocks``): upstream's limit (depth - 2), the exact exchanges
of a training step and of a sampling forward (written out by hand from upstream's ``ModelOffloader`` schedule for six
blocks), which blocks' weights are in device memory before each block runs and when each weight gets its gradient,
results equal bit for bit to no swapping on the CPU (both sides of the move on the CPU) with and without gradient
checkpointing, a LoRA attached and the Qwen3 states (read by every block) requiring grad, and the family's
placement."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from library.base.errors import UserError
from library.families.anima.family import AnimaFamily
from library.families.anima.model import AnimaTransformer
from library.families.anima.params import TINY
from library.families.anima.swap import check_blocks_to_swap, enable_block_swap
from networks.lora_anima import create_network

DEPTH = 6
PARAMS = replace(TINY, num_blocks=DEPTH)  # swaps at most 4


def _model(seed: int = 0) -> AnimaTransformer:
    torch.manual_seed(seed)
    return AnimaTransformer(PARAMS)


def _model_and_lora(seed: int = 0):
    model = _model(seed).requires_grad_(False)
    network = create_network(1.0, 2, 1.0, None, [], model)
    network.apply_to([], model, apply_text_encoder=False, apply_unet=True)
    for lora in network.unet_loras:  # a zero lora_up would give lora_down no gradient
        torch.nn.init.normal_(lora.lora_up.weight, std=0.1)
    return model, network


def _inputs(seed: int = 1, grad: bool = False) -> dict:
    gen = torch.Generator().manual_seed(seed)
    t5_mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    return {"x": torch.randn(2, 16, 1, 4, 6, generator=gen), "timesteps": torch.rand(2, generator=gen),
            "context": torch.randn(2, 5, PARAMS.text_dim, generator=gen).requires_grad_(grad),
            "target_input_ids": torch.randint(0, PARAMS.adapter_vocab, (2, 4), generator=gen) * t5_mask,
            "target_attention_mask": t5_mask, "source_attention_mask": torch.tensor([[1, 1, 1, 1, 0], [1] * 5])}


def _step(model, network, inputs: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The prediction, and the gradients of the LoRA and of the Qwen3 states, after a weighted-sum backward."""
    network.zero_grad(set_to_none=True)
    inputs = {**inputs, "context": inputs["context"].detach().requires_grad_(True)}
    out = model(**inputs)
    (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
    return out.detach(), [p.grad.clone() for p in network.parameters()] + [inputs["context"].grad]


def _linear_weights(block) -> list[torch.Tensor]:
    return [m.weight for m in block.modules() if isinstance(m, torch.nn.Linear)]


def _resident_storage(model, blocks_to_swap: int) -> set[int]:
    """Storage of the Linear weights of the blocks that start on the device (all but the last ``blocks_to_swap``):
    the device never gets other storage for block weights."""
    return {w.data_ptr() for block in model.blocks[:DEPTH - blocks_to_swap] for w in _linear_weights(block)}


def _check_before_blocks(model, resident: set[int], seen: list[int]) -> None:
    def pre_hook(module, args):
        assert all(w.data_ptr() in resident for w in _linear_weights(module))
        seen.append(1)

    for block in model.blocks:
        block.register_forward_pre_hook(pre_hook)


def test_limit_as_upstream():
    assert check_blocks_to_swap(26, 28) == 26  # the real DiT: upstream's "Cannot swap more than 26 blocks"
    with pytest.raises(UserError, match=r"--blocks_to_swap 27: cannot swap more than 26 blocks; this DiT has 28 "
                                        r"blocks.*use --blocks_to_swap 26 or less"):
        check_blocks_to_swap(27, 28)
    with pytest.raises(UserError, match="--blocks_to_swap -1: must be 0 or more"):
        check_blocks_to_swap(-1, 28)
    model = AnimaTransformer(TINY)  # builtin:tiny-anima's two blocks: nothing may swap
    with pytest.raises(UserError, match="cannot swap more than 0 blocks; this DiT has 2 blocks"):
        enable_block_swap(model, 1, "cpu")
    assert model.block_hooks is None


# Hand-written from upstream's schedule for 6 blocks: forward (i, 6-k+i) for i < k; the backward hooks of blocks 4
# down to 5-k move (i+1, i+k-5); afterwards blocks 0 .. 5-k are on the device again.
TRAIN_MOVES = {
    1: [("forward", 0, 5), ("backward", 5, 0)],
    4: [("forward", 0, 2), ("forward", 1, 3), ("forward", 2, 4), ("forward", 3, 5),
        ("backward", 5, 3), ("backward", 4, 2), ("backward", 3, 1), ("backward", 2, 0)],
}
STARTING = {1: [0, 1, 2, 3, 4], 4: [0, 1]}


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("blocks_to_swap", [1, 4])
def test_training_equals_no_swap(blocks_to_swap: int, checkpointing: bool):
    reference, ref_net = _model_and_lora()
    model, network = _model_and_lora()
    for m in (reference, model):
        m.train()
        if checkpointing:
            m.enable_gradient_checkpointing()
    resident, seen = _resident_storage(model, blocks_to_swap), []
    swap = enable_block_swap(model, blocks_to_swap, "cpu")
    swap.moves = []
    _check_before_blocks(model, resident, seen)
    lora_storage = [p.data_ptr() for p in network.parameters()]
    for step in range(2):
        inputs = _inputs(seed=step)
        want_out, want_grads = _step(reference, ref_net, inputs)
        out, grads = _step(model, network, inputs)
        assert torch.equal(out, want_out)
        assert len(grads) == len(want_grads) and all(torch.equal(g, w) for g, w in zip(grads, want_grads, strict=True))
        assert all(g.abs().sum() > 0 for g in grads)
        assert [(m.stack, m.phase, m.out, m.into) for m in swap.moves] == [
            ("blocks", *move) for move in TRAIN_MOVES[blocks_to_swap]]
        assert swap.device_blocks("blocks") == STARTING[blocks_to_swap]
        swap.moves.clear()
    assert len(seen) == 2 * DEPTH * (1 + checkpointing)  # recomputed blocks checked too
    assert [p.data_ptr() for p in network.parameters()] == lora_storage  # LoRA parameters never move


def test_every_block_weight_gets_its_gradient_while_on_the_device():
    """Full fine-tuning steps each weight from its post-accumulate-grad hook (``--fused_backward_pass``): every
    Linear weight of every block, the swapped ones included, must then be in the device memory the blocks share."""
    model = _model()
    resident = _resident_storage(model, 4)
    enable_block_swap(model, 4, "cpu")
    arrived, outside = [], []
    for block in model.blocks:
        for weight in _linear_weights(block):
            weight.register_post_accumulate_grad_hook(
                lambda w: (arrived if w.data_ptr() in resident else outside).append(w))
    model.train()
    model(**_inputs()).square().mean().backward()
    assert len(arrived) == DEPTH * 16 and outside == []  # a block: 2 x 4 attention, 2 MLP, 3 x 2 adaLN Linears


def test_sampling_forward_equals_and_turns_the_window():
    reference, _ = _model_and_lora()
    model, _ = _model_and_lora()
    resident, seen = _resident_storage(model, 4), []
    swap = enable_block_swap(model, 4, "cpu")
    swap.moves = []
    _check_before_blocks(model, resident, seen)
    with torch.no_grad():
        for step in range(2):
            inputs = _inputs(seed=10 + step)
            assert torch.equal(model(**inputs), reference(**inputs))
            assert [(m.phase, m.out, m.into) for m in swap.moves] == [
                ("sample", 0, 2), ("sample", 1, 3), ("sample", 2, 4), ("sample", 3, 5), ("sample", 4, 0),
                ("sample", 5, 1)]
            assert swap.device_blocks("blocks") == [0, 1]
            swap.moves.clear()
    assert len(seen) == 2 * DEPTH


def test_sampling_between_training_steps_and_forward_without_backward():
    reference, ref_net = _model_and_lora()
    model, network = _model_and_lora()
    swap = enable_block_swap(model, 4, "cpu")
    _step(model, network, _inputs(seed=0))
    with torch.no_grad():
        assert torch.equal(model(**_inputs(seed=3)), reference(**_inputs(seed=3)))
    model(**_inputs(seed=4))  # a training forward whose backward never runs: blocks 4, 5 left on the device
    swap.moves = []
    out, grads = _step(model, network, _inputs(seed=5))
    want_out, want_grads = _step(reference, ref_net, _inputs(seed=5))
    assert torch.equal(out, want_out) and all(torch.equal(g, w) for g, w in zip(grads, want_grads, strict=True))
    assert [(m.phase, m.out, m.into) for m in swap.moves[:2]] == [("prepare", 4, 0), ("prepare", 5, 1)]


def test_the_family_loads_to_the_host_and_places_all_but_the_swapped_blocks():
    """``denoiser_device`` keeps a swapping DiT on the host, ``place_denoiser`` installs the swap for the training
    device (the CPU here, where moving to the device keeps a tensor's storage and only the weights sent to the host
    get new storage: the last three blocks' Linear weights)."""
    family, device = AnimaFamily(), torch.device("cpu")
    for count in (None, 0):
        assert family.denoiser_device(SimpleNamespace(blocks_to_swap=count), torch.device("meta")).type == "meta"
    section = SimpleNamespace(blocks_to_swap=3)
    assert family.denoiser_device(section, torch.device("meta")) == torch.device("cpu")
    bundle = SimpleNamespace(unet=_model())
    before = {name: p.data_ptr() for name, p in bundle.unet.named_parameters()}
    family.place_denoiser(bundle, section, device)
    dit = bundle.unet
    copied = {name for name, p in dit.named_parameters() if p.data_ptr() != before[name]}
    assert copied == {f"blocks.{i}.{name}.weight" for i in (3, 4, 5) for name, m in dit.blocks[i].named_modules()
                      if isinstance(m, torch.nn.Linear)}
    assert dit.block_hooks.device == device and dit.block_hooks.device_blocks("blocks") == [0, 1, 2]
    unswapped = SimpleNamespace(unet=_model())
    family.place_denoiser(unswapped, SimpleNamespace(blocks_to_swap=0), device)
    assert unswapped.unet.block_hooks is None
