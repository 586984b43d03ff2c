"""The built-in Anima models and their options (``builtin:tiny-anima[:...]``, ``builtin:anima-random[:...]``).

Expected sizes come from upstream's real layout (``docs/anima-upstream-facts.md`` section 9: the parameters of each
group of the 28-block DiT) and from the Qwen-Image VAE's count there (section 4: 126.9 M), not from our modules."""

from __future__ import annotations

import pytest
import torch

from library.base.errors import UserError
from library.families.anima.builtin import build_builtin_parts, build_tiny_dit

# upstream's 28-block DiT (facts section 9): per group, parameters
REAL = {"base": 17_049_600, "self_attn": 469_769_216, "cross_attn": 352_328_704, "mlp": 939_524_096,
        "mod": 177_733_632, "llm_adapter": 134_663_680}
FINAL_MOD = 2048 * 256 + 256 * 2 * 2048  # final_layer.adaln_modulation: Linear(2048, 256), Linear(256, 2 x 2048)


def count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_tiny_anima_without_options_is_the_tiny_dit():
    dit, qwen3, _ = build_builtin_parts("builtin:tiny-anima")
    reference = build_tiny_dit().state_dict()
    assert len(dit.blocks) == 2 and all(torch.equal(v, reference[k]) for k, v in dit.state_dict().items())
    assert len(qwen3.layers) == 2


def test_options_set_the_blocks_and_qwen3_layers():
    dit, qwen3, _ = build_builtin_parts("builtin:tiny-anima:blocks=4,qwen3_layers=1")
    assert len(dit.blocks) == 4 and len(qwen3.layers) == 1


def test_anima_random_has_the_real_widths_at_the_asked_depth():
    dit, qwen3, vae = build_builtin_parts("builtin:anima-random:blocks=1,qwen3_layers=1")
    per_block = (REAL["self_attn"] + REAL["cross_attn"] + REAL["mlp"] + REAL["mod"] - FINAL_MOD) // 28
    assert count(dit) == REAL["base"] + REAL["llm_adapter"] + FINAL_MOD + per_block
    assert qwen3.config.hidden_size == 1024 and len(qwen3.layers) == 1 and qwen3.config.vocab_size == 151_936
    assert round(count(vae) / 1e5) == 1269


@pytest.mark.parametrize(("name", "said"), [
    ("builtin:tiny-anima:block=4", "unknown option 'block=4'"),
    ("builtin:anima-random:blocks=0", "blocks='0' must be a whole number"),
    ("builtin:anima-rand", "not a built-in Anima model"),
])
def test_a_wrong_name_or_option_says_what_is_allowed(name, said):
    with pytest.raises(UserError, match=said):
        build_builtin_parts(name)
