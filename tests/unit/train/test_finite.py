"""Finite checks of many tensors (library/train/finite.py) against per-tensor ``torch.isfinite``."""

import pytest
import torch

from library.base.errors import UserError
from library.train.finite import all_finite, floating_tensors, non_finite_names, refuse_non_finite


def _tensors():
    return {"a": torch.ones(3), "b": torch.zeros(2, 2, dtype=torch.bfloat16), "c": torch.arange(4),
            "d": torch.tensor([1e5]), "e": torch.empty(0)}


def test_all_finite_is_a_device_flag():
    tensors = _tensors()
    flag = all_finite([t for t in tensors.values() if t.is_floating_point()])
    assert flag.dtype == torch.bool and flag.dim() == 0 and bool(flag)
    for bad in (float("nan"), float("inf"), -float("inf")):
        changed = dict(tensors, b=torch.tensor([[0.0, bad]], dtype=torch.bfloat16))
        assert not bool(all_finite([t for t in changed.values() if t.is_floating_point()]))


def test_names_of_non_finite_tensors_also_after_the_save_cast():
    tensors = dict(_tensors(), a=torch.tensor([1.0, float("nan")]))
    assert non_finite_names(tensors) == ["a"]
    assert non_finite_names(tensors, torch.float16) == ["a", "d"]  # 1e5 is above fp16's 65504: Inf once cast
    assert non_finite_names(tensors, torch.bfloat16) == ["a"]


def test_floating_tensors_walks_nested_state():
    tree = {"network": {"w": torch.ones(1)}, "optimizer": {"state": {0: {"step": torch.tensor(3), "m": torch.ones(2)}},
                                                          "param_groups": [{"lr": 1.0}]}}
    assert [name for name, _ in floating_tensors(tree)] == ["network.w", "optimizer.state.0.m"]


def test_refusal_names_the_file_and_counts():
    with pytest.raises(UserError, match=r"--network_weights x.safetensors: 1 of 4 tensors hold NaN or Inf \(e.g. a\)"):
        refuse_non_finite(dict(_tensors(), a=torch.tensor([float("inf")])), "--network_weights x.safetensors", "fix")
