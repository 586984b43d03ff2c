"""Stable Diffusion XL: loading, parts, single files, text encoding."""
