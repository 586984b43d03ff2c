"""What a run writes and reads back: LoRA files and ss_* metadata, training states, resume checks."""
