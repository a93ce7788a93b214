"""What the attention engine and the remapping layer communicate over."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from ray_zep.collectives.adaptive import RingZipper
from ray_zep.distributed import Comm
from ray_zep.routing.relay import Channels


@dataclass(frozen=True)
class Links:
    """The job's Comm plus the attention layer's optional transports.

    Attributes:
        comm: the job's group, topology and timeout; ranks are its ranks.
        routing: the routing layer's groups and relay thread (`parallel.routing`).
        ring_zip: per-message compression of ring K/V and dK/dV (`comm.compression`).
    """

    comm: Comm
    routing: Channels | None = None
    ring_zip: RingZipper | None = None

    @property
    def group(self) -> dist.ProcessGroup | None:
        return self.comm.group

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    @property
    def timeout_s(self) -> float:
        return self.comm.timeout_s

    def wait(self, works: list, what: str) -> None:
        """Wait on every handle within `comm.timeout_s`; CommError otherwise."""
        self.comm.wait(works, what)
