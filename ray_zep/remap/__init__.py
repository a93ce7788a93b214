"""Remapping layer: attention layout <-> token-balanced linear layout (ortools solver)."""
