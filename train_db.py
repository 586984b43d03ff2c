"""DreamBooth with kohya sd-scripts' flags (``train_db.py``): fine-tune a Stable Diffusion 1.x/2.x model's U-Net and
text encoder on folders of images (``<repeats>_<name>``), with regularization images (``--reg_data_dir``).

    python train_db.py --pretrained_model_name_or_path MODEL --train_data_dir DATA --reg_data_dir REG \\
        --resolution 512 --output_dir OUT [--full_bf16 --optimizer_type StochasticAdamW ...]

The trainer of ``train_network.py`` with the model's own weights trained instead of a LoRA (README, "Full
fine-tuning"); the checkpoint is written in upstream's formats (``--save_model_as``). Exit codes as there.
"""

from __future__ import annotations

import sys

from train_network import main

if __name__ == "__main__":
    sys.exit(main(family="sd", script="train_db.py"))
