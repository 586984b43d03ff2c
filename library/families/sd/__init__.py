"""Stable Diffusion 1.x / 2.x: loading, parts, single files, text encoding."""
