"""Per-rank training step, optimizer, checkpoints and loop."""
