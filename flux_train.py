"""Fine-tune a FLUX.1 transformer with kohya sd-scripts' flags (``flux_train.py``): all of its weights.

    python flux_train.py --pretrained_model_name_or_path flux1-dev.safetensors --clip_l clip_l.safetensors \\
        --t5xxl t5xxl_fp16.safetensors --ae ae.safetensors --train_data_dir DATA --resolution 1024 \\
        --output_dir OUT --mixed_precision bf16 [--optimizer_type StochasticAdamW --fused_backward_pass ...]

The trainer of ``train_network.py`` with the transformer's own weights trained instead of a LoRA (README, "Full
fine-tuning"); the checkpoint is one .safetensors file in BFL's layout, as upstream writes it. Exit codes as there.
"""

from __future__ import annotations

import sys

from train_network import main

if __name__ == "__main__":
    sys.exit(main(family="flux", script="flux_train.py"))
