"""Train a LoRA for Anima with kohya sd-scripts' flags (``anima_train_network.py``).

    python anima_train_network.py --pretrained_model_name_or_path anima-preview.safetensors \\
        --qwen3 qwen_3_06b_base.safetensors --vae qwen_image_vae.safetensors --train_data_dir DATA \\
        --resolution 1024 --output_dir OUT --network_module networks.lora_anima [--cache_text_encoder_outputs ...]

The same trainer as ``train_network.py`` with the Anima model family selected; the Anima-only flags are in
``library/families/anima/config.py``; exit codes as there.
"""

from __future__ import annotations

import sys

from train_network import main

if __name__ == "__main__":
    sys.exit(main(family="anima"))
