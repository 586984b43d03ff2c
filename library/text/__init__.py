"""Caption and prompt text: attention-weight syntax and token chunking."""
