"""A process group together with the timeout of every wait on it."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from ray_zep.distributed.waiting import wait_all

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""torch's all-gather into one tensor: `all_gather_single` from torch 2.13 on, the same call
named `all_gather_into_tensor` before (a deprecated alias since)."""
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
"""torch's reduce-scatter of one tensor: `reduce_scatter_single` from torch 2.13 on,
`reduce_scatter_tensor` before."""


@dataclass(frozen=True)
class Group:
    """A process group and the timeout of every wait on it."""

    group: dist.ProcessGroup
    timeout_s: float

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    def wait(self, works: list, what: str) -> None:
        """Wait on every handle (None entries are skipped); CommError on failure or timeout."""
        wait_all([w for w in works if w is not None], what, self.timeout_s, self.rank)
