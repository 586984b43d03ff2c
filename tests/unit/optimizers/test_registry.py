"""Registry lookup, lazy imports, dotted paths and the option tables against the installed constructors."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest
import torch

from optimizers import REGISTRY, OptimizerConfigError, OptimizerSpec, build_optimizer, find_spec, validate_options
from optimizers.factories import ClassFactory, import_class

PROJECT_KEYS = {"stochastic_rounding", "seed", "eps2", "compiled"}
HEAVY = ["bitsandbytes", "transformers", "dadaptation", "prodigyopt", "lion_pytorch", "torchastic", "diffusers"]


def test_importing_the_package_imports_no_optimizer_package_and_nothing_from_the_trainer() -> None:
    code = (f"import sys, optimizers; print([m for m in sys.modules if m.split('.')[0] in {HEAVY!r} "
            "or m.startswith(('library', 'networks'))])")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=".")
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("typed", "expected"),
    [("", "AdamW"), ("adamw", "AdamW"), ("ADAMW_8BIT", "AdamW8bit"), ("DADAPT_ADA_GRAD", "DAdaptAdaGrad"),
     ("dadaptation", "DAdaptation"), ("DAdaptAdamPreprint", "DAdaptation"), ("DADAPT_SGD", "DAdaptSGD"),
     ("AdamWBF16", "StochasticAdamW"), ("sparkles", "SPARKLES"), ("LION_8BIT", "Lion8bit"),
     ("pagedadamw32bit", "PagedAdamW32bit"), ("sgdnesterov8bit", "SGDNesterov8bit")],
)
def test_names_match_case_insensitively_with_aliases(typed: str, expected: str) -> None:
    assert find_spec(typed).name == expected


def test_unknown_name_suggests_the_closest() -> None:
    with pytest.raises(OptimizerConfigError, match="DADAPT_SGD"):
        find_spec("DADATP_SGD")
    with pytest.raises(OptimizerConfigError, match="Prodigy"):
        find_spec("prodigi")


def test_dotted_path_is_built_like_sd_scripts() -> None:
    param = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    optimizer = build_optimizer("torchastic.AdamW", [param], 1e-3, weight_decay=0.1)
    assert type(optimizer).__module__.startswith("torchastic")
    assert optimizer.defaults["lr"] == 1e-3 and optimizer.defaults["weight_decay"] == 0.1
    with pytest.raises(OptimizerConfigError, match="centralization"):
        validate_options("torchastic.AdamW", {"not_there": 1})


def test_missing_package_says_what_to_install() -> None:
    with pytest.raises(OptimizerConfigError, match="pip install some-package==1.0"):
        import_class("no_such_module_for_tests", "Thing", "some-package==1.0")


def test_every_registered_package_pin_is_in_requirements() -> None:
    with open("requirements.txt", encoding="utf-8") as handle:
        pins = {line.split("#")[0].strip() for line in handle}
    for spec in REGISTRY.values():
        if spec.package:
            assert spec.package in pins, f"{spec.name}: {spec.package} not pinned in requirements.txt"


def constructor_of(spec: OptimizerSpec) -> inspect.Signature:
    if isinstance(spec.factory, ClassFactory):
        return inspect.signature(import_class(spec.factory.module, spec.factory.cls).__init__)
    return inspect.signature(import_class("transformers.optimization", "Adafactor").__init__)


@pytest.mark.parametrize("spec", list(REGISTRY.values()), ids=lambda spec: spec.name)
def test_option_table_matches_the_constructor(spec: OptimizerSpec) -> None:
    parameters = constructor_of(spec).parameters
    presets = dict(spec.factory.preset) if isinstance(spec.factory, ClassFactory) else {}
    for option, default in spec.options.items():
        if option in PROJECT_KEYS and option not in parameters:
            continue
        assert option in parameters, f"{spec.name}: {option} is not a constructor argument"
        expected = presets.get(option, parameters[option].default)
        assert default == expected, f"{spec.name}: table default {option}={default!r}, constructor {expected!r}"
    fixed = spec.factory.fixed if isinstance(spec.factory, ClassFactory) else {}
    untaken = set(parameters) - set(spec.options) - set(fixed) - {"self", "params", "lr", "args", "clip_lambda"}
    assert not untaken, f"{spec.name}: constructor options missing from the table: {sorted(untaken)}"
