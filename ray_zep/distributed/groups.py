"""Every process group and DeviceMesh of a run besides the world group, built once.

`build_groups` creates, in one fixed order that every rank follows, the groups
a run's axes ask for (`GroupNeeds`):

- node and rail groups (weight passing): the GPUs of one node, and the GPUs at
  one local index across nodes;
- the four routing groups of the routing layer (dispatch, relay, combine, direct);
- expert parallelism: blocks of `ep` consecutive ranks, and the ranks holding
  the same experts (one per block);
- FSDP2: the shard group (all ranks, or the GPUs of a node) and the replicate
  group (the rail, for `hsdp`), plus its own copy of the expert replicas.

Collectives of different streams never share a group: gloo and NCCL match the
operations of a group in the order ranks post them, and FSDP's prefetching
posts in an order that differs from the attention engine's sends. Groups of
one rank are not created, except as a dimension of FSDP's mesh. Every group gets the Comm's timeout.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from enum import Enum

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ray_zep.distributed.group import Group
from ray_zep.errors import CommError
from ray_zep.parallel.shard_groups import replica_groups, shard_groups
from ray_zep.topology import Topology


class MeshShape(Enum):
    """How FSDP's mesh covers the ranks."""

    FLAT = "flat"
    """One dimension over every rank (`fsdp`)."""
    NODE = "node"
    """(replicate across groups, shard inside a group of whole nodes): `hsdp` (a node)
    and `fsdp` over `parallel.shard_nodes` nodes (`GroupNeeds.fsdp_shard_nodes`)."""


@dataclass(frozen=True)
class GroupNeeds:
    """The groups a run needs besides the world group.

    Attributes:
        node_and_rail: the node and rail groups (grouped weight passing).
        fsdp: FSDP2's mesh shape, or None without FSDP.
        routing: the routing layer's four groups.
        ep: expert-parallel degree (1: no expert groups).
        fsdp_shard_nodes: nodes of one shard group of a `MeshShape.NODE` mesh (0: one).
    """

    node_and_rail: bool = False
    fsdp: MeshShape | None = None
    routing: bool = False
    ep: int = 1
    fsdp_shard_nodes: int = 0


@dataclass
class RankGroups:
    """This rank's groups (None where the run needs none or the group has one rank)."""

    needs: GroupNeeds = GroupNeeds()
    node: Group | None = None
    rail: Group | None = None
    routing: tuple[dist.ProcessGroup, ...] | None = None
    ep: Group | None = None
    ep_replicas: Group | None = None
    fsdp_shard: Group | None = None
    fsdp_replicate: Group | None = None
    fsdp_expert_replicas: Group | None = None
    world_ranks: tuple[int, ...] = ()
    """Global ranks of the Comm's ranks, in Comm rank order."""
    _meshes: dict = field(default_factory=dict, repr=False)

    def fsdp_mesh(self, device_type: str) -> DeviceMesh:
        """FSDP2's mesh over the shard (and, for `hsdp`, replicate) groups.

        Raises:
            CommError: the groups were built without `GroupNeeds.fsdp`.
        """
        key = ("shard_mesh", device_type)
        if key in self._meshes:
            return self._meshes[key]
        if self.fsdp_shard is None:
            raise CommError("FSDP needs its groups: build the Comm with a GroupNeeds mesh shape")
        if self.needs.fsdp is MeshShape.FLAT:
            mesh = DeviceMesh.from_group(
                self.fsdp_shard.group, device_type, mesh_dim_names=("shard",)
            )
        else:
            size = self.fsdp_shard.size  # a node's GPUs, or `fsdp_shard_nodes` nodes'
            layout = torch.tensor(self.world_ranks, dtype=torch.int).view(-1, size)
            mesh = DeviceMesh.from_group(
                [self.fsdp_replicate.group, self.fsdp_shard.group],
                device_type,
                mesh=layout,
                mesh_dim_names=("replicate", "shard"),
            )
        self._meshes[key] = mesh
        return mesh

    def expert_mesh(self, device_type: str) -> DeviceMesh | None:
        """The 1-D mesh of the ranks holding this rank's experts (None: no replicas)."""
        if self.fsdp_expert_replicas is None:
            return None
        key = ("experts", device_type)
        if key not in self._meshes:
            self._meshes[key] = DeviceMesh.from_group(
                self.fsdp_expert_replicas.group, device_type, mesh_dim_names=("expert_shard",)
            )
        return self._meshes[key]


def build_groups(
    topology: Topology, group: dist.ProcessGroup, timeout_s: float, needs: GroupNeeds
) -> RankGroups:
    """Create the groups `needs` asks for (collective: every rank calls it, same needs).

    Args:
        topology: the layout the ranks of `group` follow (rank r on node r // G).
        group: the Comm's world group; member ranks map to global ranks through it.
        timeout_s: the timeout of every collective on the new groups.
        needs: which groups to build.
    """
    ranks = dist.get_process_group_ranks(group)
    me = dist.get_rank(group)
    backend = dist.get_backend(group)
    timeout = datetime.timedelta(seconds=timeout_s)
    world, gpus = len(ranks), topology.gpus_per_node

    def mine(blocks: list[list[int]], singles: bool = False) -> Group | None:
        """New groups over every block (by Comm rank); this rank's one, if it has peers
        (or always, with `singles`)."""
        found = None
        for block in blocks:
            if len(block) < 2 and not singles:
                continue
            pg = dist.new_group([ranks[r] for r in block], timeout=timeout, backend=backend)
            if me in block:
                found = Group(pg, timeout_s)
        return found

    nodes = [list(range(n * gpus, (n + 1) * gpus)) for n in range(world // gpus)]
    rails = [list(range(i, world, gpus)) for i in range(gpus)]
    out = RankGroups(needs, world_ranks=tuple(ranks))
    if needs.node_and_rail:
        out.node, out.rail = mine(nodes), mine(rails)
    if needs.routing:
        out.routing = tuple(
            dist.new_group(ranks, timeout=timeout, backend=backend) for _ in range(4)
        )
    ep = needs.ep
    if ep > 1:
        if world % ep:
            raise CommError(f"parallel.ep={ep} does not divide the {world} ranks")
        out.ep = mine([list(range(first, first + ep)) for first in range(0, world, ep)])
        out.ep_replicas = mine([list(range(offset, world, ep)) for offset in range(ep)])
    if needs.fsdp is MeshShape.FLAT:
        out.fsdp_shard = mine([list(range(world))])
    elif needs.fsdp is MeshShape.NODE:
        size = max(needs.fsdp_shard_nodes, 1) * gpus
        if world % size:
            raise CommError(
                f"parallel.shard_nodes={needs.fsdp_shard_nodes}: shard groups of {size} ranks "
                f"do not divide the {world} ranks"
            )
        # a mesh dimension needs a group even where it has one rank (hsdp on one node)
        out.fsdp_shard = mine(list(map(list, shard_groups(size, world))), singles=True)
        out.fsdp_replicate = mine(list(map(list, replica_groups(size, world))), singles=True)
    if needs.fsdp is not None and ep > 1:
        out.fsdp_expert_replicas = mine([list(range(o, world, ep)) for o in range(ep)])
    return out
