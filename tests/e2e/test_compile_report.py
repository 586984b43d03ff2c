"""Seed 000's "Recommended Training Setup" block, all flags together, trains and says when it compiles.

One run checks both: the setup trains (its latents cached to disk, the LoRA moved) and it reports its compilation.
The compilation of the denoiser happens at its first call, inside the first step: a line before it names what is
compiled and warns that the first steps take longer, and a line after the first update gives that step's seconds
(README, "--torch_compile"). ``eager`` stands in for inductor, which needs about 7 CPU-minutes for the tiny UNet
(README): the first step then waits for dynamo's tracing of the UNet (with gradient checkpointing), which every
backend shares; ``aot_eager`` would add AOT autograd's tracing of the backward and double the test's time without
changing what it checks (the two lines around the first step).
``test_full_bf16.test_torch_compile_inductor_on_a_small_module`` covers inductor itself. The warmup of one step
(``constant_with_warmup``) leaves the first update at learning rate 0, so the second one is what moves the LoRA.
"""

from __future__ import annotations

import re
import shutil

from safetensors.torch import load_file

import train_network
from tests.e2e.test_train_network import SAMPLES, train_args


def test_the_seed_setup_trains_and_logs_its_compilation(tmp_path, caplog):
    data = tmp_path / "data"
    shutil.copytree(SAMPLES, data)
    args = train_args(tmp_path / "out", "--optimizer_type=SPARKLES", "--train_batch_size=14", "--max_grad_norm=1",
                      "--gradient_checkpointing", "--torch_compile", "--dynamo_backend=eager", "--no_half_vae",
                      "--sdpa", "--mixed_precision=bf16", "--full_bf16", "--cache_latents", "--cache_latents_to_disk",
                      "--max_train_steps", "2", "--lr_scheduler", "constant_with_warmup", "--lr_warmup_steps", "1",
                      data=data)
    assert train_network.main(args) == 0
    assert len(list((data / "10_shapes").glob("*_sd.npz"))) == 8
    ups = [v for k, v in load_file(tmp_path / "out" / "lora.safetensors").items() if k.endswith("lora_up.weight")]
    assert any(float(v.float().abs().max()) > 0 for v in ups)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("--torch_compile")]
    assert lines[0] == ("--torch_compile: compiling the UNet (--dynamo_backend eager) at its first call; the "
                        "first steps take longer")
    assert re.fullmatch(r"--torch_compile: the first step took \d+\.\d s, compiling the UNet included", lines[1])
    assert len(lines) == 2  # once per run, not per step
