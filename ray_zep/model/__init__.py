"""LLaMA-style decoder and model shapes."""
