"""``--torch_compile --dynamo_backend``: a backend the installed torch lacks is refused at the start, before the
model loads, with exit 2 and the names this torch accepts (``library/runtime/compile_checks.py``; issue 22)."""

from __future__ import annotations

import pytest

from library.base.errors import UserError
from library.config.precision import DYNAMO_BACKENDS, PrecisionConfig
from library.runtime.compile_checks import check_dynamo_backend, installed_backends
from tests.e2e.test_train_network import refused, train_args

# Names sd-scripts and accelerate offer that torch 2.x no longer has (the first one missing from this torch is used).
GONE = ("ofi", "nvprims_nvfuser", "aot_ts_nvfuser", "fx2trt", "tensort", "ipex")


def _missing() -> list[str]:
    installed = installed_backends()
    return [name for name in GONE if name not in installed]


def _precision(backend: str, torch_compile: bool = True) -> PrecisionConfig:
    return PrecisionConfig(torch_compile=torch_compile, dynamo_backend=backend)


def test_every_missing_name_is_a_choice_of_the_flag():
    assert set(GONE) <= set(DYNAMO_BACKENDS)


def test_a_missing_backend_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    missing = _missing()
    if not missing:
        pytest.skip("this torch has every backend of the list")
    from library.families import model_setup

    monkeypatch.setattr(model_setup, "load_model", lambda *a, **k: pytest.fail("the model loaded first"))
    backend = missing[0]
    err = refused(capsys, train_args(tmp_path / "out", "--torch_compile", "--dynamo_backend", backend),
                  f"--dynamo_backend {backend}", "available:", "inductor", "eager")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    assert "no such torch.compile backend" in err


@pytest.mark.parametrize("backend", GONE)
def test_the_message_names_the_value_and_lists_the_installed_ones(backend):
    if backend in installed_backends():
        pytest.skip(f"this torch has {backend}")
    with pytest.raises(UserError) as caught:
        check_dynamo_backend(_precision(backend))
    (message,) = caught.value.messages
    assert message.startswith(f"--dynamo_backend {backend}: ")
    listed = message.split("available: ")[1].split(", ")
    assert {"no", "eager", "aot_eager", "inductor"} <= set(listed)
    assert set(listed) <= set(DYNAMO_BACKENDS)  # only names the flag itself accepts
    assert backend not in listed


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor", "no"])
def test_an_installed_backend_passes(backend):
    check_dynamo_backend(_precision(backend))


def test_the_debug_backends_count_as_installed():
    """``list_backends()`` hides ``eager`` and ``aot_eager`` by default; ``torch.compile`` accepts them."""
    assert {"eager", "aot_eager", "inductor"} <= set(installed_backends())


@pytest.mark.parametrize("backend", GONE)
def test_without_torch_compile_the_flag_is_not_checked(backend, monkeypatch):
    """Without ``--torch_compile`` the flag does nothing (as in sd-scripts), so any of its choices passes."""
    from library.runtime import compile_checks

    monkeypatch.setattr(compile_checks, "installed_backends", lambda: pytest.fail("checked without --torch_compile"))
    check_dynamo_backend(_precision(backend, torch_compile=False))
