"""Train a LoRA for Stable Diffusion XL with kohya sd-scripts' flags (``sdxl_train_network.py``).

    python sdxl_train_network.py --pretrained_model_name_or_path SDXL_MODEL --train_data_dir DATA \\
        --resolution 1024 --output_dir OUT --network_module networks.lora [--cache_text_encoder_outputs ...]

The same trainer as ``train_network.py`` with the SDXL model family selected; exit codes as there.
"""

from __future__ import annotations

import sys

from train_network import main

if __name__ == "__main__":
    sys.exit(main(family="sdxl"))
