"""Anima (Cosmos-Predict2 DiT with an LLM adapter), as upstream sd-scripts 48d368fa ``library/anima_models.py``."""
