"""A process group together with the timeout of every wait on it."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from ray_zep.distributed.waiting import wait_all


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
