"""Anima's flow-matching objective (``library/families/anima/objective.py`` on ``library/objectives/flow_matching.py``)
against upstream sd-scripts 48d368fa's own numbers.

Reference: ``tests/data/upstream_anima_objective.safetensors`` / ``.json``, written by
``tests/data/upstream_anima_objective.py`` in upstream's venv: for each case (every ``--timestep_sampling``, shifts,
``--sigmoid_scale``, the sigma sampler with each ``--weighting_scheme``, ``--ip_noise_gamma`` with and without
random strength; fp32 and bf16 weight dtypes; l2, Huber with the exponential schedule, smooth L1), after
``torch.manual_seed(seed)``: the noise, what ``flux_train_utils.get_noisy_model_input_and_timesteps`` returns,
``compute_loss_weighting_for_anima`` of its sigmas, and the loss of ``AnimaNetworkTrainer.process_batch`` (loss
weights, alpha masks) with a stand-in DiT. Upstream draws from the global CPU generator in the order ours draws from
its generator (noise, the sampler's draw, the input perturbation, its strength), so ours gets a CPU generator seeded
the same.

On the CPU that wrote the data every tensor was equal bit for bit. The tests allow fp32 rounding (another CPU's
vectorised sigmoid/exp/randn may round otherwise) and, for bf16 tensors, one bf16 step; the sigma sampler's
timesteps (IEEE-exact arithmetic only: the table, ``(u * 1000).long()``) must be equal, which is what tells
upstream's cast of the fp32 table timesteps from rounding the bf16 sigma times 1000 (which differs in a quarter of
the table's entries). Both were wrong here before these data: the sigma sampler's bf16 timesteps (540 where
upstream has 536 in ``sigma_cosmap_bf16``) and the exponential Huber schedule, which upstream computes on the DiT's
timesteps in [0, 1] (``huber_exponential`` failed by far).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from library.config import LossConfig, NoiseConfig
from library.families.anima.objective import AnimaFlow, AnimaObjective, loss_weighting
from library.objectives.flow_matching import model_timesteps, sample_noisy_model_input
from tests.parity import close

DATA = Path(__file__).resolve().parents[3] / "data"
FACTS = json.loads((DATA / "upstream_anima_objective.json").read_text())
REF = load_file(str(DATA / "upstream_anima_objective.safetensors"))
RTOL = {torch.float32: 1e-6, torch.bfloat16: 2.0**-7}
IEEE_ONLY = ("sigma", "sigma_bf16", "sigma_sigma_sqrt_bf16", "sigma_cosmap_bf16")


FLOW_FLAGS = tuple(AnimaFlow.__dataclass_fields__)
LOSS_FLAGS = ("loss_type", "huber_schedule", "huber_c", "huber_scale")


def case(name: str) -> tuple[AnimaFlow, int, torch.dtype, bool]:
    changes, seed, dtype, masked = FACTS["cases"][name]
    flags = {**FACTS["defaults"], **changes}
    return AnimaFlow(**{k: flags[k] for k in FLOW_FLAGS}), seed, getattr(torch, dtype), masked


def loss_config(name: str) -> LossConfig:
    flags = {**FACTS["defaults"], **FACTS["cases"][name][0]}
    return LossConfig(**{k: flags[k] for k in LOSS_FLAGS})


def ours(flow: AnimaFlow, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Our noise (drawn first, as the objective does) and the sampler's outputs from the generator that follows."""
    generator = torch.Generator().manual_seed(seed)
    latents = REF["latents"]
    noise = torch.randn(latents.shape, generator=generator, dtype=latents.dtype)
    noisy, timesteps, sigmas = sample_noisy_model_input(flow, latents, noise, generator, dtype)
    return {"noise": noise, "noisy": noisy, "timesteps": timesteps, "sigmas": sigmas}


def fake_dit(noisy: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
    """The generator's stand-in DiT as our family calls a DiT: 5-d input, timesteps / 1000."""
    x, t = noisy.unsqueeze(2), model_timesteps(timesteps).view(-1, 1, 1, 1, 1)
    return (x * (1 - t) + t / 2).squeeze(2)


def test_anima_flow_defaults_are_upstream_parser_defaults() -> None:
    """``AnimaFlow``'s and ``LossConfig``'s defaults are those the generator read from
    ``anima_train_network.setup_parser()``."""
    assert {k: FACTS["defaults"][k] for k in FLOW_FLAGS} == {k: getattr(AnimaFlow(), k) for k in FLOW_FLAGS}
    assert {k: FACTS["defaults"][k] for k in LOSS_FLAGS} == {k: getattr(LossConfig(), k) for k in LOSS_FLAGS}


@pytest.mark.parametrize("name", list(FACTS["cases"]))
def test_noisy_input_timesteps_and_sigmas_equal_upstream(name: str) -> None:
    flow, seed, dtype, _ = case(name)
    mine = ours(flow, seed, dtype)
    assert close(mine["noise"], REF[f"{name}.noise"], 1e-6)
    for key in ("noisy", "timesteps", "sigmas"):
        expected = REF[f"{name}.{key}"]
        assert close(mine[key], expected, RTOL[expected.dtype], same_dtype=True), key
    if name in IEEE_ONLY:
        assert torch.equal(mine["timesteps"], REF[f"{name}.timesteps"])
        assert torch.equal(mine["sigmas"], REF[f"{name}.sigmas"])


@pytest.mark.parametrize("name", list(FACTS["cases"]))
def test_weighting_of_the_drawn_sigmas_equals_upstream(name: str) -> None:
    flow, _, _, _ = case(name)
    expected = REF[f"{name}.weighting"]
    actual = loss_weighting(flow.weighting_scheme, REF[f"{name}.sigmas"])
    assert close(actual, expected, RTOL[expected.dtype], same_dtype=True)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("scheme", FACTS["schemes"])
def test_weighting_per_scheme_equals_upstream(scheme: str, dtype: str) -> None:
    expected = REF[f"weighting.{scheme}.{dtype}"]
    actual = loss_weighting(scheme, torch.tensor(FACTS["weighting_sigmas"]).to(getattr(torch, dtype)))
    assert close(actual, expected, RTOL[expected.dtype], same_dtype=True)


@pytest.mark.parametrize("name", list(FACTS["cases"]))
def test_the_loss_equals_process_batch(name: str) -> None:
    flow, seed, dtype, masked = case(name)
    mask = REF["alpha_mask"] if masked else None
    loss = AnimaObjective(flow, dtype).loss(REF["latents"], fake_dit, REF["loss_weights"], mask, noise=NoiseConfig(),
                                            loss=loss_config(name), generator=torch.Generator().manual_seed(seed),
                                            host_generator=None)
    assert close(loss.reshape(1), REF[f"{name}.loss"], 1e-5 if dtype == torch.float32 else 2.0**-7)


def test_the_reference_tells_a_wrong_shift_or_rounding_apart() -> None:
    """A shift of 3.1 instead of 3.0 moves the sigmas far outside the tolerance; rounding the bf16 sigma times 1000
    (instead of casting the fp32 table's timesteps, as upstream) changes some of the sigma sampler's timesteps; the
    recorded cases are not degenerate (distinct sigmas, masked and weighted losses differ from plain ones)."""
    flow, seed, dtype, _ = case("shift")
    wrong = ours(AnimaFlow(**{**flow.__dict__, "discrete_flow_shift": 3.1}), seed, dtype)
    assert not close(wrong["sigmas"], REF["shift.sigmas"], 1e-3)
    rounded = [(REF[f"{name}.sigmas"].flatten() * 1000).to(torch.bfloat16) for name in IEEE_ONLY[1:]]
    assert any(not torch.equal(r, REF[f"{name}.timesteps"]) for r, name in zip(rounded, IEEE_ONLY[1:], strict=True))
    assert all(REF[f"{name}.sigmas"].unique().numel() == 3 for name in FACTS["cases"])
    assert REF["sigmoid_cosmap.loss"] != REF["sigmoid_default.loss"]
