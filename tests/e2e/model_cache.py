"""Built-in tiny models built once per set of load inputs and handed out as fresh deep copies, for tests that run
the entry point many times in one process (``tests/e2e/test_every_flag.py``).

Each registered family's ``ModelFamily.load`` receives the run's ``ModelConfig``, its own section, the frozen dtype
and the file device; a built-in model (``builtin:...``, no ``--vae``) is a pure function of them (its weights come
from a fixed seed with the caller's RNG restored: ``library/families/model_parts.seeded``), so the cache is keyed on
all four, and any other model (a folder, a file, a replaced VAE) still loads for real every time. The copy is deep
(nothing a run does to its model, casts, fp8 storage, LoRA injection, compilation, reaches the cached one) but for
the tokenizers, which are shared: nothing in a run changes one (``library/`` sets no tokenizer attribute after
loading), and their deep copy costs more than the U-Net's. Modules are copied by ``module_copy``, which gives what
``copy.deepcopy`` gives at a third of its time (tiny SDXL: 0.07 s instead of 0.17 s, once per case).

``shallow_tiny_sdxl`` makes ``builtin:tiny-sdxl`` shallower for such tests: one transformer layer per U-Net block
and two layers per text encoder, where the built-in model keeps SDXL's depths (transformer layers 1/2/10, text
encoders 12 and 32 layers) so that its LoRA has SDXL's module names. A flag's handling does not depend on the
depth, and the shallow model's LoRA has 156 modules instead of 986.
"""

from __future__ import annotations

import copy
import functools
import json
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

BUILTIN = "builtin:"
_TENSORS = ("_parameters", "_buffers")


def module_copy(value: Any, memo: dict[int, Any]) -> Any:
    """``copy.deepcopy(value, memo)``, with every ``torch.nn.Module`` in it copied attribute by attribute: submodules
    by this function, parameters and buffers by their own deep copy (a clone keeping ``requires_grad``), empty dicts
    (the hook tables) as new empty ones, anything else by ``copy.deepcopy``, all through one ``memo`` (an object met
    twice is copied once). It skips deepcopy's generic reduce path for each of the model's thousands of modules."""
    from torch import nn

    if id(value) in memo:
        return memo[id(value)]
    if not isinstance(value, nn.Module):
        return copy.deepcopy(value, memo)
    new = object.__new__(type(value))
    memo[id(value)] = new
    for key, item in value.__dict__.items():
        if key == "_modules":
            item = {name: None if sub is None else module_copy(sub, memo) for name, sub in item.items()}
        elif key in _TENSORS:
            item = {name: copy.deepcopy(tensor, memo) for name, tensor in item.items()}
        elif isinstance(item, dict) and not item:
            item = type(item)()
        else:
            item = copy.deepcopy(item, memo)
        new.__dict__[key] = item
    return new


def cacheable(cfg: Any) -> bool:
    """Whether the loader builds this model from code alone: a built-in name and no replacement VAE."""
    name = cfg.pretrained_model_name_or_path
    return isinstance(name, str) and name.startswith(BUILTIN) and cfg.vae is None


@contextmanager
def cached_builtin_models() -> Iterator[dict[str, Any]]:
    """Within the block every registered family's ``load`` builds each built-in model once per (config, section,
    dtype, file device) and returns a deep copy; yields the cache (keyed by the inputs' repr), emptied at the end."""
    from transformers import PreTrainedTokenizerBase

    from library.families.registry import FAMILIES, model_family

    built: dict[str, Any] = {}

    def caching(load):
        @functools.wraps(load)
        def load_once(self, cfg, section, dtype, file_device="cpu"):
            if not cacheable(cfg):
                return load(self, cfg, section, dtype, file_device=file_device)
            key = repr((type(self).__name__, cfg, section, dtype, file_device))
            if key not in built:
                built[key] = load(self, cfg, section, dtype, file_device=file_device)
            model = built[key]
            shared = {id(part): part for part in vars(model).values() if isinstance(part, PreTrainedTokenizerBase)}
            fresh = copy.copy(model)
            for name, part in vars(model).items():
                setattr(fresh, name, module_copy(part, shared))
            return fresh
        return load_once

    with pytest.MonkeyPatch.context() as patch:
        for family in {type(model_family(name)) for name in FAMILIES}:
            patch.setattr(family, "load", caching(family.load))
        yield built
    built.clear()


@contextmanager
def shallow_tiny_sdxl(folder: Path) -> Iterator[None]:
    """Within the block ``builtin:tiny-sdxl`` is built from a copy of its bundled config (written into ``folder``)
    with one transformer layer per U-Net block and two layers per text encoder (SDXL reads the penultimate one)."""
    from library.families.sdxl import loading

    original = loading.config_dir
    shallow = folder / "tiny-sdxl"
    shutil.copytree(original("tiny-sdxl"), shallow)
    for part, key, value in (("unet", "transformer_layers_per_block", [1, 1, 1]),
                             ("text_encoder", "num_hidden_layers", 2), ("text_encoder_2", "num_hidden_layers", 2)):
        config = json.loads((shallow / part / "config.json").read_text(encoding="utf-8"))
        config[key] = value
        (shallow / part / "config.json").write_text(json.dumps(config), encoding="utf-8")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loading, "config_dir", lambda name: shallow if name == "tiny-sdxl" else original(name))
        yield
