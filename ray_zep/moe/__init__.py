"""Mixture-of-Experts: gating, expert parallelism, and the FoldMoE attention-MoE pipeline."""
