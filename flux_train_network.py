"""Train a LoRA for FLUX.1 dev / schnell with kohya sd-scripts' flags (``flux_train_network.py``).

    python flux_train_network.py --pretrained_model_name_or_path flux1-dev.safetensors --clip_l clip_l.safetensors \\
        --t5xxl t5xxl_fp16.safetensors --ae ae.safetensors --train_data_dir DATA --resolution 1024 \\
        --output_dir OUT --network_module networks.lora_flux [--fp8_base --blocks_to_swap N ...]

The same trainer as ``train_network.py`` with the FLUX.1 model family selected; the FLUX.1-only flags are in
``library/families/flux/config.py``; exit codes as there.
"""

from __future__ import annotations

import sys

from train_network import main

if __name__ == "__main__":
    sys.exit(main(family="flux"))
