"""The primitives a simulated layer's graph is built of (`ray_zep.sim.program` builds the
engine's program from them): what one simulated layer needs (`LayerSetup`), and a
builder that adds computes, messages and collectives rank by rank.

A rank's host thread is a chain of join points (`GraphBuilder.wait`). A message moves on
the sender's and the receiver's side of its link (an intra-node port, or the NIC of
each end's node). A routed ring transfer (`GraphBuilder.ring_transfer`) is dispatched
to the send proxies, crosses nodes piece by piece, each proxy through its own NIC, and
is combined at the destination; relay threads forward as soon as data arrives, without
using the compute stream. All-gathers and reduce-scatters (llama_cp's K/V, FSDP2's
weights) move on every member's links for the bytes part of the collective's modelled
time (`CostModel.all_gather_seconds`), each link on its own; its ring steps' latency
comes first and holds no link (a pipelined ring's links carry its data at the bus
bandwidth for bytes / bandwidth only; the handshakes of its W - 1 steps leave them to
other traffic). Messages and collectives share the links they meet on
(`ray_zep.sim.link_sharing`): a K/V message posted while FSDP2 gathers a block moves
beside the gather, each at its share of the link.

With `comm.compression` (`ray_zep.sim.wire.WireCodec`), a message goes zipped where its
stream does (the ring K/V and dK/dV as `kv`; `routed_kv` through proxies: compressed at
the source, decompressed at the destination, smaller on every hop), the codec's time
inside the message's task. A ring message in flight while its ranks compute costs the
latency of that compute where a CPU calibration measured it
(`CostModel.ring_message_seconds`). With `record`, the builder notes how each message's
and weight collective's time depends on the wire, so that a layer built once can be
timed again for other wires (`ray_zep.sim.program.layer_graphs`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from ray_zep.collectives.switcher import Kind, Profile
from ray_zep.costmodel import ComputeRates, CostModel
from ray_zep.model_shapes import ModelShape
from ray_zep.options import ActivationCheckpointing, CompressionStream
from ray_zep.partition.plan import AttentionPlan
from ray_zep.remap.solver import RemapPlan
from ray_zep.routing.routes import Payload, Phase, RoutingPlan, Transfer
from ray_zep.sim.events import Lane, TaskGraph
from ray_zep.sim.wire import PLAIN, Stream, WireCodec
from ray_zep.topology import LinkKind

FP32_BYTES = 4
"""Bytes of a float32 value: dK/dV accumulators and dQ, and the Ulysses gradient returns
where members share K/V heads (`ray_zep.attention.ulysses.ulysses_gradient_dtype`)."""
RING_STEP = "attention step"
"""A ring step's compute task's name, before its step index (`ray_zep.sim.gpu_time`)."""


@dataclass(frozen=True)
class LayerSetup:
    """What one simulated layer needs.

    Attributes:
        plan: the batch's attention plan.
        shape: the model.
        cost: links and latencies of the plan's topology.
        rates: compute rates of one GPU.
        routing: every ring transfer of the layer (`RoutingPlan.build(plan,
            routed, all_hops=True)`).
        remap: the remap plan, or None when linear modules run on the attention layout.
        element_bytes: bytes of an activation element (2 for bf16).
        dkv_bytes: bytes of a dK/dV element on the wire (our engine accumulates
            and sends them in float32).
        weight_sync: seconds of the layer's weight collectives, (forward,
            backward): FSDP2 gathers the next block while this one computes (and
            in backward also reduce-scatters the previous block's gradients); 0: none.
        weight_groups: the rank groups those collectives run over (each holds its
            members' links for the collective's time but its latency).
        weight_latency: the ring steps' latency in `weight_sync`, (forward, backward).
        gathered_ahead: the blocks are gathered two or more ahead
            (`parallel.prefetch_depth`, `WeightsCost.gathered_ahead`). The layer does
            not wait for the gather it posts (the forward's collective, the backward's
            gather part), which is for a later block (`TaskGraph.ahead`), but for the
            one posted a layer earlier where that runs past its own layer's end: from
            this layer's start, what is left of its ring steps' latency, then its bytes
            on each link (`TaskGraph.spill`, lasting what `ray_zep.sim.step` plays as
            the layer repeats). The backward's reduce-scatter is posted at the layer's
            start and waited for at its end, as one block ahead; otherwise the latency
            runs from the post.
        regathers: the backward gathers each block again over the forward's groups
            (`reshard_after_forward`, not `reshard_to_node`): `weight_sync`'s backward
            holds a gather of `weight_sync`'s forward seconds (one over the node, under
            `reshard_to_node`, is in the backward's collective, joined in its layer).
        codec: ZipCCL on the wire (`comm.compression`); the default sends all plain.
        weight_groups_backward: the backward's groups where they differ (hsdp across
            nodes: its all-reduce between the nodes' replicas crosses every NIC); empty:
            `weight_groups`.
        dkv_owner: `parallel.dkv_wire=owner`: items whose `QueueItem.owner_dkv` holds send
            each step's dK/dV to their owners in `element_bytes` (`routing` lists them).
        gather_after_attention: the forward's weight collective starts once the rank's
            attention is done (`parallel.prefetch_after_attention`), not when the layer
            starts: the ring's K/V meet no gather on the links.
        recompute: the backward of a block under this activation checkpointing mode,
            which computes parts of its forward again on each rank
            (`ray_zep.sim.layer_work`; none and full: nothing inside the layer).
        ulysses_chunks: USP items exchange heads in this many pieces beside the
            projections (`parallel.ulysses_chunks`, `ray_zep.sim.ulysses_play`); 1: whole.
    """

    plan: AttentionPlan
    shape: ModelShape
    cost: CostModel
    rates: ComputeRates
    routing: RoutingPlan
    remap: RemapPlan | None = None
    element_bytes: int = 2
    dkv_bytes: int = 4
    weight_sync: tuple[float, float] = (0.0, 0.0)
    weight_groups: tuple[tuple[int, ...], ...] = ()
    weight_latency: tuple[float, float] = (0.0, 0.0)
    codec: WireCodec = PLAIN
    gathered_ahead: bool = False
    regathers: bool = True
    weight_groups_backward: tuple[tuple[int, ...], ...] = ()
    dkv_owner: bool = False
    gather_after_attention: bool = False
    recompute: ActivationCheckpointing = ActivationCheckpointing.NONE
    ulysses_chunks: int = 1

    def linear_tokens(self) -> list[int]:
        """Tokens each rank's linear modules process."""
        if self.remap is not None:
            return list(self.remap.counts_after)
        return [int(n) for n in self.plan.rank_tokens()]


class GraphBuilder:
    """Adds tasks for one rank after another to a layer's graph, keeping each rank's host
    point: computes, messages, collectives and the layer's weight collectives."""

    def __init__(self, setup: LayerSetup, phase: Phase, record: bool = False) -> None:
        self.setup, self.phase = setup, phase
        self.graph = TaskGraph()
        # with `record`, how each task's duration depends on the wire, for `_retime`
        self.record = record
        self.recipes: list[tuple] = []
        self.point: list[int | None] = [None] * setup.plan.world
        self.topology = topo = setup.plan.topology
        # per rank, its node and NIC: looked up for every message
        self.node = [topo.node_of(r) for r in range(topo.world_size)]
        self.nic = [topo.nic_of(r) for r in range(topo.world_size)]
        self.profiles: dict[tuple, Profile] = {}
        self.step_costs: dict[tuple, np.ndarray] = {}
        self.sync_tasks: dict[int, int] = {}
        self.spilled: dict[int, int] = {}  # the gather run on into the layer, per rank
        transfers = setup.routing.forward if phase is Phase.FORWARD else setup.routing.backward
        self.transfers: dict[tuple, list[Transfer]] = defaultdict(list)
        for t in transfers:
            self.transfers[t.order].append(t)

    # primitives

    def compute(self, rank: int, seconds: float, name: str, alone: float | None = None) -> int:
        """A compute task of `seconds` on `rank`; `alone`: its seconds with no
        communication kernel beside it, the rest recorded as contention
        (`TaskGraph.slowed`)."""
        task = self.graph.add(
            name, rank, Lane.COMPUTE, seconds, (("compute", rank),), [self.point[rank]]
        )
        if alone is not None and seconds > alone:
            self.graph.slowed[task] = seconds - alone
        return task

    def send(
        self,
        src: int,
        dst: int,
        nbytes: float,
        deps,
        name: str,
        stream: Stream | None = None,
        compute_s: float | None = None,
    ) -> int:
        """A message on the link between two ranks (FIFO on the sender's and receiver's
        side), zipped where `stream` goes zipped (`WireCodec`); a ring message in flight
        while its ranks compute `compute_s` at that compute's latency
        (`CostModel.ring_message_seconds`)."""
        node = self.node
        if node[src] == node[dst]:
            kind, lane = LinkKind.INTRA_NODE, Lane.INTRA_NODE
            resources = (("port_out", src), ("port_in", dst))
        else:
            kind, lane = LinkKind.INTER_NODE, Lane.INTER_NODE
            resources = (
                ("nic_out", node[src], self.nic[src]),
                ("nic_in", node[dst], self.nic[dst]),
            )
        cost = self.setup.cost
        if compute_s is None:
            plain = cost.transfer_seconds(nbytes, kind, one_sender_per_nic=True)
        else:
            plain = cost.ring_message_seconds(nbytes, kind, compute_s)
        # a message of a batch (an all-to-all's; not a ring hop, posted on its own) pays
        # its latency beside the batch's others, holding no link (`ray_zep.sim.events`)
        latency = cost.link_latency(kind) if compute_s is None and nbytes > 0 else 0.0
        return self._wire_task(src, lane, resources, plain, (kind, stream, nbytes), deps, name,
                               latency)  # fmt: skip

    def rank_exchange(
        self, rank: int, kind: LinkKind, nbytes: float, deps, name: str, stream: Stream
    ) -> int:
        """One rank's part of an all-to-all-v over links of `kind`: `nbytes` through its
        port (intra-node) or its NIC, and one latency that holds no link, zipped where
        `stream` goes."""
        if kind is LinkKind.INTRA_NODE:
            lane, resources = Lane.INTRA_NODE, (("port_out", rank), ("port_in", rank))
        else:
            node, nic = self.node[rank], self.nic[rank]
            lane, resources = Lane.INTER_NODE, (("nic_out", node, nic), ("nic_in", node, nic))
        cost = self.setup.cost
        plain = cost.transfer_seconds(nbytes, kind, one_sender_per_nic=True)
        return self._wire_task(rank, lane, resources, plain, (kind, stream, nbytes), deps, name,
                               cost.link_latency(kind))  # fmt: skip

    def _wire_task(self, rank: int, lane: Lane, resources, plain: float, wire, deps, name: str,
                   latency: float = 0.0):  # fmt: skip
        """A transfer task of `plain` seconds on `resources`, `latency` of them holding no
        link, zipped where its stream goes (`wire`: link kind, stream or None, bytes),
        recorded for `_retime`."""
        kind, stream, nbytes = wire
        seconds = plain
        if stream is not None and self.setup.codec.zips(stream.name):
            seconds = self.zipped(self.setup.codec, self.profiles, plain, kind, stream, nbytes)
        task = self.graph.add(name, rank, lane, seconds, resources, deps, latency)
        if self.record and stream is not None:
            self.recipes.append(("send", task, plain, kind, stream, nbytes))
        return task

    def zipped(self, codec: WireCodec, profiles: dict, plain: float, kind, stream, nbytes) -> float:
        """A message's seconds under `codec` (`profiles`: its link profiles, filled here)."""
        if stream is None or not codec.zips(stream.name):
            return plain
        key = (kind, stream.encodes, stream.decodes)
        if key not in profiles:
            profiles[key] = codec.link_profile(self.setup.cost, *key)
        return codec.seconds(plain, profiles[key], Kind.ALL_TO_ALL, stream, nbytes)

    def wait(self, rank: int, deps) -> None:
        self.point[rank] = self.graph.join(rank, [self.point[rank], *deps])

    def collective(self, ranks, seconds: float, name: str) -> int:
        """A ring collective over `ranks` on all their links (`post_collective`, its steps'
        latency holding none); every member waits for it."""
        latency = self.setup.cost.all_gather_seconds(0.0, ranks)
        task = self.post_collective(ranks, seconds, name, latency)
        for r in ranks:
            self.wait(r, [task])
        return task

    def post_collective(
        self,
        ranks,
        seconds: float,
        name: str,
        latency: float = 0.0,
        weights: str = "",
        after=(),
    ) -> int:
        """A collective over `ranks`, started once every member has posted it: `latency`
        of its `seconds` first, holding no link, then the rest on each of its links at
        once (every member's port, and every NIC of their nodes where they span several),
        each link's part a flow of its own that shares the link with the messages there
        (`ray_zep.sim.link_sharing`). Each part lasts alone the time its own bytes take
        on its link: the NICs, which set a collective across nodes' pace, all of it, a
        member's port its share of that pace (`_links`). Nobody waits for it yet.
        The join of its parts (`weights`: a part of the layer's weight collectives, "all",
        "gather" or "rest" (`post_weight_sync`), retimed for other wires by `_retime`;
        `after`: tasks before it on its stream)."""
        deps = [self.point[r] for r in ranks] + list(after)
        latency = min(latency, seconds)
        if latency > 0:
            deps = [self.graph.add(f"{name} latency", ranks[0], Lane.HOST, latency, (), deps)]
        last = []
        for rank, lane, resources, share in self._links(ranks):
            last.append(self.graph.add(name, rank, lane, (seconds - latency) * share,
                                       resources, deps))  # fmt: skip
            if self.record and weights:
                self.recipes.append(("sync", last[-1], share, weights))
        return self.graph.join(ranks[0], last)

    def _links(self, ranks) -> list[tuple[int, Lane, tuple, float]]:
        """(the rank it is drawn for, its lane, its resources, the share of the
        collective's time it is busy) of every link a collective over `ranks` uses. Inside
        a node a member's port is busy all of it. Across nodes the collective's pace is the
        node's NICs' (`CostModel.bus_bandwidth`): they are busy all of it, and a port,
        moving the same bytes at its own bandwidth, its share of that pace."""
        topo = self.topology
        nodes = {self.node[r]: r for r in reversed(ranks)}  # each node's first member
        across = len(nodes) > 1
        port = (
            min(1.0, topo.nics_per_node * topo.nic_bandwidth / topo.intra_node_bandwidth)
            if across
            else 1.0
        )
        links = [(r, Lane.INTRA_NODE, (("port_out", r), ("port_in", r)), port) for r in ranks]
        if across:
            nics = range(topo.nics_per_node)
            links += [(first, Lane.INTER_NODE, (("nic_out", node, nic), ("nic_in", node, nic)),
                       1.0) for node, first in nodes.items() for nic in nics]  # fmt: skip
        return links

    def post_weight_sync(self) -> dict[int, int]:
        """This layer's weight collectives, per rank the one it joins at the layer's end.
        Gathering two or more blocks ahead (`gathered_ahead`), the gather (the forward's
        whole collective, the backward's gather part) is for a later block: nobody here
        joins it (`TaskGraph.ahead`); the rest (the backward's reduce-scatter) is joined.
        Each follows the one before it on the process group's one NCCL stream: the
        gather posted a layer earlier, the reduce-scatter, the gather (FSDP2 runs its
        all-gathers and reduce-scatters on the mesh's shard group, torch
        `_fully_shard/_fsdp_param_group.py`, and `ProcessGroupNCCL` a group's collectives
        on one stream per device, `ProcessGroupNCCL.cpp`, `ncclStreams_`)."""
        phase = 0 if self.phase is Phase.FORWARD else 1
        seconds, latency = self.setup.weight_sync[phase], self.setup.weight_latency[phase]
        if seconds <= 0:
            return {}
        gather, gather_latency = self.ahead_gather()
        out = {}
        if seconds - gather > 0:
            kind = "rest" if gather else "all"
            for group in self._weight_groups():
                after = list(dict.fromkeys(self.spilled[r] for r in group)) if gather else []
                task = self.post_collective(list(group), seconds - gather,
                                            "weights gather/scatter", latency - gather_latency,
                                            kind, after)  # fmt: skip
                out.update(dict.fromkeys(group, task))
        if gather:
            first = len(self.graph.tasks)
            for group in self.setup.weight_groups:
                after = list(dict.fromkeys([self.spilled[group[0]], *(out.get(r) for r in group)]))
                self.post_collective(list(group), gather, "weights gather/scatter",
                                     gather_latency, "gather", after=after)  # fmt: skip
            self.graph.ahead = range(first, len(self.graph.tasks))
            joins: dict[tuple, int] = {}  # one per group pair, not per rank
            for rank, task in self.spilled.items():  # rings played on arrays start after both
                pair = (task, out.get(rank))
                if pair not in joins:
                    joins[pair] = self.graph.join(rank, pair)
                out[rank] = joins[pair]
        self.sync_tasks = out
        return out

    def ahead_gather(self) -> tuple[float, float]:
        """(seconds, latency) of the gather in this layer's weight collectives that is for
        a block two or more ahead (`gathered_ahead`: the forward's, and the backward's
        where it gathers again, `LayerSetup.regathers`); (0, 0): none."""
        setup = self.setup
        if not setup.gathered_ahead or setup.weight_sync[0] <= 0:
            return 0.0, 0.0
        if self.phase is Phase.BACKWARD and not setup.regathers:
            return 0.0, 0.0
        return setup.weight_sync[0], min(setup.weight_latency[0], setup.weight_sync[0])

    def post_weight_spill(self) -> None:
        """Gathering two or more blocks ahead, the gather posted a layer earlier where it
        runs past that layer's end: from this layer's start, what is left of its latency,
        then its bytes on each of its links, lasting that overrun (`TaskGraph.with_spill`;
        0 as built); `spilled`: per rank the part it joins at the layer's end.

        Each link's part shares the link with the messages posted while it runs
        (`ray_zep.sim.link_sharing`)."""
        gather, latency = self.ahead_gather()
        if not gather:
            return
        graph = self.graph
        graph.spill_bytes = gather - latency
        graph.spill_wait = graph.add("weights gather latency, earlier", 0, Lane.HOST, 0.0)
        for group in self.setup.weight_groups:
            parts = []
            for rank, lane, resources, share in self._links(list(group)):
                parts.append(graph.add("weights gather, earlier", rank, lane, 0.0, resources,
                                       [graph.spill_wait]))  # fmt: skip
                graph.spill.append((parts[-1], share))
            self.spilled.update(dict.fromkeys(group, graph.join(group[0], parts)))
        self.sync_tasks = dict(self.spilled)

    def _weight_groups(self) -> tuple[tuple[int, ...], ...]:
        if self.phase is Phase.BACKWARD and self.setup.weight_groups_backward:
            return self.setup.weight_groups_backward
        return self.setup.weight_groups

    def ring_transfer(
        self, t: Transfer, row_bytes: int, src_dep, dst_dep, compute_s: float
    ) -> tuple[list, list]:
        """Tasks of one ring transfer in flight while its ends compute `compute_s`: (the
        sender's messages, the receiver's messages).

        A routed transfer's rows are compressed by the message that leaves the source and
        decompressed by the one that reaches the destination; proxies pass them on as
        they came. Each hop goes zipped where that pays for it (the trainer's source
        decides for the whole way; `always` zips every hop, as it does)."""
        route = t.route
        kv = t.payload is Payload.KV
        name = "K/V" if kv else "dK/dV"
        value_bytes = self.setup.element_bytes if kv else self.setup.dkv_bytes
        if route.direct:
            stream = Stream(CompressionStream.KV.value, value_bytes, not kv)
            deps = [src_dep, dst_dep]
            rows = route.rows * row_bytes
            task = self.send(route.src, route.dst, rows, deps, name, stream, compute_s)
            return [task], [task]
        routed = Stream(CompressionStream.ROUTED_KV.value, value_bytes, not kv)
        src_msgs, dst_msgs = [], []
        holds = {}
        for proxy, (a, b) in zip(route.send_proxies, route.send_ranges, strict=True):
            holds[proxy] = src_dep
            if proxy != route.src and b > a:
                stream = routed._replace(decodes=False)
                holds[proxy] = self.send(
                    route.src,
                    proxy,
                    (b - a) * row_bytes,
                    [src_dep],
                    f"{name} dispatch",
                    stream,
                    compute_s,
                )
                src_msgs.append(holds[proxy])
        collected = defaultdict(list)
        for piece in route.pieces():
            deps = [holds[piece.sender]] + ([dst_dep] if piece.receiver == route.dst else [])
            task = self.send(
                piece.sender,
                piece.receiver,
                (piece.hi - piece.lo) * row_bytes,
                deps,
                f"{name} piece",
                routed._replace(
                    encodes=piece.sender == route.src, decodes=piece.receiver == route.dst
                ),
                compute_s,
            )
            collected[piece.receiver].append(task)
            if piece.sender == route.src:
                src_msgs.append(task)
            if piece.receiver == route.dst:
                dst_msgs.append(task)
        for proxy, (a, b) in zip(route.recv_proxies, route.recv_ranges, strict=True):
            if proxy != route.dst and b > a:
                deps = [*collected[proxy], dst_dep]
                stream = routed._replace(encodes=False)
                combine = self.send(
                    proxy,
                    route.dst,
                    (b - a) * row_bytes,
                    deps,
                    f"{name} combine",
                    stream,
                    compute_s,
                )
                dst_msgs.append(combine)
        return src_msgs, dst_msgs


def moving_seconds(rank: int, messages, tasks, duration, grouped: bool) -> float:
    """Seconds `rank`'s `messages` (task indices, `duration` of each) slow the compute
    beside them: where a step's exchange is one grouped kernel
    (`ComputeRates.grouped_exchange`), the longer of what it sends and what it receives,
    each direction's messages one after another; else every message's time."""
    if not grouped:
        return sum(duration(t) for t in messages)
    sends = sum(duration(t) for t in messages if tasks[t].rank == rank)
    receives = sum(duration(t) for t in messages if tasks[t].rank != rank)
    return max(sends, receives)
