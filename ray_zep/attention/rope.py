"""Rotary position embeddings: per-token angles from position ids (which restart at
every document), applied to consecutive channel pairs of every query and key head.

Shape legend: T tokens, H heads, E head dim.
"""

from __future__ import annotations

import torch


def rope_tables(
    positions_T: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (T, E/2) for the given positions, in float32."""
    inv_freq = 1.0 / (
        theta
        ** (torch.arange(0, head_dim, 2, device=positions_T.device, dtype=torch.float32) / head_dim)
    )
    angles = positions_T.float().unsqueeze(1) * inv_freq.unsqueeze(0)
    return torch.cos(angles), torch.sin(angles)


def apply_rope(x_THE: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs (x[2i], x[2i+1]) by the position's angle."""
    x = x_THE.float().unflatten(-1, (-1, 2))
    x0, x1 = x[..., 0], x[..., 1]
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    rotated = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1)
    return rotated.flatten(-2).type_as(x_THE)
