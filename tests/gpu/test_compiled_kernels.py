"""CUDA variants of the compiled-kernel tests (``tests/unit/optimizers/test_rounding.py`` and ``test_compiled.py``
on the CPU); skipped without CUDA (``pytest -m gpu`` selects them). ``bench/gpu.py`` runs the same checks as its
section 0 and 1.

On CUDA ``torch.compile`` generates Triton kernels: ``hash32``'s int32 wrap-around and masked shifts, and the
branchless NaN test of the compiled rounding, are code-generated anew and must give the bits of the CPU.
"""

from __future__ import annotations

import pytest
import torch

from bench import gpu_checks, gpu_sections
from optimizers import StochasticAdamW
from optimizers.rounding import bits_seed, hash32

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
CUDA = torch.device("cuda")


def test_hash32_gives_the_same_bits_on_the_cpu_on_cuda_and_compiled_by_triton():
    before = gpu_sections.inductor_kernels()
    lines = gpu_checks.hash_agreement(CUDA)  # raises SectionFailed on any differing element
    assert len(lines) == 2 + len(gpu_checks.SEEDS)
    assert gpu_sections.inductor_kernels() > before  # inductor generated (Triton) kernels for it


def test_hash32_on_cuda_equals_the_host_integers_at_the_int32_edges():
    index = torch.tensor([0, 1, 2**31 - 1, -(2**31), -1], dtype=torch.int32, device=CUDA)
    seed = torch.tensor(-123456789, dtype=torch.int32, device=CUDA)
    assert hash32(index, seed).cpu().tolist() == [bits_seed(-123456789, i) for i in (0, 1, 2**31 - 1, -(2**31), -1)]


def test_stochastic_rounding_through_a_triton_kernel_is_unbiased_and_equals_eager():
    gpu_checks.sr_unbiased(CUDA, 1 << 22)  # raises SectionFailed beyond 5 standard errors or on any unlike bit


def test_compiled_adamw_on_cuda_agrees_with_eager_to_fp32_rounding():
    size = gpu_sections.sizes(False, 8)
    lines = gpu_sections.compiled_kernel(size, gpu_sections.Budget(600), lambda lines: None)
    assert "compiles in window" in lines[0]


def test_compiled_adamw_step_on_cuda_is_unbiased():
    """As ``test_compiled_adamw_step_is_unbiased`` on the CPU: one step from a constant, the mean of the bf16
    results is the exact fp32 update within four standard errors."""
    theta, grad, lr = 1.0, 3e-2, 1e-3
    params = [torch.nn.Parameter(torch.full((256, 1024), theta, dtype=torch.bfloat16, device=CUDA))]
    params[0].grad = torch.full_like(params[0], grad)
    StochasticAdamW(params, lr=lr, weight_decay=0.0, compiled=True, seed=9).step()
    g = float(torch.tensor(grad, dtype=torch.bfloat16))
    eta = lr / (1 - 0.9)
    expected = theta - eta * (0.1 * g) / ((0.001 * g * g) ** 0.5 / 0.001 ** 0.5 + 1e-8)
    values = params[0].detach().double().reshape(-1)
    standard_error = float(values.std()) / values.numel() ** 0.5
    assert standard_error > 0
    assert abs(float(values.mean()) - expected) <= 4 * standard_error
