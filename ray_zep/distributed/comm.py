"""The process group a rank trains in, passed explicitly to everything that communicates.

`Comm` ties a torch.distributed group to the Topology it emulates or runs on,
checks that the two agree, and holds the run's other groups (`with_groups`).
"""

from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass, field

import torch.distributed as dist

from ray_zep.distributed.group import Group
from ray_zep.distributed.groups import GroupNeeds, RankGroups, build_groups
from ray_zep.distributed.waiting import wait_all
from ray_zep.errors import CommError, TopologyError
from ray_zep.topology import Topology


@dataclass(frozen=True)
class Comm:
    """A rank's view of the job.

    Attributes:
        topology: the cluster layout (virtual or real).
        rank: this process's rank in `group`.
        world_size: processes in `group`.
        group: the process group, or None when the job is a single process.
        timeout_s: steady-state timeout of every collective.
        groups: the run's other groups (`with_groups`); empty until asked for.
    """

    topology: Topology
    rank: int
    world_size: int
    group: dist.ProcessGroup | None
    timeout_s: float
    groups: RankGroups = field(default_factory=RankGroups)

    @classmethod
    def create(
        cls,
        topology: Topology,
        processes: int,
        timeout_s: float,
        group: dist.ProcessGroup | None = None,
        why: str = "this run",
    ) -> Comm:
        """Bind the processes of the default (or the given) group to the topology.

        With the default group, the Comm's group is a new one over all its ranks whose
        blocking collectives time out after `timeout_s`.

        Args:
            processes: how many processes the run needs (1 for the reference, else
                one per GPU of the topology).
            why: what needs them, for the error message (a config key and value).

        Raises:
            TopologyError: the number of running processes is not `processes`.
        """
        default = group is None and dist.is_available() and dist.is_initialized()
        if default:
            group = dist.group.WORLD
        world = dist.get_world_size(group) if group is not None else 1
        rank = dist.get_rank(group) if group is not None else 0
        if world != processes:
            raise TopologyError(
                f"{why} needs {processes} process(es) (topology.nodes={topology.nodes} x "
                f"topology.gpus_per_node={topology.gpus_per_node} = {topology.world_size} "
                f"GPUs), but {world} are running; fix the topology or ray.num_workers"
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

    @property
    def world(self) -> Group:
        """The Comm's group with its timeout.

        Raises:
            CommError: the job is a single process.
        """
        if self.group is None:
            raise CommError("a single-process job has no world group")
        return Group(self.group, self.timeout_s)

    def wait(self, works: list, what: str) -> None:
        """Wait on every work handle within the timeout (see `wait_all`)."""
        wait_all(works, what, self.timeout_s, self.rank)

    def with_groups(self, needs: GroupNeeds) -> Comm:
        """This Comm plus the groups `needs` asks for (collective: call on every rank).

        A single-process Comm, or one whose groups already answer `needs`, is returned
        as it is.
        """
        if self.group is None or self.groups.needs == needs:
            return self
        groups = build_groups(self.topology, self.group, self.timeout_s, needs)
        return dataclasses.replace(self, groups=groups)
