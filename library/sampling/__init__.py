"""Sample images during training: prompt files, samplers and drawing (the text conditioning is the family's)."""
