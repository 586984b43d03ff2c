"""Fine-tune a Stable Diffusion XL model with kohya sd-scripts' flags (``sdxl_train.py``): all weights of its U-Net,
and of its text encoders with ``--train_text_encoder``.

    python sdxl_train.py --pretrained_model_name_or_path SDXL_MODEL --train_data_dir DATA --resolution 1024 \\
        --output_dir OUT [--full_bf16 --optimizer_type StochasticAdamW --fused_backward_pass ...]

The trainer of ``train_network.py`` with the model's own weights trained instead of a LoRA (README, "Full
fine-tuning"); the checkpoint is written in upstream's formats (``--save_model_as``). Exit codes as there.
"""

from __future__ import annotations

import sys

from train_network import main

if __name__ == "__main__":
    sys.exit(main(family="sdxl", script="sdxl_train.py"))
