"""End to end (issue 30): ``--fused_backward_pass --gradient_accumulation_steps 2`` (sd-scripts refuses the
combination) trains the same weights as the unfused run with the same accumulation, bit for bit (``--max_grad_norm
0``: the fused path clips each tensor on its own): a LoRA in fp32, ``fine_tune.py`` training the U-Net and the text
encoder in fp32 and in full bf16, ``sdxl_train.py --fused_optimizer_groups`` with Adafactor in full bf16 and
``flux_train.py --blockwise_fused_optimizers`` in bf16. The tiny model's 2.4 M U-Net weights take the compiled
optimizer kernels, which the fused path must take for each 32-tensor span too (compiled and eager kernels round
differently)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import train_network
from tests.e2e.test_fine_tune import images

COMMON = ["--pretrained_model_name_or_path", "builtin:tiny-sd15", "--resolution", "64", "--output_name", "out",
          "--learning_rate", "1e-3", "--seed", "3", "--max_data_loader_n_workers", "0", "--optimizer_type",
          "StochasticAdamW", "--train_batch_size", "1", "--gradient_accumulation_steps", "2", "--max_grad_norm", "0",
          "--max_train_steps", "2", "--save_every_n_steps", "1"]
PASS = ["--fused_backward_pass"]
CASES = {
    "lora-fp32": (None, ["--caption_extension", ".txt", "--network_module", "networks.lora", "--network_dim", "4"],
                  PASS),
    "fine_tune-fp32": ("fine_tune.py", ["--train_text_encoder", "--save_model_as", "safetensors"], PASS),
    "fine_tune-full_bf16": ("fine_tune.py", ["--train_text_encoder", "--save_model_as", "safetensors",
                                             "--mixed_precision", "bf16", "--full_bf16"], PASS),
    # sd-scripts' SDXL memory recipe (Adafactor, full bf16), its weights rounded stochastically by the wrapper
    "sdxl_train-adafactor-groups": ("sdxl_train.py", [
        "--pretrained_model_name_or_path", "builtin:tiny-sdxl", "--caption_extension", ".txt",
        "--train_text_encoder", "--save_model_as", "safetensors", "--mixed_precision", "bf16", "--full_bf16",
        "--optimizer_type", "Adafactor", "--optimizer_args", "relative_step=False", "scale_parameter=False"],
        ["--fused_optimizer_groups", "6"]),
    # flux_train.py: bf16 weights under --mixed_precision bf16 (as upstream's), stepped block by block
    "flux_train-blockwise": ("flux_train.py", [
        "--pretrained_model_name_or_path", "builtin:tiny-flux", "--caption_extension", ".txt", "--mixed_precision",
        "bf16", "--cache_latents", "--cache_text_encoder_outputs"], ["--blockwise_fused_optimizers"]),
}


@pytest.mark.parametrize("case", CASES)
def test_fused_backward_with_accumulation_equals_the_unfused_run(tmp_path, case):
    script, extra, flags = CASES[case]
    args = [*COMMON, "--train_data_dir", str(images(tmp_path / "d")), *extra]
    for name, fused in (("fused", flags), ("unfused", [])):
        assert train_network.main([*args, "--output_dir", str(tmp_path / name), *fused], script=script) == 0
    fused, unfused = (load_file(tmp_path / name / "out.safetensors") for name in ("fused", "unfused"))
    assert fused.keys() == unfused.keys()
    assert [key for key in fused if not torch.equal(fused[key], unfused[key])] == []
    first = load_file(tmp_path / "fused" / "out-step00000001.safetensors")
    assert sum(not torch.equal(first[key], fused[key]) for key in fused) > len(fused) // 2  # the second update trained
