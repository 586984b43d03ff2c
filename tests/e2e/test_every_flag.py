"""Every flag that the entry scripts share, through every family's script on its tiny model: each one trains (exit
0, a warning naming the flag allowed), or is refused with exit 2 and a message naming it; never a traceback nor any
other exit code. The cases come from the parsers (``tests/e2e/flag_examples.py``): one per (family, flag), so a new
flag or family adds its cases by itself. A case is one update of one 64x64 image in this process; the LoRA and
state that some flags read come from one first run per family. Each built-in model is built once per set of load
inputs and each case trains a deep copy (``tests/e2e/model_cache.py``); a case whose flags change what the loader
receives (``--vae``, ``--v2``, a precision that changes the frozen dtype, ...) builds its own. SDXL's tiny model is
made shallower here (``shallow_tiny_sdxl``: one transformer layer per block, two-layer text encoders), which the
flags do not notice; its 204 cases take 59 s alone instead of 328 s. Its full depth, and with it SDXL's LoRA module
names, is tested where the names matter (``tests/unit/networks/test_sdxl_lora.py``)."""

from __future__ import annotations

import gc
import re
import shutil
from pathlib import Path

import pytest
import torch

import train_network
from tests.e2e.flag_examples import (
    DIVERGES,
    EXAMPLES,
    SKIP,
    TINY,
    Inputs,
    base_args,
    example_tokens,
    script_parsers,
    shared_flags,
)
from tests.e2e.model_cache import cached_builtin_models, shallow_tiny_sdxl

SAMPLES = Path(__file__).resolve().parents[2] / "configs" / "sample_data"
FLAGS = shared_flags()
CASES = [(family, flag) for flag, owners in FLAGS.items() if flag not in SKIP for family in owners]


def names(flag: str, dest: str) -> re.Pattern:
    """Where a message names the flag: as given, as its current name, or bare as in a TOML key (not as a part of a
    longer flag's name)."""
    alternatives = "|".join(re.escape(name.lstrip("-")) for name in {flag, dest})
    return re.compile(rf"(?<![\w-])(?:--)?(?:{alternatives})(?!\w)")


def run(family: str, args: list[str]) -> int:
    """The exit code of ``family``'s script with ``args``, run in this process (``--help`` exits through
    argparse)."""
    try:
        return train_network.main(args, family=family)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1


@pytest.fixture(scope="module", autouse=True)
def library_logs_through_root():
    """diffusers and transformers bind their own handler to the stderr of their first log line, which in a test is
    the capture of one case, closed before the next one logs: they log through the root logger here instead."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    for library in (diffusers_logging, transformers_logging):
        library.disable_default_handler()
        library.enable_propagation()
    yield
    for library in (diffusers_logging, transformers_logging):
        library.disable_propagation()
        library.enable_default_handler()


@pytest.fixture(scope="module", autouse=True)
def garbage_collected_young():
    """Each case leaves its model and LoRA behind as cyclic garbage (a LoRA module and the layer it wraps hold each
    other through the patched ``forward``): ~100,000 objects for SDXL's tiny model. With Python's default thresholds
    they live long enough to reach the oldest generation, whose collections walk the whole heap of the process
    (0.3 s each, a quarter of an SDXL case); with larger young generations they are collected there, and the
    module takes about a fifth less time (``gc.callbacks`` timing, 19 SDXL cases: GC 7.7 s -> 1.2 s)."""
    thresholds = gc.get_threshold()
    gc.set_threshold(10_000, 50, 10)
    yield
    gc.set_threshold(*thresholds)
    gc.collect()


@pytest.fixture(scope="module", autouse=True)
def models_built_once(tmp_path_factory):
    """The built-in models, built once per set of load inputs for the whole module (``tests/e2e/model_cache.py``),
    SDXL's shallower."""
    with shallow_tiny_sdxl(tmp_path_factory.mktemp("configs")), cached_builtin_models() as built:
        yield built


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    """Two of the bundled images with their captions, in one folder repeated once."""
    root = tmp_path_factory.mktemp("every_flag_images")
    folder = root / "1_shapes"
    folder.mkdir()
    for image in sorted((SAMPLES / "10_shapes").glob("*.png"))[:2]:
        shutil.copy(image, folder)
        shutil.copy(image.with_suffix(".txt"), folder)
    return root


@pytest.fixture(scope="module")
def first_runs(tmp_path_factory, images):
    """A function giving a family's first run (made once): its LoRA file and the state folder saved at its end."""
    made: dict[str, tuple[Path, Path]] = {}

    def first_run(family: str) -> tuple[Path, Path]:
        if family not in made:
            out = tmp_path_factory.mktemp(f"first_run_{family}")
            assert run(family, [*base_args(family, images, out), "--save_state_on_train_end"]) == 0
            made[family] = (out / "lora.safetensors", next(out.glob("*-state")))
        return made[family]

    return first_run


def check_flag(family, flag, tmp_path, images, first_runs, capsys, caplog) -> None:
    """One case: ``family``'s script with ``flag`` trains (a warning naming it allowed), or exits 2 naming it."""
    data = tmp_path / "data"
    shutil.copytree(images, data)
    inputs = Inputs(family, tmp_path, data, lambda: first_runs(family))
    action = FLAGS[flag][family]
    args = [*base_args(family, data, tmp_path / "out"), *example_tokens(flag, action, inputs)]
    code = run(family, args)
    out, err = capsys.readouterr()
    said = out + err + caplog.text
    assert "Traceback" not in said, f"{' '.join(args)}\n{said[-3000:]}"
    if code == 2:
        assert names(flag, action.dest).search(err), f"exit 2 without naming {flag}: {err[-2000:]}"
    elif flag in DIVERGES:
        assert code == 3 and "the weights became NaN or Inf" in err, f"exit {code}: {err[-2000:]}"
    else:
        assert code == 0, f"exit {code}: {' '.join(args)}\n{err[-3000:]}"


def family_cases(family: str) -> type:
    """The cases of one family as a test class: ``make test``'s ``--dist loadscope`` keeps a class on one worker and
    spreads the classes, so the families' cases train side by side while each worker keeps its first runs."""

    @pytest.mark.parametrize("flag", [flag for owner, flag in CASES if owner == family])
    def test_flag_trains_warns_or_is_refused(self, flag, tmp_path, images, first_runs, capsys, caplog):
        check_flag(family, flag, tmp_path, images, first_runs, capsys, caplog)

    return type(f"TestFlagsOf{family.capitalize()}", (), {"test_flag_trains_warns_or_is_refused":
                                                           test_flag_trains_warns_or_is_refused})


for _family in sorted({family for family, _ in CASES}):
    globals()[f"TestFlagsOf{_family.capitalize()}"] = family_cases(_family)


@pytest.mark.parametrize("family", sorted(TINY))
def test_a_cached_model_is_a_fresh_copy_of_a_real_load(family, models_built_once):
    """What a case trains is the model the loader builds, and nothing one case does to it reaches the next."""
    from library.config import ModelConfig
    from library.families.registry import FAMILIES, model_family

    behaviour, spec = model_family(family), FAMILIES[family]
    inputs = (ModelConfig(pretrained_model_name_or_path=TINY[family]), spec.section() if spec.section else None,
              torch.float32)
    first = behaviour.load(*inputs)
    real = type(behaviour).load.__wrapped__(behaviour, *inputs).unet.state_dict()
    with torch.no_grad():
        for param in first.unet.parameters():
            param.add_(1.0)
    second = behaviour.load(*inputs).unet.state_dict()
    assert second.keys() == real.keys() and all(second[key].equal(real[key]) for key in real)
    moved = dict(first.unet.named_parameters())
    assert moved and not any(moved[name].equal(real[name]) for name in moved)


def test_every_family_has_a_tiny_model():
    assert sorted(script_parsers()) == sorted(TINY)


def test_skipped_and_example_flags_are_still_shared_flags():
    assert [flag for flag in SKIP if flag not in FLAGS] == []
    assert [flag for flag in EXAMPLES if flag not in FLAGS] == []
    assert [flag for flag in DIVERGES if flag not in FLAGS] == []
