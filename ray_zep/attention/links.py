"""What the attention engine and the remapping layer communicate over."""

from __future__ import annotations

from dataclasses import dataclass

import torch
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
        dkv_as_kv: ring dK/dV accumulators travel in the K/V dtype, not float32
            (`parallel.dkv_wire=compute`).
        dkv_to_owner: each ring step's dK/dV goes straight to its owner where the item
            allows it (`parallel.dkv_wire=owner`, `QueueItem.owner_dkv`).
    """

    comm: Comm
    routing: Channels | None = None
    ring_zip: RingZipper | None = None
    dkv_as_kv: bool = False
    dkv_to_owner: bool = False

    def close(self) -> None:
        """Stop the routing layer's threads, if any (the run is over)."""
        if self.routing is not None:
            self.routing.close()

    def dkv_dtype(self, kv_dtype: torch.dtype) -> torch.dtype:
        """The dtype ring dK/dV accumulators travel in, for K/V of `kv_dtype`."""
        return kv_dtype if self.dkv_as_kv else torch.float32

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
