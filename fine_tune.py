"""Fine-tune a Stable Diffusion 1.x/2.x model with kohya sd-scripts' flags (``fine_tune.py``): all weights of its
U-Net, and of its text encoder with ``--train_text_encoder``.

    python fine_tune.py --pretrained_model_name_or_path MODEL --in_json META.json --train_data_dir IMAGES \\
        --resolution 512 --output_dir OUT [--full_bf16 --optimizer_type StochasticAdamW ...]

The trainer of ``train_network.py`` with the model's own weights trained instead of a LoRA (README, "Full
fine-tuning"); the checkpoint is written in upstream's formats (``--save_model_as``). Exit codes as there.
"""

from __future__ import annotations

import sys

from train_network import main

if __name__ == "__main__":
    sys.exit(main(family="sd", script="fine_tune.py"))
