"""Each rank must run where the topology puts it: rank r on node r // G, GPU r % G.

NIC affinity, the intra-node rings and the node groups all assume it. Ray Train
numbers its workers itself; `gather_places` collects where each one really runs
(its Ray node and its local index there), and `check_placement` refuses a
placement that splits a topology node over machines or runs a node's ranks out
of the machine's GPU order. Several topology nodes on one machine (a virtual
topology) are fine.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch.distributed as dist

from ray_zep.distributed.comm import Comm
from ray_zep.errors import TopologyError
from ray_zep.topology import Topology

SHOWN_ID_CHARS = 12


@dataclass(frozen=True)
class WorkerPlace:
    """Where one rank runs: its machine (Ray node id) and its local index there."""

    machine: str
    local_index: int


def gather_places(comm: Comm, here: WorkerPlace) -> list[WorkerPlace]:
    """Every rank's place, in rank order (collective over the Comm's group)."""
    if comm.group is None:
        return [here]
    places: list[WorkerPlace | None] = [None] * comm.world_size
    dist.all_gather_object(places, here, group=comm.group)
    return places  # type: ignore[return-value]


def check_placement(places: list[WorkerPlace], topology: Topology) -> None:
    """Refuse a placement that does not match the topology.

    Raises:
        TopologyError: a topology node spans several machines, or the ranks on a
            machine do not follow its local indices in increasing order.
    """
    if len(places) == 1:
        return  # one process (the reference, or a one-GPU topology) sits where it is
    if len(places) != topology.world_size:
        raise TopologyError(
            f"{len(places)} ranks run, but the topology has {topology.world_size} GPUs"
        )
    for node in range(topology.nodes):
        ranks = topology.ranks_of_node(node)
        machines = sorted({places[r].machine for r in ranks})
        if len(machines) > 1:
            shown = ", ".join(m[:SHOWN_ID_CHARS] for m in machines)
            raise TopologyError(
                f"topology node {node} (ranks {ranks[0]}..{ranks[-1]}) spans "
                f"{len(machines)} machines ({shown}); Ray must place the "
                f"{topology.gpus_per_node} workers of a node on one machine: give each Ray "
                f"node the resources of topology.gpus_per_node={topology.gpus_per_node} workers"
            )
    for machine in dict.fromkeys(p.machine for p in places):
        ranks = [r for r, p in enumerate(places) if p.machine == machine]
        indices = [places[r].local_index for r in ranks]
        if any(b <= a for a, b in itertools.pairwise(indices)):
            raise TopologyError(
                f"ranks {ranks} on machine {machine[:SHOWN_ID_CHARS]} have local indices "
                f"{indices}; rank r must use its machine's GPUs in increasing order"
            )
