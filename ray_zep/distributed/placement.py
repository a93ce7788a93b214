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

from ray_zep.errors import TopologyError
from ray_zep.topology import Topology

SHOWN_ID_CHARS = 12


@dataclass(frozen=True)
class WorkerPlace:
    """Where one rank runs: its machine (Ray node id) and its local index there."""

    machine: str
    local_index: int


def gather_places(here: WorkerPlace, group: dist.ProcessGroup | None = None) -> list[WorkerPlace]:
    """Every rank's place, in rank order (collective over `group`, by default the default
    group; one process without a process group: its own place)."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return [here]
    places: list[WorkerPlace | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(places, here, group=group)
    return places  # type: ignore[return-value]


def whole_node_ranks(places: list[WorkerPlace], gpus_per_node: int, most_nodes: int) -> list[int]:
    """The ranks that form whole topology nodes, at most `most_nodes` of them: on each
    machine (in rank order) its first ranks, a multiple of `gpus_per_node` of them. The
    ranks left over (a machine holding part of a node's workers) take no part.

    An elastic worker group holds as many workers as Ray had room for, which need not
    fill whole nodes; `check_placement` then checks the chosen ranks.
    """
    by_machine: dict[str, list[int]] = {}
    for rank, place in enumerate(places):
        by_machine.setdefault(place.machine, []).append(rank)
    chosen: list[int] = []
    for ranks in by_machine.values():
        whole = len(ranks) - len(ranks) % gpus_per_node
        chosen += ranks[:whole]
    return sorted(chosen)[: most_nodes * gpus_per_node]


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
