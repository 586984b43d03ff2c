"""2-process checks of the patched train_network's stochastic-rounding gradient accumulation (patches/check.sh runs
this under ``torch.distributed.run --nproc_per_node 2``; accelerate makes it a MULTI_CPU run with gloo).

train_network.py prepares the network with ``accelerator.prepare``, which wraps it in DistributedDataParallel, but
never calls the wrapper's forward: the LoRA modules run inside the UNet and the text encoder. DDP's reducer only
acts on a backward that follows its own forward, so it never touches ``.grad``, and upstream averages the gradients
by hand (``all_reduce_network``) on the sync step. These checks run that path on a small bf16 module in the order of
train_network's loop, each process with its own batches; only the main process prints.
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import upstream_env  # noqa: F401  (first: torchvision stub, offline, one thread)

# isort: split

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from accelerate import Accelerator, DistributedType  # noqa: E402
from accumulation_setup import STEPS, Net, batches, compare_restored, loss_of, parse  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

import train_network  # noqa: E402

upstream_env.quiet_logging()
accelerator = Accelerator(gradient_accumulation_steps=STEPS, cpu=True)
RANK, WORLD = accelerator.process_index, accelerator.num_processes
if RANK:
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (the other process only computes)
check = upstream_env.check


def gathered(tensor: torch.Tensor) -> list[torch.Tensor]:
    """Every process's copy of ``tensor`` (fp32)."""
    parts = [torch.zeros_like(tensor, dtype=torch.float32) for _ in range(WORLD)]
    dist.all_gather(parts, tensor.float().contiguous())
    return parts


trainer = train_network.NetworkTrainer()
args = parse("--mixed_precision", "bf16", "--full_bf16", "--gradient_accumulation_steps", str(STEPS))


@check(f"{WORLD} processes (accelerate {accelerator.distributed_type.value}, gloo): enabled; DeepSpeed still refused")
def _():
    assert WORLD == 2 and accelerator.distributed_type == DistributedType.MULTI_CPU, accelerator.distributed_type
    assert trainer.use_sr_grad_accumulation(args, accelerator) is True
    deepspeed = parse("--mixed_precision", "bf16", "--full_bf16", "--gradient_accumulation_steps", str(STEPS),
                      "--deepspeed")
    try:
        trainer.use_sr_grad_accumulation(deepspeed, SimpleNamespace(num_processes=1))
    except ValueError as error:
        assert "--no_sr_grad_accumulation" in str(error), error
    else:
        raise AssertionError("not refused under DeepSpeed")


@check("under DDP: .grad empty between micro-batches, restored before all_reduce_network, the same mean on both "
       "processes within bf16 rounding, unused parameter fine")
def _():
    torch.manual_seed(0)  # the same initial weights everywhere (DDP would broadcast rank 0's anyway)
    net = Net().to(torch.bfloat16)
    reference = {name: torch.zeros_like(p, dtype=torch.float64) for name, p in net.named_parameters()}
    for rank in range(WORLD):  # each process's window summed by plain autograd, in fp64; then the mean
        for x in batches(100 + rank):
            net.zero_grad(set_to_none=True)
            (loss_of(net, x) / STEPS).backward()
            for name, p in net.named_parameters():
                if p.grad is not None:
                    reference[name] += p.grad.double() / WORLD
    net.zero_grad(set_to_none=True)

    optimizer = torch.optim.SGD(net.parameters(), lr=0.0)
    wrapped, optimizer = accelerator.prepare(net, optimizer)
    assert isinstance(wrapped, DistributedDataParallel), type(wrapped)
    inner = accelerator.unwrap_model(wrapped)
    handles = trainer.assign_sr_grad_accumulation_hooks(accelerator, wrapped)
    restored = None
    for index, x in enumerate(batches(100 + RANK)):
        with accelerator.accumulate(wrapped):
            accelerator.backward(loss_of(inner, x))  # as train_network: the module runs, not the DDP wrapper
            if accelerator.sync_gradients:
                assert index == STEPS - 1, f"sync at micro-batch {index}"
                assert all(p.grad is None for p in inner.parameters()), ".grad set before restore"
                trainer.restore_sr_grad_accumulation(accelerator, wrapped)
                trainer.all_reduce_network(accelerator, wrapped)
                restored = {name: None if p.grad is None else p.grad.clone() for name, p in inner.named_parameters()}
                accelerator.clip_grad_norm_(list(inner.parameters()), 1e9)
            else:
                assert all(p.grad is None for p in inner.parameters()), f".grad set after micro-batch {index}"
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    for handle in handles:
        handle.remove()
    assert restored is not None, "no sync step"

    def same_on_every_process(name: str, got: torch.Tensor) -> None:
        copies = gathered(got)
        assert all(torch.equal(copies[0], c) for c in copies), f"{name}: the processes' gradients differ"

    worst = compare_restored(reference, restored, same_on_every_process)
    return f"max error {worst:.1e} of the largest gradient; bf16 step is 7.8e-03"


upstream_env.finish("accumulation (2 processes)")
