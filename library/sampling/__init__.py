"""Sample images during training: prompt files, samplers, text conditioning and drawing."""
