"""The optimizer part of a fused-backward Adafactor step, ours against upstream's, on the same tensors and gradients.

Full fine-tuning with ``--fused_backward_pass --optimizer_type Adafactor`` steps every tensor inside backward. This
times that part alone, on bf16 tensors of one 2048-wide DiT block's shapes each (``--blocks``; 69 M parameters a
block: attention 2048x2048, cross-attention keys and values 2048x1024, MLP 2048x8192 and back, three rank-256
modulation pairs, the q/k norms), with bf16 gradients, ``relative_step=False scale_parameter=False
warmup_init=False``, lr 1e-5:

* ours: the registry's Adafactor in spans (``build_optimizer(..., in_spans=True)``: transformers' Adafactor inside
  ``StochasticRoundingWrapper``), stepped as ``library/train/update/fused.py`` steps it: per span of ``FUSED_SPAN``
  tensors one ``_foreach_norm`` for the per-tensor clipping factors and one ``step_span`` with the ``apply`` flags;
* upstream (``--upstream``: its ``library/adafactor_fused.py`` at 48d368fa, loaded from that file into this process,
  so both sides run the same torch and transformers): per tensor, ``clip_grad_norm_`` (what its trainers' hook calls
  through accelerate) and ``step_param`` (fp32 copies of the weight and gradient, transformers' update, rounding
  with ``torch.randint`` bits).

Gradients are set before each timed step (not timed). Sides alternate each round; the median over ``--steps``
rounds after ``--warmup`` is printed, in s/step and ns per parameter. ``--profile`` adds the top ops by self CPU time
of one more step of each side (torch.profiler).

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.adafactor_step --upstream <sd-scripts>/library/adafactor_fused.py
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from library.train.update.fused import FUSED_SPAN
from optimizers import build_optimizer

OPTIONS = {"relative_step": False, "scale_parameter": False, "warmup_init": False}
LR = 1e-5
MAX_GRAD_NORM = 1.0
WIDTH, CONTEXT, HIDDEN, RANK, HEAD = 2048, 1024, 8192, 256, 128
BLOCK_SHAPES = (
    [(WIDTH, WIDTH)] * 4 + [(HEAD,)] * 2  # self-attention q, k, v, out; q/k norms
    + [(WIDTH, WIDTH), (WIDTH, CONTEXT), (WIDTH, CONTEXT), (WIDTH, WIDTH)] + [(HEAD,)] * 2  # cross-attention
    + [(HIDDEN, WIDTH), (WIDTH, HIDDEN)]  # MLP
    + [(RANK, WIDTH), (3 * WIDTH, RANK)] * 3  # modulation of the three sub-layers
)


def make_tensors(blocks: int) -> tuple[list[torch.nn.Parameter], list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    shapes = BLOCK_SHAPES * blocks
    params = [torch.nn.Parameter((torch.randn(s, generator=generator) * 0.02).bfloat16()) for s in shapes]
    grads = [(torch.randn(s, generator=generator) * 1e-3).bfloat16() for s in shapes]
    return params, grads


def ours(params: list[torch.nn.Parameter]) -> Callable[[], None]:
    optimizer = build_optimizer("Adafactor", params, LR, in_spans=True, **OPTIONS)
    spans = optimizer.spans(FUSED_SPAN)

    def step() -> None:
        for span in spans:
            norms = torch.stack(torch._foreach_norm([p.grad for p in span], dtype=torch.float32))
            scale = torch.clamp(MAX_GRAD_NORM / (norms + 1e-6), max=1.0)
            optimizer.step_span(span, apply=torch.isfinite(norms), grad_scale=scale)
            for p in span:
                p.grad = None
    return step


def upstream(params: list[torch.nn.Parameter], path: Path) -> Callable[[], None]:
    from transformers.optimization import Adafactor

    spec = importlib.util.spec_from_file_location("upstream_adafactor_fused", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    optimizer = Adafactor(params, lr=LR, **OPTIONS)
    module.patch_adafactor_fused(optimizer)
    group = optimizer.param_groups[0]

    def step() -> None:
        for p in params:
            torch.nn.utils.clip_grad_norm_(p, MAX_GRAD_NORM)
            optimizer.step_param(p, group)
            p.grad = None
    return step


def timed(step: Callable[[], None], params: list[torch.nn.Parameter], grads: list[torch.Tensor]) -> float:
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def profile(name: str, step: Callable[[], None], params: list[torch.nn.Parameter], grads: list[torch.Tensor]) -> None:
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    with torch.profiler.profile() as prof:
        step()
    print(f"\n{name}: top ops by self CPU time")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--upstream", type=Path, help="upstream's library/adafactor_fused.py (48d368fa)")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    sides = {"ours": make_tensors(args.blocks)}
    steps = {"ours": ours(sides["ours"][0])}
    if args.upstream:
        sides["upstream"] = make_tensors(args.blocks)
        steps["upstream"] = upstream(sides["upstream"][0], args.upstream)
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(args.warmup + args.steps):
        for name, (params, grads) in sides.items():
            times[name].append(timed(steps[name], params, grads))
    numel = sum(p.numel() for p in sides["ours"][0])
    print(f"{args.blocks} block(s), {len(sides['ours'][0])} tensors, {numel / 1e6:.1f} M parameters, torch "
          f"{torch.__version__}, {torch.get_num_threads()} thread(s)")
    for name, values in times.items():
        median = statistics.median(values[args.warmup:])
        rounded = ", ".join(f"{value:.3f}" for value in values[args.warmup:])
        print(f"{name}: {median:.3f} s/step ({median / numel * 1e9:.2f} ns/param; steps {rounded})")
    if args.profile:
        for name, (params, grads) in sides.items():
            profile(name, steps[name], params, grads)


if __name__ == "__main__":
    main()
