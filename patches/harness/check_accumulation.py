"""Checks on the patched train_network's stochastic-rounding gradient accumulation (run by patches/check.sh).

Uses the patched NetworkTrainer's own methods and accelerate's own accumulate/sync gating on a small bf16 module, in
the order of train_network's loop: backward; on the sync step restore first, then clip and step.
"""

from __future__ import annotations

from types import SimpleNamespace

import upstream_env  # noqa: F401  (first: torchvision stub, offline, one thread)

# isort: split

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accumulation_setup import STEPS, Net, batches, compare_restored, loss_of, parse  # noqa: E402

import train_network  # noqa: E402

upstream_env.quiet_logging()
check = upstream_env.check


trainer = train_network.NetworkTrainer()
args = parse("--mixed_precision", "bf16", "--full_bf16", "--gradient_accumulation_steps", str(STEPS))


@check("enabled for --full_bf16 with --gradient_accumulation_steps 4, off otherwise")
def _():
    accelerator = SimpleNamespace(num_processes=1)
    assert trainer.use_sr_grad_accumulation(args, accelerator) is True
    for argv in (["--mixed_precision", "bf16", "--full_bf16"],
                 ["--mixed_precision", "bf16", "--gradient_accumulation_steps", "4"],
                 ["--mixed_precision", "bf16", "--full_bf16", "--gradient_accumulation_steps", "4",
                  "--no_sr_grad_accumulation"]):
        assert trainer.use_sr_grad_accumulation(parse(*argv), accelerator) is False, argv


@check("refused under DeepSpeed, with the way out in the message; 2 processes: check_accumulation_ddp.py")
def _():
    deepspeed = parse("--mixed_precision", "bf16", "--full_bf16", "--gradient_accumulation_steps", "4", "--deepspeed")
    try:
        trainer.use_sr_grad_accumulation(deepspeed, SimpleNamespace(num_processes=1))
    except ValueError as error:
        assert "--no_sr_grad_accumulation" in str(error), error
        return str(error)[:80] + "..."
    raise AssertionError("not refused under DeepSpeed")


@check("hooks: .grad empty between micro-batches, fp32 sum after restore, unused parameter fine")
def _():
    torch.manual_seed(0)
    net = Net().to(torch.bfloat16)
    reference = {name: torch.zeros_like(p, dtype=torch.float64) for name, p in net.named_parameters()}
    for x in batches(1):  # plain autograd, one micro-batch at a time, summed in fp64
        net.zero_grad(set_to_none=True)
        (loss_of(net, x) / STEPS).backward()
        for name, p in net.named_parameters():
            if p.grad is not None:
                reference[name] += p.grad.double()
    net.zero_grad(set_to_none=True)

    accelerator = Accelerator(gradient_accumulation_steps=STEPS, cpu=True)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.0)
    net, optimizer = accelerator.prepare(net, optimizer)
    handles = trainer.assign_sr_grad_accumulation_hooks(accelerator, net)
    assert len(handles) == 4, f"{len(handles)} hooks for 4 bf16 parameters"
    restored = None
    for index, x in enumerate(batches(1)):
        with accelerator.accumulate(net):
            accelerator.backward(loss_of(net, x))
            if accelerator.sync_gradients:
                assert index == STEPS - 1, f"sync at micro-batch {index}"
                assert all(p.grad is None for p in net.parameters()), ".grad set before restore"
                trainer.restore_sr_grad_accumulation(accelerator, net)
                restored = {name: None if p.grad is None else p.grad.clone() for name, p in net.named_parameters()}
                accelerator.clip_grad_norm_(list(net.parameters()), 1e9)
            else:
                assert all(p.grad is None for p in net.parameters()), f".grad set after micro-batch {index}"
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    for handle in handles:
        handle.remove()
    assert restored is not None, "no sync step"
    worst = compare_restored(reference, restored)
    assert all(not hasattr(p, "acc_grad") for p in net.parameters()), "buffer left behind"
    return f"max error {worst:.1e} of the largest gradient; bf16 step is 7.8e-03"


@check("unbiased where round-to-nearest stalls: 1 + 255 x 0.001 per element")
def _():
    def accumulate(hooked: bool) -> float:
        weight = torch.nn.Parameter(torch.zeros(4096, dtype=torch.bfloat16))
        holder = torch.nn.Module()
        holder.weight = weight
        accelerator = SimpleNamespace(unwrap_model=lambda model: model)
        handles = trainer.assign_sr_grad_accumulation_hooks(accelerator, holder) if hooked else []
        torch.manual_seed(0)
        for value in [1.0] + [0.001] * 255:
            (weight * value).sum().backward()
        if hooked:
            trainer.restore_sr_grad_accumulation(accelerator, holder)
        for handle in handles:
            handle.remove()
        return weight.grad.double().mean().item()

    sr, nearest = accumulate(True), accumulate(False)
    assert abs(sr - 1.255) < 0.01, f"stochastic rounding mean {sr}"
    assert nearest == 1.0, f"round-to-nearest gave {nearest}"
    return f"SR mean {sr:.4f}, round-to-nearest {nearest:.4f}, exact 1.255"


upstream_env.finish("accumulation")
