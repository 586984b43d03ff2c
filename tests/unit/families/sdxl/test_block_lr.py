"""``sdxl_train.py --block_lr``: the 23 blocks of the diffusers U-Net against upstream's rule on its SGM names, the
optimizer groups and their log names, and the refusals of a wrong value.

Expected facts from upstream 48d368fa ``sdxl_train.py``: ``get_block_params_to_optimize`` (lines 52-77) puts an SGM
U-Net parameter in block 0 (``time_embed.``, ``label_emb.``), 1 + n (``input_blocks.n``), 10 + n (``middle_block.n``),
13 + n (``output_blocks.n``) or 22 (``out.``) and leaves a block at lr 0 out of the optimizer;
``append_block_lr_to_logs`` (lines 80-97) names the groups ``block<i>`` (those not at 0), then ``text_encoder1`` and
``text_encoder2``. The per-block tensor counts of the real-size U-Net were counted on upstream's own
``SdxlUNet2DConditionModel`` (built on the meta device).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from library.families.checkpoint_flags import CheckpointFormat
from library.families.sdxl.config import SDXLFineTuneConfig, parse_block_lr, sdxl_fine_tune_problems
from library.families.sdxl.fine_tuning import sdxl_fine_tune_parts, unet_blocks
from library.train.full_model import build_trained_model
from networks.unet_names import unet_key_map

# Parameter tensors per block of upstream's SdxlUNet2DConditionModel (meta device, 48d368fa).
UPSTREAM_TENSORS_PER_BLOCK = [8, 2, 10, 10, 2, 58, 56, 2, 218, 216, 10, 206, 10, 218, 218, 220, 58, 58, 60, 12, 12,
                              12, 4]


def upstream_block(sgm_name: str) -> int:
    """Upstream's if-chain of ``get_block_params_to_optimize``, restated."""
    if sgm_name.startswith(("time_embed.", "label_emb.")):
        return 0
    for prefix, first in (("input_blocks.", 1), ("middle_block.", 10), ("output_blocks.", 13)):
        if sgm_name.startswith(prefix):
            return first + int(sgm_name.split(".")[1])
    if sgm_name.startswith("out."):
        return 22
    raise AssertionError(f"unexpected parameter name: {sgm_name}")


@pytest.fixture(scope="module")
def tiny():
    from library.families.sdxl.loading import build_builtin_sdxl

    return build_builtin_sdxl("builtin:tiny-sdxl", 0)


def test_the_23_blocks_of_the_tiny_unet_follow_upstreams_rule_and_partition_it(tiny):
    named = dict(tiny.unet.named_parameters())
    sgm = unet_key_map(list(named), tiny.unet.config.layers_per_block)
    expected = [set() for _ in range(23)]
    for name in named:
        expected[upstream_block(sgm[name])].add(name)
    by_id = {id(param): name for name, param in named.items()}
    got = [{by_id[id(param)] for param in block} for block in unet_blocks(tiny.unet)]
    assert got == expected
    assert all(expected) and sum(len(block) for block in unet_blocks(tiny.unet)) == len(named)
    assert {"conv_in.weight", "conv_in.bias"} == got[1] and "conv_out.weight" in got[22]
    assert "add_embedding.linear_1.weight" in got[0] and "time_embedding.linear_2.bias" in got[0]


def test_the_real_size_unet_has_upstreams_tensor_count_per_block():
    from accelerate import init_empty_weights
    from diffusers import UNet2DConditionModel

    from library.families.model_parts import config_dir

    with init_empty_weights():
        unet = UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(str(config_dir("sdxl") / "unet")))
    assert [len(block) for block in unet_blocks(unet)] == UPSTREAM_TENSORS_PER_BLOCK


def _lrs(zero: set[int]) -> str:
    return ",".join("0" if i in zero else f"{i + 1}e-5" for i in range(23))


def test_groups_are_the_blocks_not_at_0_named_as_upstream_logs_them_and_the_others_freeze(tiny):
    section = SDXLFineTuneConfig(block_lr=_lrs({1, 12, 22}), train_text_encoder=True, learning_rate_te1=2e-6)
    record = SimpleNamespace(trained_parts=sdxl_fine_tune_parts)
    trained, train_te = build_trained_model(record, section, tiny, 1e-4, torch.float32, CheckpointFormat(False, True))
    groups, names = trained.prepare_optimizer_params(None, None, 1e-4)
    blocks = [i for i in range(23) if i not in {1, 12, 22}]
    assert names == [f"block{i}" for i in blocks] + ["text_encoder1", "text_encoder2"]
    assert [g["lr"] for g in groups] == [float(f"{i + 1}e-5") for i in blocks] + [2e-6, 1e-4]
    assert train_te
    unet_blocks_params = unet_blocks(tiny.unet)
    for i, block in enumerate(unet_blocks_params):  # block 1 (conv_in) keeps requires_grad: fine_tuning.py
        assert all(p.requires_grad == (i not in {12, 22}) for p in block), i
    trained_ids = {id(p) for g in groups[:len(blocks)] for p in g["params"]}
    assert trained_ids == {id(p) for i in blocks for p in unet_blocks_params[i]}


def test_without_block_lr_the_unet_is_one_group(tiny):
    record = SimpleNamespace(trained_parts=sdxl_fine_tune_parts)
    trained, _ = build_trained_model(record, SDXLFineTuneConfig(), tiny, 1e-4, torch.float32,
                                     CheckpointFormat(False, True))
    groups, names = trained.prepare_optimizer_params(None, None, 1e-4)
    assert names == ["unet"] and len(groups[0]["params"]) == len(list(tiny.unet.parameters()))


def test_learning_rate_0_or_every_block_at_0_leaves_the_unet_out(tiny):
    assert sdxl_fine_tune_parts(tiny, SDXLFineTuneConfig(block_lr=_lrs(set())), 0) == []
    assert sdxl_fine_tune_parts(tiny, SDXLFineTuneConfig(block_lr=_lrs(set(range(23)))), 1e-4) == []


def test_parse_reads_23_numbers():
    assert parse_block_lr(" 1e-4, 0 ," + ",".join(["2"] * 21)) == [1e-4, 0.0] + [2.0] * 21


@pytest.mark.parametrize(("value", "message"), [
    (",".join(["1e-4"] * 22), "--block_lr: 22 values given; SDXL's U-Net has 23 blocks: "),
    (",".join(["1e-4"] * 24), "--block_lr: 24 values given; "),
    ("1e-4", "--block_lr: 1 value given; "),
    ("1e-4,x" + ",1e-4" * 21, "--block_lr: value 1 ('x', block1) is not a learning rate"),
    (",1e-4" * 22, "--block_lr: value 0 ('', block0) is not a learning rate"),
    ("-1e-4" + ",1e-4" * 22, "--block_lr: value 0 ('-1e-4', block0) is not a learning rate"),
    ("1e-4" + ",nan" + ",1e-4" * 21, "--block_lr: value 1 ('nan', block1) is not a learning rate"),
    (_lrs(set(range(23))), "--block_lr: every block is at 0 and no text encoder trains"),
])
def test_refused_values_name_the_flag(value, message):
    problems = sdxl_fine_tune_problems(SimpleNamespace(family_config=SDXLFineTuneConfig(block_lr=value)))
    assert len(problems) == 1 and problems[0].startswith(message), problems


def test_a_valid_block_lr_is_no_problem():
    assert sdxl_fine_tune_problems(SimpleNamespace(family_config=SDXLFineTuneConfig(block_lr=_lrs({3})))) == []
    every_zero = SDXLFineTuneConfig(block_lr=_lrs(set(range(23))), train_text_encoder=True)
    assert sdxl_fine_tune_problems(SimpleNamespace(family_config=every_zero)) == []
