"""sd-scripts-bf16: a kohya-compatible Stable Diffusion LoRA trainer with a full-bf16 path."""
