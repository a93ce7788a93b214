"""The process group a rank trains in, passed explicitly to everything that communicates.

`Comm` ties a torch.distributed group to the Topology it emulates or runs on
and checks that the two agree: strategy `single` runs one process (the topology
then only sizes the global batch), every other strategy one process per GPU.
"""

from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch.distributed as dist

from ray_zep.config import Strategy
from ray_zep.errors import CommError, TopologyError
from ray_zep.topology import Topology

if TYPE_CHECKING:
    from ray_zep.collectives.adaptive import RingZipper
    from ray_zep.routing.comms import Channels


def num_ranks(strategy: Strategy, topology: Topology) -> int:
    """Processes a strategy runs on a topology: one for `single`, else one per GPU."""
    return 1 if strategy is Strategy.SINGLE else topology.world_size


@dataclass(frozen=True)
class Comm:
    """A rank's view of the job.

    Attributes:
        topology: the cluster layout (virtual or real).
        rank: this process's rank in `group`.
        world_size: processes in `group`.
        group: the process group, or None when the job is a single process.
        timeout_s: steady-state timeout of every collective.
        routing: the routing groups and relay thread (`parallel.routing`), or None.
    """

    topology: Topology
    rank: int
    world_size: int
    group: dist.ProcessGroup | None
    timeout_s: float
    routing: Channels | None = None
    ring_zip: RingZipper | None = None
    """Per-message compression of ring K/V and dK/dV transfers (`comm.compression`)."""

    @classmethod
    def create(
        cls,
        topology: Topology,
        strategy: Strategy,
        timeout_s: float,
        group: dist.ProcessGroup | None = None,
    ) -> Comm:
        """Bind the processes of the default (or the given) group to the topology.

        With the default group, the Comm's group is a new one over all its ranks whose
        blocking collectives time out after `timeout_s`.

        Raises:
            TopologyError: the number of processes does not match what the
                strategy needs on this topology.
        """
        default = group is None and dist.is_available() and dist.is_initialized()
        if default:
            group = dist.group.WORLD
        world = dist.get_world_size(group) if group is not None else 1
        rank = dist.get_rank(group) if group is not None else 0
        expected = num_ranks(strategy, topology)
        if world != expected:
            raise TopologyError(
                f"parallel.strategy={strategy.value} needs {expected} process(es) "
                f"(topology.nodes={topology.nodes} x topology.gpus_per_node="
                f"{topology.gpus_per_node} = {topology.world_size} GPUs), but {world} are "
                "running; fix the topology or ray.num_workers"
            )
        if default and world > 1:
            # The default group keeps the rendezvous timeout (comm.init_timeout_s); every
            # later collective, blocking ones and checkpoint I/O included, gets timeout_s.
            group = dist.new_group(timeout=datetime.timedelta(seconds=timeout_s))
        return cls(topology, rank, world, group if world > 1 else None, timeout_s)

    @property
    def distributed(self) -> bool:
        return self.group is not None

    @property
    def timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.timeout_s)

    def wait(self, works: list, what: str) -> None:
        """Wait on every work handle within the timeout (see `wait_all`)."""
        wait_all(works, what, self.timeout_s, self.rank)

    def with_routing(self) -> Comm:
        """This Comm plus the routing groups and relay thread (collective: call on every rank)."""
        if self.group is None or self.routing is not None:
            return self
        from ray_zep.routing.comms import open_channels

        return dataclasses.replace(self, routing=open_channels(self.group, self.timeout_s))


def wait_all(works: list, what: str, timeout_s: float, rank: int) -> None:
    """Wait on every work handle within `timeout_s` seconds each.

    Raises:
        CommError: a handle failed (a lost peer) or timed out; names `what`
            and the config key that sets the limit.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        for work in works:
            work.wait(timeout=timeout)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CommError(
            f"{what} on rank {rank} failed or exceeded comm.timeout_s={timeout_s:g}: {first}"
        ) from None


def init_process_group(
    backend: str,
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    init_timeout_s: float,
    timeout_s: float,
) -> None:
    """Create the default process group outside Ray (tests, torchrun-style launches).

    Rendezvous waits at most `init_timeout_s`; afterwards every collective of the
    group times out after `timeout_s`.
    """
    dist.init_process_group(
        backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=max(init_timeout_s, timeout_s)),
    )
