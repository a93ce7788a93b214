"""Bytes a training step moves, over intra-node links and out of each NIC.

Modelled from the plan (what the code sends, not a measurement): for every
layer, the ring K/V and dK/dV transfers of forward and backward (exact row
counts, routed or direct: `ray_zep.routing.routes`), the all-gather and Ulysses
exchanges (the backward mirrors the forward), and the remapping layer's
transfers (q/k/v in, output out, and their gradients back); plus the gradient
all-reduce once per step. Inter-node bytes are charged to the NIC of the rank
that sends them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ray_zep.costmodel import BYTES_PER_ELEMENT
from ray_zep.model_shapes import ModelShape
from ray_zep.parallel.shard_groups import replica_groups, shard_groups
from ray_zep.partition.plan import AttentionPlan
from ray_zep.partition.stats import collective_bytes
from ray_zep.remap.solver import RemapPlan
from ray_zep.routing.link_bytes import ring_link_bytes, ring_link_bytes_by_payload
from ray_zep.routing.routes import Payload
from ray_zep.topology import LinkKind, Topology

DKV_BYTES_PER_ELEMENT = 4
"""dK/dV accumulators travel in float32."""


@dataclass
class Traffic:
    """Bytes over intra-node links and leaving each NIC (nodes x NICs per node)."""

    intra_node: int
    nic: np.ndarray

    @classmethod
    def zero(cls, topology: Topology) -> Traffic:
        return cls(0, np.zeros((topology.nodes, topology.nics_per_node), dtype=np.int64))

    @property
    def inter_node(self) -> int:
        return int(self.nic.sum())

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(self.intra_node + other.intra_node, self.nic + other.nic)

    def times(self, k: int) -> Traffic:
        return Traffic(self.intra_node * k, self.nic * k)

    def charge(self, topology: Topology, src: int, dst: int, nbytes: int) -> None:
        """Add a message of `nbytes` from `src` to `dst`."""
        if topology.node_of(src) == topology.node_of(dst):
            self.intra_node += nbytes
        else:
            self.nic[topology.node_of(src), topology.nic_of(src)] += nbytes

    def to_dict(self) -> dict[str, object]:
        return {
            "intra_node": int(self.intra_node),
            "inter_node": self.inter_node,
            "nic": self.nic.tolist(),
        }


def kv_row_bytes(shape: ModelShape, element_bytes: int, payloads=tuple(Payload)):
    """Bytes of one row of a ring transfer of `payload` in an item of U Ulysses members
    (0 for payloads not in `payloads`)."""

    def row_bytes(payload: Payload, ulysses: int) -> int:
        if payload not in payloads:
            return 0
        heads = shape.n_kv_heads // ulysses if ulysses <= shape.n_kv_heads else 1
        size = element_bytes if payload is Payload.KV else DKV_BYTES_PER_ELEMENT
        return 2 * heads * shape.head_dim * size

    return row_bytes


def ring_traffic(
    plan: AttentionPlan,
    shape: ModelShape,
    routed: bool,
    element_bytes: int = BYTES_PER_ELEMENT,
    payloads=tuple(Payload),
) -> Traffic:
    """Ring K/V and dK/dV bytes of one layer, forward + backward."""
    intra, nic = ring_link_bytes(plan, routed, kv_row_bytes(shape, element_bytes, payloads))
    return Traffic(intra, nic)


def collective_traffic(
    plan: AttentionPlan, shape: ModelShape, element_bytes: int = BYTES_PER_ELEMENT
) -> Traffic:
    """All-gather and Ulysses bytes of one layer, forward + backward."""
    topo = plan.topology
    out = Traffic.zero(topo)
    if not any(i.ulysses > 1 or i.exchange_kind.collective for i in plan.items()):
        return out  # rings and local items only: nothing is gathered or exchanged
    gathered = collective_bytes(plan, shape)
    scale = 2 * element_bytes / BYTES_PER_ELEMENT  # forward and backward
    out.intra_node = int(gathered[LinkKind.INTRA_NODE].sum() * scale)
    sent = (np.asarray(gathered[LinkKind.INTER_NODE]) * scale).astype(np.int64)  # as int()
    ranks = np.flatnonzero(sent)
    gpus = topo.gpus_per_node
    nic_of_gpu = np.asarray(topo.gpu_to_nic, dtype=np.int64)
    np.add.at(out.nic, (ranks // gpus, nic_of_gpu[ranks % gpus]), sent[ranks])
    return out


def remap_traffic(
    remap: RemapPlan, topology: Topology, shape: ModelShape, element_bytes: int = BYTES_PER_ELEMENT
) -> Traffic:
    """Remapping bytes of one layer, forward + backward.

    A moved token's q/k/v ((H + 2K) E values) go to its attention rank and its
    output (H E) comes back; backward sends their gradients the other way, so
    each direction carries (2H + 2K) E values per moved token.
    """
    per_token = 2 * (shape.n_heads + shape.n_kv_heads) * shape.head_dim * element_bytes
    out = Traffic.zero(topology)
    for src, dst, tokens in remap.transfers:
        out.charge(topology, src, dst, tokens * per_token)
        out.charge(topology, dst, src, tokens * per_token)
    return out


def gradient_traffic(nbytes: int, topology: Topology, world: int) -> Traffic:
    """A ring all-reduce of `nbytes` per rank over `world` ranks (node-major): every
    rank sends 2 (N - 1) / N x nbytes to the next, each node's last GPU to the next
    node. This is the ring algorithm's volume; NCCL may pick a tree for some sizes,
    which moves the same order of bytes."""
    out = Traffic.zero(topology)
    if world <= 1:
        return out
    per_link = 2 * (world - 1) * nbytes // world
    for rank in range(world):
        out.charge(topology, rank, (rank + 1) % world, per_link)
    return out


def sharded_weights_traffic(
    gathered_bytes: int, grad_bytes: int, topology: Topology, group: int = 0,
    node_gathered: int = 0,
) -> Traffic:  # fmt: skip
    """Bytes of FSDP's collectives in one step, as ring algorithms move them.

    Args:
        gathered_bytes: unsharded parameter bytes all-gathered in the step (every
            block in forward, again in backward when it reshards).
        grad_bytes: unsharded gradient bytes reduce-scattered.
        topology: the cluster; ranks are node-major.
        group: ranks of one shard group (`ray_zep.parallel.shard_groups`: a node's GPUs
            for hsdp, `parallel.shard_nodes` nodes' for fsdp); each reduced shard is
            then all-reduced with its replicas in the other groups. 0: one group of
            every rank (fsdp).
        node_gathered: unsharded parameter bytes all-gathered inside each node from
            its GPUs' shards (the backward's gathers under `parallel.reshard_to_node`).
    """
    out = Traffic.zero(topology)
    world, gpus = topology.world_size, topology.gpus_per_node
    size = group if 0 < group < world else world
    per_link = (size - 1) * (gathered_bytes + grad_bytes) // size
    for members in shard_groups(size, world):
        _ring_charge(out, topology, list(members), per_link)
    if node_gathered:
        for n in range(topology.nodes):
            members = list(topology.ranks_of_node(n))
            _ring_charge(out, topology, members, (gpus - 1) * node_gathered // gpus)
    if size < world:
        shard, replicas = grad_bytes // size, world // size
        for members in replica_groups(size, world):
            _ring_charge(out, topology, list(members), 2 * (replicas - 1) * shard // replicas)
    return out


def _ring_charge(out: Traffic, topology: Topology, members: list[int], per_link: int) -> None:
    """Each member sends `per_link` bytes to the next member of the ring."""
    if len(members) <= 1:
        return
    for i, src in enumerate(members):
        out.charge(topology, src, members[(i + 1) % len(members)], per_link)


def attention_step_traffic(
    plan: AttentionPlan,
    shape: ModelShape,
    routed: bool,
    remap: RemapPlan | None,
    element_bytes: int = BYTES_PER_ELEMENT,
    dkv_owner: bool = False,
) -> Traffic:
    """Attention and remapping bytes of a whole step (every layer, forward + backward);
    `dkv_owner`: `parallel.dkv_wire=owner` (`ring_link_bytes_by_payload`)."""
    scaled, fixed = attention_step_parts(plan, shape, routed, remap, dkv_owner)
    return scaled.times(element_bytes) + fixed


def attention_step_parts(
    plan: AttentionPlan,
    shape: ModelShape,
    routed: bool,
    remap: RemapPlan | None,
    dkv_owner: bool = False,
) -> tuple[Traffic, Traffic]:
    """`attention_step_traffic` as (bytes per byte of compute dtype, float32 dK/dV bytes),
    for callers that learn the compute dtype later (the trainer)."""
    ring = ring_link_bytes_by_payload(plan, routed, kv_row_bytes(shape, 1), dkv_owner)
    layer = Traffic(*ring[Payload.KV]) + collective_traffic(plan, shape, 1)
    if remap is not None:
        layer = layer + remap_traffic(remap, plan.topology, shape, 1)
    fixed = Traffic(*ring[Payload.DKV])
    return layer.times(shape.n_layers), fixed.times(shape.n_layers)
