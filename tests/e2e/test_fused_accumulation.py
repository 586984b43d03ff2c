"""End to end (issue 30): ``train_network.py`` with ``--fused_backward_pass --gradient_accumulation_steps 2``
(sd-scripts refuses the combination) trains the same LoRA as the unfused run with the same accumulation, bit for bit
in fp32 (``--max_grad_norm 0``: the fused path clips each tensor on its own); the full fine-tuning scripts refuse the
fused backward pass (its step of the model's own weights does not yet equal the unfused one)."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

import train_network
from tests.e2e.test_fine_tune import images


def test_lora_with_fused_backward_and_accumulation_equals_the_unfused_run(tmp_path):
    args = ["--pretrained_model_name_or_path", "builtin:tiny-sd15", "--train_data_dir", str(images(tmp_path / "d")),
            "--caption_extension", ".txt", "--network_module", "networks.lora", "--network_dim", "4",
            "--resolution", "64", "--output_name", "lora", "--learning_rate", "1e-3", "--seed", "3",
            "--max_data_loader_n_workers", "0", "--optimizer_type", "StochasticAdamW", "--train_batch_size", "1",
            "--gradient_accumulation_steps", "2", "--max_grad_norm", "0", "--max_train_steps", "2"]
    for name, extra in (("fused", ["--fused_backward_pass"]), ("unfused", [])):
        assert train_network.main([*args, "--output_dir", str(tmp_path / name), *extra]) == 0
    fused, unfused = (load_file(tmp_path / name / "lora.safetensors") for name in ("fused", "unfused"))
    assert fused.keys() == unfused.keys()
    assert [key for key in fused if not torch.equal(fused[key], unfused[key])] == []
    assert any(not torch.equal(value, torch.zeros_like(value)) for key, value in fused.items() if "lora_up" in key)


def test_full_fine_tuning_refuses_the_fused_backward_pass(tmp_path, capsys):
    args = ["--pretrained_model_name_or_path", "builtin:tiny-sd15", "--train_data_dir", str(images(tmp_path / "d")),
            "--output_dir", str(tmp_path / "out"), "--fused_backward_pass"]
    assert train_network.main(args, family="sd", script="fine_tune.py") == 2
    err = capsys.readouterr().err
    assert "--fused_backward_pass is not available for full fine-tuning" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()
