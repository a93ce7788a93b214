"""Segment metadata of a packed variable-length batch.

A packed batch concatenates S sequences into T tokens; sequence i occupies
[cu_seqlens[i], cu_seqlens[i+1]). The metadata is built once per batch on the
host and shared by every layer, so no layer loops over documents calling
`.item()` on device tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ray_zep.errors import PlacementError


@dataclass(frozen=True)
class PackedSeqs:
    """Sequence boundaries of a packed batch.

    Attributes:
        lengths: host copy of every sequence length, all >= 1.
        offsets: host copy of the start of every sequence (S entries).
        cu_seqlens: int32 tensor of S + 1 cumulative lengths, on the compute device.
        max_seqlen: the longest sequence.
    """

    lengths: tuple[int, ...]
    offsets: tuple[int, ...]
    cu_seqlens: torch.Tensor
    max_seqlen: int

    @classmethod
    def from_lengths(
        cls, lengths: Sequence[int] | np.ndarray, device: torch.device | str = "cpu"
    ) -> PackedSeqs:
        """Build the metadata of sequences with the given lengths.

        Raises:
            PlacementError: a length is zero or negative (zero-length segments
                break varlen kernels and are never produced by the planners).
        """
        host = [int(n) for n in lengths]
        if any(n < 1 for n in host):
            raise PlacementError(f"packed sequence lengths must be >= 1, got {host}")
        cu = np.zeros(len(host) + 1, dtype=np.int64)
        np.cumsum(host, out=cu[1:])
        return cls(
            lengths=tuple(host),
            offsets=tuple(int(x) for x in cu[:-1]),
            cu_seqlens=torch.as_tensor(cu, dtype=torch.int32, device=device),
            max_seqlen=max(host, default=0),
        )

    @property
    def total_tokens(self) -> int:
        return sum(self.lengths)

    @property
    def num_seqs(self) -> int:
        return len(self.lengths)

    def positions(self) -> np.ndarray:
        """Position of every token inside its own sequence (restarts at 0)."""
        return positions_from_lengths(np.asarray(self.lengths, dtype=np.int64))


def positions_from_lengths(lengths: np.ndarray) -> np.ndarray:
    """int64 positions that restart at 0 at every sequence start."""
    total = int(lengths.sum())
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.arange(total, dtype=np.int64) - starts
