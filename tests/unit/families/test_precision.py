"""The dtype of every part under each precision mode."""

import pytest
import torch

from library.config import PrecisionConfig
from library.families.precision import precision_policy

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


@pytest.mark.parametrize("kwargs,expected", [
    ({}, (F32, F32, F32, None, False)),
    ({"mixed_precision": "bf16"}, (BF16, BF16, F32, BF16, False)),
    ({"mixed_precision": "bf16", "no_half_vae": True}, (BF16, F32, F32, BF16, False)),
    ({"mixed_precision": "bf16", "full_bf16": True}, (BF16, BF16, BF16, BF16, False)),
    ({"mixed_precision": "bf16", "full_bf16": True, "no_half_vae": True}, (BF16, F32, BF16, BF16, False)),
    ({"mixed_precision": "fp16"}, (F16, F16, F32, F16, True)),
    ({"mixed_precision": "fp16", "full_fp16": True}, (F16, F16, F16, F16, True)),
])
def test_policy(kwargs, expected):
    p = precision_policy(PrecisionConfig(**kwargs))
    assert (p.frozen_dtype, p.vae_dtype, p.network_dtype, p.autocast_dtype, p.loss_scaling) == expected


def test_describe_names_every_part():
    line = precision_policy(PrecisionConfig(mixed_precision="bf16", full_bf16=True)).describe("bf16", "UNet")
    for part in ("UNet bf16", "text encoder bf16", "VAE bf16", "LoRA weights bf16", "gradients bf16",
                 "optimizer state bf16", "loss fp32"):
        assert part in line
