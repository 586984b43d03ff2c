"""Fine-tune an Anima DiT with kohya sd-scripts' flags (``anima_train.py``): all of its weights, the LLM adapter
included, with learning rates per component.

    python anima_train.py --pretrained_model_name_or_path anima-preview.safetensors \\
        --qwen3 qwen_3_06b_base.safetensors --vae qwen_image_vae.safetensors --train_data_dir DATA \\
        --resolution 1024 --output_dir OUT --mixed_precision bf16 [--full_bf16 --optimizer_type StochasticAdamW \\
        --fused_backward_pass] [--self_attn_lr 1e-5 --mod_lr 0 ...]

The trainer of ``train_network.py`` with the DiT's own weights trained instead of a LoRA (README, "Full
fine-tuning"); the DiT trains in fp32 unless --full_bf16 / --full_fp16, as upstream's; the checkpoint is one
.safetensors file with the DiT's 'net.' keys, as upstream writes it. Exit codes as there. Where it differs from
upstream's anima_train.py (the adapter's Qwen3 mask, the per-sample loss weights, --attn_mode's default, the logged
rates' names): library/families/anima/fine_tuning.py.
"""

from __future__ import annotations

import sys

from train_network import main

if __name__ == "__main__":
    sys.exit(main(family="anima", script="anima_train.py"))
