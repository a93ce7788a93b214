"""One transformer layer of a training step as a task graph, from the plan the engine runs.

Every rank follows the engine's program (`ray_zep.attention.engine`) with the
plan's queue items in the same order, the same ring steps
(`attention.schedule.step_segments`), the same transfers with the same routes
(`routing.routes.RoutingPlan`) and the remap plan's all-to-all-v:

forward:  QKV projections (linear layout) -> remap q/k/v to the attention layout
          -> queue items -> remap the output back -> output projection and MLP
backward: the same in reverse order of modules; queue items in forward order.

A rank's host thread is a chain of join points. At ring step s a rank posts
the transfer of step s (K/V for step s + 1), launches step s's compute, then
waits for both: a transfer starts once its sender and receiver have posted it.
Backward adds the dK/dV accumulator pass: it leaves after the step's compute and
after the previous accumulator has arrived (under `parallel.dkv_wire=owner` an item
inside a node or with Ulysses members sends each step's dK/dV straight to its owner
after the step's compute, in the activation dtype, `owner_backward`). A routed
transfer is dispatched to the send proxies, crosses nodes piece by piece, each proxy
through its own NIC, and is combined at the destination; relay threads forward as
soon as data arrives, without using the compute stream. An item's K/V exchange is built as
its kind plays it (`PLAYS`, one builder per `ray_zep.partition.exchange.Play`).
All-gathers and reduce-scatters (llama_cp's K/V, FSDP2's weights) hold every member's
links for the bytes part of the collective's modelled time
(`CostModel.all_gather_seconds`), each link on its own; its ring steps' latency comes
first and holds no link (a pipelined ring's links carry its data at the bus bandwidth
for bytes / bandwidth only; the handshakes of its W - 1 steps leave them to other
traffic). The remap's all-to-all-v
is played per rank and link kind (`_Builder.remap`). Ulysses exchanges are point-to-point
transfers between the members of a ring position.

With `comm.compression` (`ray_zep.sim.wire.WireCodec`), the ring K/V and dK/dV
(`kv`; `routed_kv` through proxies: compressed at the source, decompressed at the
destination, smaller on every hop), the Ulysses exchanges and the remap rows go
zipped where the mode zips them, the codec's time inside the message's task; the
compute a message overlaps is slowed by `ComputeRates.contention` as by any
communication kernel. A ring message in flight while its ranks compute costs the
latency of that compute where a CPU calibration measured it
(`CostModel.ring_message_seconds`). llama_cp's K/V all-gather and dK/dV reduce-scatter
stay plain, as in the engine. `layer_graphs` builds a layer once for several wires.

Elementwise work (norms, RoPE, softmax outside the kernel) and kernel launch
gaps of the linear modules are not modelled.

Shapes of sizes: H query heads, K key/value heads, E head dim.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ray_zep.attention.schedule import position_layout
from ray_zep.collectives.switcher import Kind, Profile
from ray_zep.costmodel import (
    BACKWARD_ATTENTION_FACTOR,
    BACKWARD_LINEAR_FACTOR,
    ComputeRates,
    CostModel,
    linear_flops_per_token,
    pointwise_elements_per_token,
)
from ray_zep.model_shapes import ModelShape
from ray_zep.options import CompressionStream
from ray_zep.parallel.axes import SEQUENCE_AXES
from ray_zep.partition.exchange import Play
from ray_zep.partition.plan import AttentionPlan, QueueItem
from ray_zep.remap.solver import RemapPlan
from ray_zep.routing.routes import Payload, Phase, RoutingPlan, Transfer, item_transfers
from ray_zep.sim.events import Lane, Task, TaskGraph
from ray_zep.sim.ring_form import array_ring, hop_seconds, ring_backward, ring_forward
from ray_zep.sim.step_costs import step_table
from ray_zep.sim.wire import PLAIN, Stream, WireCodec
from ray_zep.topology import LinkKind

FP32_BYTES = 4
"""dK/dV accumulators, dQ and the Ulysses gradient returns travel in float32."""


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
        codec: ZipCCL on the wire (`comm.compression`); the default sends all plain.
        weight_groups_backward: the backward's groups where they differ (hsdp across
            nodes: its all-reduce between the nodes' replicas crosses every NIC); empty:
            `weight_groups`.
        dkv_owner: `parallel.dkv_wire=owner`: items whose `QueueItem.owner_dkv` holds send
            each step's dK/dV to their owners in `element_bytes` (`routing` lists them).
        gather_after_attention: the forward's weight collective starts once the rank's
            attention is done (`parallel.prefetch_after_attention`), not when the layer
            starts: the ring's K/V meet no gather on the links.
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
    weight_groups_backward: tuple[tuple[int, ...], ...] = ()
    dkv_owner: bool = False
    gather_after_attention: bool = False

    def linear_tokens(self) -> list[int]:
        """Tokens each rank's linear modules process."""
        if self.remap is not None:
            return list(self.remap.counts_after)
        return [int(n) for n in self.plan.rank_tokens()]


class _Builder:
    """Adds one rank program after another to a graph, keeping each rank's host point."""

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
        transfers = setup.routing.forward if phase is Phase.FORWARD else setup.routing.backward
        self.transfers: dict[tuple, list[Transfer]] = defaultdict(list)
        for t in transfers:
            self.transfers[t.order].append(t)

    # primitives

    def compute(self, rank: int, seconds: float, name: str) -> int:
        return self.graph.add(
            name, rank, Lane.COMPUTE, seconds, (("compute", rank),), [self.point[rank]]
        )

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
        return self._wire_task(src, lane, resources, plain, (kind, stream, nbytes), deps, name)

    def _wire_task(self, rank: int, lane: Lane, resources, plain: float, wire, deps, name: str):
        """A transfer task of `plain` seconds on `resources`, zipped where its stream goes
        (`wire`: link kind, stream or None, bytes), recorded for `_retime`."""
        kind, stream, nbytes = wire
        seconds = plain
        if stream is not None and self.setup.codec.zips(stream.name):
            seconds = self.zipped(self.setup.codec, self.profiles, plain, kind, stream, nbytes)
        task = self.graph.add(name, rank, lane, seconds, resources, deps)
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
        self, ranks, seconds: float, name: str, latency: float = 0.0, weights: bool = False
    ) -> int:
        """A collective over `ranks`, started once every member has posted it: `latency`
        of its `seconds` first, holding no link, then the rest on each of its links at
        once (every member's port, and every NIC of their nodes where they span several),
        each link on its own: a link busy with another message delays only its own part.
        Each link is held for the time its own bytes take on it, as a message holds
        one: the NICs, which set a collective across nodes' pace, for all of it, a
        member's port for its share of that pace (`_port_share`). Nobody waits for it
        yet. The join of its parts (`weights`: the layer's weight collective, retimed
        for other wires by `_retime`)."""
        deps = [self.point[r] for r in ranks]
        latency = min(latency, seconds)
        if latency > 0:
            deps = [self.graph.add(f"{name} latency", ranks[0], Lane.HOST, latency, (), deps)]
        links = self._links(ranks)
        port = self._port_share(links)
        parts, shares = [], []
        for rank, lane, resources in links:
            share = port if lane is Lane.INTRA_NODE else 1.0
            parts.append(self.graph.add(name, rank, lane, (seconds - latency) * share,
                                        resources, deps))  # fmt: skip
            shares.append(share)
        if self.record and weights:
            self.recipes += [
                ("sync", part, share) for part, share in zip(parts, shares, strict=True)
            ]
        return self.graph.join(ranks[0], parts)

    def _port_share(self, links) -> float:
        """The share of a collective's time its members' ports are busy: across nodes
        its pace is the node's NICs' (`CostModel.bus_bandwidth`) and a port moves the same
        bytes at its own bandwidth; inside a node, all of it."""
        if not any(lane is Lane.INTER_NODE for _, lane, _ in links):
            return 1.0
        topo = self.topology
        return min(1.0, topo.nics_per_node * topo.nic_bandwidth / topo.intra_node_bandwidth)

    def _links(self, ranks) -> list[tuple[int, Lane, tuple]]:
        """(the rank it is drawn for, its lane, its resources) of every link a collective
        over `ranks` uses."""
        links = [(r, Lane.INTRA_NODE, (("port_out", r), ("port_in", r))) for r in ranks]
        nodes = {self.node[r]: r for r in reversed(ranks)}  # each node's first member
        if len(nodes) > 1:
            nics = range(self.topology.nics_per_node)
            links += [(first, Lane.INTER_NODE, (("nic_out", node, nic), ("nic_in", node, nic)))
                      for node, first in nodes.items() for nic in nics]  # fmt: skip
        return links

    def post_weight_sync(self) -> dict[int, int]:
        """This layer's weight collectives, per rank the one it joins at the layer's end."""
        phase = 0 if self.phase is Phase.FORWARD else 1
        seconds, latency = self.setup.weight_sync[phase], self.setup.weight_latency[phase]
        if seconds <= 0:
            return {}
        out = {}
        groups = self.setup.weight_groups
        if phase and self.setup.weight_groups_backward:
            groups = self.setup.weight_groups_backward
        for group in groups:
            task = self.post_collective(
                list(group), seconds, "weights gather/scatter", latency, weights=True
            )
            out.update(dict.fromkeys(group, task))
        self.sync_tasks = out
        return out

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

    # the engine's parts

    def step_seconds(self, item: QueueItem, layouts, position: int, step: int) -> float:
        """Compute of one ring step of one member (forward or backward), 0 when it has no rows.

        Each sequence's block runs at the rate of its length (`ComputeRates.attention_seconds`):
        step 0 computes causal blocks over the member's own rows, later steps unmasked
        blocks of its rows against the source's (their length: the geometric mean of
        the two sides), each call with the member's heads (H / U under Ulysses: a kernel
        whose rate follows its score tensor's size reads its curve at a shorter length,
        `ComputeRates.curve_heads`). The segments are `attention.schedule.step_segments`'
        (the engine's), costed for every position and step of the item at once.
        """
        return float(self._step_table(item, layouts)[position, step])

    def _step_table(self, item: QueueItem, layouts) -> np.ndarray:
        """`step_seconds` of every (position, step) of the item (positions x steps),
        worked out once per item."""
        key = item.order_key()
        if key not in self.step_costs:
            self.step_costs[key] = self._new_step_table(item, layouts)
        return self.step_costs[key]

    def _new_step_table(self, item: QueueItem, layouts) -> np.ndarray:
        sizes = np.asarray(layouts, dtype=np.float64).reshape(
            item.ring_size, len(item.seqs), item.layout.slots
        )
        shape = self.setup.shape
        backward = self.phase is Phase.BACKWARD
        # whole-sequence placements call the kernel in the model: autograd differentiates it
        autograd = SEQUENCE_AXES[self.setup.plan.planner].whole_sequences
        heads = shape.n_heads // item.ulysses  # Ulysses leaves each member H / U heads
        per_pair = 4.0 * heads * shape.head_dim
        if backward:
            per_pair *= BACKWARD_ATTENTION_FACTOR
        rates = self.setup.rates
        return step_table(sizes, item.layout, rates, per_pair, backward, autograd, heads)

    def kv_row_bytes(self, item: QueueItem, payload: Payload) -> int:
        shape = self.setup.shape
        heads = shape.n_kv_heads // item.ulysses if item.ulysses <= shape.n_kv_heads else 1
        setup = self.setup
        owned = setup.dkv_owner and item.owner_dkv
        size = setup.element_bytes if payload is Payload.KV or owned else setup.dkv_bytes
        return 2 * heads * shape.head_dim * size

    def ring_item(self, index: int, item: QueueItem) -> None:
        """The item's K/V exchange and attention, as its exchange kind plays it (`PLAYS`)."""
        layouts = [position_layout(self.setup.plan, item, r) for r in range(item.ring_size)]
        play = PLAYS[item.exchange_kind.play_for(item.ring_size)]
        play(self, index, item, layouts)

    def rotated_item(self, index: int, item: QueueItem, layouts) -> None:
        """`Play.ROTATE`: step by step, on arrays where `ring_form` allows it."""
        if self._plays_on_arrays(index, item):
            self.ring_on_arrays(index, item, layouts)
        elif self.phase is Phase.FORWARD:
            self.ring_forward(index, item, layouts)
        elif self.setup.dkv_owner and item.owner_dkv:
            self.owner_backward(index, item, layouts)
        else:
            self.ring_backward(index, item, layouts)

    def _post(
        self, index: int, item: QueueItem, step: int, payload: Payload, deps: dict, alone: dict
    ) -> dict:
        """Post the transfers of (step, payload), each in flight while its ends compute
        what `alone` gives them (per rank); per rank, the messages it waits on."""
        done = defaultdict(list)
        row_bytes = self.kv_row_bytes(item, payload)
        for t in self.transfers.get((index, step, int(payload)), ()):
            src, dst = t.route.src, t.route.dst
            compute_s = max(alone.get(src, 0.0), alone.get(dst, 0.0))
            sent, received = self.ring_transfer(t, row_bytes, deps[src], deps[dst], compute_s)
            done[src] += sent
            done[dst] += received
        return done

    def _alone(self, item: QueueItem, layouts, step: int) -> dict[int, float]:
        """Every member's compute of ring step `step` alone (none past the last step:
        a message then overlaps no compute, `_post`)."""
        if step >= item.ring_size:
            return {}
        return {
            rank: self.step_seconds(item, layouts, member // item.ulysses, step)
            for member, rank in enumerate(item.ranks)
        }

    def _member_computes(self, item: QueueItem, alone: dict, step: int, *in_flight) -> dict:
        """Every member's compute of ring step `step` (`alone`), slowed while the messages
        of `in_flight` (per rank) share its device (`ComputeRates.contention`, for the
        time they can overlap: the shorter of the compute and the transfers)."""
        out = {}
        factor = self.setup.rates.contention - 1.0
        tasks = self.graph.tasks
        for rank in item.ranks:
            messages = [t for msgs in in_flight for t in msgs[rank]]
            moving = sum(tasks[t].duration for t in messages)
            seconds = alone[rank] + factor * min(alone[rank], moving)
            out[rank] = self.compute(rank, seconds, f"attention step {step}")
            if self.record:
                self.recipes.append(("contended", out[rank], alone[rank], messages))
        return out

    def ring_forward(self, index: int, item: QueueItem, layouts) -> None:
        for step in range(item.ring_size):
            alone = self._alone(item, layouts, step)
            points = {r: self.point[r] for r in item.ranks}
            kv = self._post(index, item, step, Payload.KV, points, alone)
            computes = self._member_computes(item, alone, step, kv)
            for rank in item.ranks:
                self.wait(rank, [computes[rank], *kv[rank]])

    def ring_backward(self, index: int, item: QueueItem, layouts) -> None:
        """Step s's K/V message is in flight during step s's compute, its dK/dV message
        during step s + 1's (the last one after the ring's compute)."""
        previous: dict = defaultdict(list)  # dK/dV messages of the previous step
        alone = self._alone(item, layouts, 0)
        for step in range(item.ring_size):
            points = {r: self.point[r] for r in item.ranks}
            kv = self._post(index, item, step, Payload.KV, points, alone)
            computes = self._member_computes(item, alone, step, kv, previous)
            if item.ring_size == 1:
                for rank in item.ranks:
                    self.wait(rank, [computes[rank]])
                return
            alone = self._alone(item, layouts, step + 1)
            ready = {r: self.graph.join(r, [computes[r], *previous[r]]) for r in item.ranks}
            previous = self._post(index, item, step, Payload.DKV, ready, alone)
            for rank in item.ranks:
                self.point[rank] = self.graph.join(rank, [ready[rank], *kv[rank]])
        for rank in item.ranks:
            self.wait(rank, previous[rank])

    def owner_backward(self, index: int, item: QueueItem, layouts) -> None:
        """`ring_backward` under `parallel.dkv_wire=owner`: K/V rotate as there; after step
        s's compute (s >= 1) each member posts its dK/dV to their owner and the receive of
        its own from the member p + s, and moves on once step s - 1's have arrived: no
        sum waits for the previous member's, as the engine's `_owner_backward` runs."""
        in_flight: dict = defaultdict(list)  # the owner messages of the previous step
        alone = self._alone(item, layouts, 0)
        for step in range(item.ring_size):
            points = {r: self.point[r] for r in item.ranks}
            kv = self._post(index, item, step, Payload.KV, points, alone)
            computes = self._member_computes(item, alone, step, kv, in_flight)
            alone = self._alone(item, layouts, step + 1)
            posted = defaultdict(list)
            if step:
                posted = self._post(index, item, step, Payload.DKV, computes, alone)
            for rank in item.ranks:
                self.point[rank] = self.graph.join(rank, [computes[rank], *kv[rank],
                                                          *in_flight[rank]])  # fmt: skip
            in_flight = posted
        for rank in item.ranks:
            self.wait(rank, in_flight[rank])

    def _plays_on_arrays(self, index: int, item: QueueItem) -> bool:
        """Whether the ring's schedule is `ray_zep.sim.ring_form`'s (`array_ring`), sent
        plain, in a graph built for one wire; else its transfers are made ready here
        where `RoutingPlan.build` left them out."""
        routed = self.setup.routing.routed
        if array_ring(item, self.topology, routed):
            if not self.record and not self.setup.codec.zips(CompressionStream.KV.value):
                return True
            if not any((index, 0, int(p)) in self.transfers for p in Payload):
                plan = self.setup.plan
                for t in item_transfers(plan, index, item, self.phase, routed, all_hops=True):
                    self.transfers[t.order].append(t)
        return False

    def ring_on_arrays(self, index: int, item: QueueItem, layouts) -> None:
        """The ring as one task per member lasting what `ring_form` works out, after every
        member has reached it (and after the layer's weight collectives: the ring's
        messages would queue behind them on the links)."""
        ring = item.ring_size
        compute = self._step_table(item, layouts)  # members are positions: no Ulysses
        held = np.asarray([sum(e + n for e, n in lay) for lay in layouts], dtype=np.float64)
        rows = held[(np.arange(ring)[:, None] - np.arange(ring)[None, :]) % ring]
        kv = self._hop_seconds(item, rows, Payload.KV, compute)
        following = np.concatenate([compute[:, 1:], np.zeros((ring, 1))], axis=1)
        contention = self.setup.rates.contention
        if self.phase is Phase.FORWARD:
            ends = ring_forward(compute, kv, contention)
        else:
            dkv = self._hop_seconds(item, rows, Payload.DKV, following)
            if item.exchange_kind.keeps_kv:  # the forward's K/V were kept
                kv = np.zeros_like(kv)
            ends = ring_backward(compute, kv, dkv, contention)
        deps = [self.point[r] for r in item.ranks] + [self.sync_tasks.get(r) for r in item.ranks]
        start = self.graph.join(item.ranks[0], deps)
        for rank, seconds in zip(item.ranks, ends.tolist(), strict=True):
            task = self.graph.add("attention ring", rank, Lane.COMPUTE, seconds,
                                  (("compute", rank),), [start])  # fmt: skip
            self.wait(rank, [task])

    def _hop_seconds(self, item, rows, payload: Payload, compute) -> np.ndarray:
        """Seconds of every member's message at every step (members x steps), as `send`
        works them out for a direct ring hop in flight during `compute` of its two ends."""
        ring = item.ring_size
        nbytes = rows * self.kv_row_bytes(item, payload)
        overlapped = np.maximum(compute, np.roll(compute, -1, axis=0))
        ranks = item.ranks
        inter = np.asarray([self.node[r] != self.node[ranks[(m + 1) % ring]]
                            for m, r in enumerate(ranks)])  # fmt: skip
        return hop_seconds(self.setup.cost, nbytes, inter, overlapped)

    def gathered_item(self, index: int, item: QueueItem, layouts) -> None:
        """`Play.GATHER`: all-gather K/V, compute every step; backward: compute,
        reduce-scatter dK/dV (`index` unused: collectives need no transfer list)."""
        ring, cost = item.ring_size, self.setup.cost
        rows = max(sum(sum(slots) for slots in lay) for lay in layouts)
        forward = self.phase is Phase.FORWARD
        block = rows * self.kv_row_bytes(item, Payload.KV if forward else Payload.DKV)
        seconds = cost.all_gather_seconds(block, item.ranks)
        if forward:
            self.collective(list(item.ranks), seconds, "K/V all-gather")
        for member, rank in enumerate(item.ranks):
            position = member // item.ulysses
            total = sum(self.step_seconds(item, layouts, position, s) for s in range(ring))
            self.wait(rank, [self.compute(rank, total, "attention (gathered)")])
        if not forward:
            self.collective(list(item.ranks), seconds, "dK/dV reduce-scatter")

    def ulysses_exchange(self, item: QueueItem, sizes, name: str) -> None:
        """Members of each ring position swap rows for heads; `sizes` is (`row_bytes`,
        the `Stream`), `row_bytes(position, me, peer)` the message size from member `me`
        to member `peer`."""
        row_bytes, stream = sizes
        u = item.ulysses
        posted = {r: self.point[r] for r in item.ranks}
        done = defaultdict(list)
        for position in range(item.ring_size):
            group = item.ranks[position * u : (position + 1) * u]
            for me, src in enumerate(group):
                for peer, dst in enumerate(group):
                    if peer != me:
                        task = self.send(
                            src,
                            dst,
                            row_bytes(position, me, peer),
                            [posted[src], posted[dst]],
                            name,
                            stream,
                        )
                        done[src].append(task)
                        done[dst].append(task)
        for rank in item.ranks:
            self.wait(rank, done[rank])

    def ulysses_sizes(self, item: QueueItem, incoming: bool):
        """(message sizes, `Stream`) of the exchange before (`incoming`) or after the ring,
        this phase."""
        shape, u = self.setup.shape, item.ulysses
        placements = [self.setup.plan.placement(s) for s in item.seqs]
        tokens = [sum(p.member_tokens(m) for p in placements) for m in range(len(item.ranks))]
        q_per = shape.n_heads // u
        kv_per = shape.n_kv_heads // u if u <= shape.n_kv_heads else 1
        e, elem = shape.head_dim, self.setup.element_bytes
        forward = self.phase is Phase.FORWARD
        name = CompressionStream.ULYSSES_ALL_TO_ALL.value
        qkv, out = (q_per + 2 * kv_per) * e, q_per * e  # values per row
        if forward and incoming:  # Q/K/V of my rows, the peer's heads
            mine, per_row, stream = True, qkv * elem, Stream(name, elem)
        elif forward:  # attention output of the peer's rows, my heads
            mine, per_row, stream = False, out * elem, Stream(name, elem)
        elif incoming:  # output gradient of my rows, the peer's heads
            mine, per_row, stream = True, out * elem, Stream(name, elem, True)
        else:  # dQ/dK/dV of the peer's rows, my heads, in float32
            mine, per_row, stream = False, qkv * FP32_BYTES, Stream(name, FP32_BYTES, True)
        return (lambda pos, me, peer: tokens[pos * u + (me if mine else peer)] * per_row), stream

    def attention(self) -> None:
        for index, item in enumerate(self.setup.plan.items()):
            if item.ulysses > 1:
                self.ulysses_exchange(item, self.ulysses_sizes(item, True), "Ulysses in")
            self.ring_item(index, item)
            if item.ulysses > 1:
                self.ulysses_exchange(item, self.ulysses_sizes(item, False), "Ulysses out")

    def remap(self, to_attention: bool, row_bytes: int, name: str) -> None:
        """The remap all-to-all-v: linear -> attention layout (`to_attention`) or back.

        Played per rank and link kind, as an all-to-all-v runs: a rank's part moves the
        larger of what it sends and receives over that kind at once (one latency per
        message), on its own port or its NIC (shared with the rank beside it), from
        when every peer has posted the exchange; a rank goes on once its parts and the
        parts of every peer it receives from have ended. (Pair by pair, each message
        would hold a sender's NIC while it waits for a busy receiver's, and the
        exchange would queue up across the cluster as no all-to-all does.)"""
        if self.setup.remap is None:
            return
        posted = list(self.point)
        backward = self.phase is Phase.BACKWARD
        stream = Stream(
            CompressionStream.REMAP_ALL_TO_ALL.value, self.setup.element_bytes, backward
        )
        moved: dict[tuple, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])  # sent, got, count
        peers: dict[int, set[int]] = defaultdict(set)
        senders: dict[int, set[int]] = defaultdict(set)
        for src, dst, tokens in self.setup.remap.transfers:
            a, b = (dst, src) if to_attention else (src, dst)
            kind = LinkKind.INTRA_NODE if self.node[a] == self.node[b] else LinkKind.INTER_NODE
            nbytes = tokens * row_bytes
            moved[a, kind][0] += nbytes
            moved[b, kind][1] += nbytes
            moved[a, kind][2] += 1
            moved[b, kind][2] += 1
            peers[a].add(b)
            peers[b].add(a)
            senders[b].add(a)
        parts: dict[int, list[int]] = defaultdict(list)
        for (rank, kind), (sent, got, count) in moved.items():
            deps = [posted[rank], *(posted[p] for p in sorted(peers[rank]))]
            parts[rank].append(self.rank_exchange(rank, kind, max(sent, got), count, deps,
                                                  name, stream))  # fmt: skip
        for rank in peers:
            arrived = [t for peer in sorted(senders[rank]) for t in parts[peer]]
            self.wait(rank, [*parts[rank], *arrived])

    def rank_exchange(
        self, rank: int, kind: LinkKind, nbytes: float, messages: int, deps, name: str,
        stream: Stream,
    ) -> int:  # fmt: skip
        """One rank's part of an all-to-all-v over links of `kind`: `nbytes` through its
        port (intra-node) or its NIC, `messages` latencies, zipped where `stream` goes."""
        if kind is LinkKind.INTRA_NODE:
            lane, resources = Lane.INTRA_NODE, (("port_out", rank), ("port_in", rank))
        else:
            node, nic = self.node[rank], self.nic[rank]
            lane, resources = Lane.INTER_NODE, (("nic_out", node, nic), ("nic_in", node, nic))
        cost = self.setup.cost
        plain = cost.transfer_seconds(nbytes, kind, one_sender_per_nic=True)
        plain += (messages - 1) * cost.link_latency(kind)
        return self._wire_task(rank, lane, resources, plain, (kind, stream, nbytes), deps, name)

    def linear(self, flops_per_token: float, name: str, pointwise_share: float) -> None:
        """The matmuls of `flops_per_token` and `pointwise_share` of the layer's element-wise
        work on every rank's linear tokens, slowed while weight collectives run."""
        rates = self.setup.rates
        backward = self.phase is Phase.BACKWARD
        factor = BACKWARD_LINEAR_FACTOR if backward else 1.0
        sync = self.setup.weight_sync[1 if backward else 0]
        elements = pointwise_share * pointwise_elements_per_token(self.setup.shape)
        for rank, tokens in enumerate(self.setup.linear_tokens()):
            alone = factor * tokens * flops_per_token / rates.matmul
            alone += rates.pointwise_seconds(tokens * elements)
            seconds = alone + (rates.contention - 1.0) * min(alone, sync / 2)
            task = self.compute(rank, seconds, name)
            self.wait(rank, [task])
            if self.record:
                self.recipes.append(("linear", task, alone))


PLAYS = {Play.ROTATE: _Builder.rotated_item, Play.GATHER: _Builder.gathered_item}
"""Each play's builder of one queue item: (builder, item index, item, position layouts)."""

POINTWISE_SHARES = ((1 / 6, 1 / 6), (1 / 3, 1 / 3))
"""Shares of a layer's element-wise work (forward and backward together) each linear
part takes: (before attention, after it), forward then backward (backward: twice)."""


def layer_graph(setup: LayerSetup, phase: Phase) -> TaskGraph:
    """The task graph of one layer's forward or backward on every rank (module docstring)."""
    build = _Builder(setup, phase)
    _layer_program(build)
    return build.graph


Wire = tuple[WireCodec, tuple[float, float]]
"""What a layer's messages cost on: the codec and the weight collectives' seconds
(`LayerSetup.codec`, `LayerSetup.weight_sync`)."""


def layer_graphs(setup: LayerSetup, phase: Phase, wires: Sequence[Wire]) -> list[TaskGraph]:
    """`layer_graph` of `setup` under each of `wires` in place of its own: the program is
    built once, and only the durations the wire changes (messages, the weight
    collectives and the compute they slow) are worked out again for each.

    Raises:
        ValueError: a wire has weight collectives in a phase where `setup` has none, or
            the other way round (the graphs would differ in tasks, not only in times).
    """
    own = (setup.codec, setup.weight_sync)
    build = _Builder(setup, phase, record=any(wire != own for wire in wires))
    _layer_program(build)
    graphs = []
    for codec, sync in wires:
        if [s > 0 for s in sync] != [s > 0 for s in setup.weight_sync]:
            raise ValueError(f"weight sync {sync} against the setup's {setup.weight_sync}")
        graphs.append(build.graph if (codec, sync) == own else _retime(build, codec, sync))
    return graphs


def _retime(build: _Builder, codec: WireCodec, sync: tuple[float, float]) -> TaskGraph:
    """The builder's graph with the durations of `build.recipes` worked out under
    `codec` and `sync`, as the builder works them out (`send`, `_member_computes`,
    `linear`, `post_weight_sync`); the builder's graph itself where none changes."""
    setup, tasks = build.setup, build.graph.tasks
    phase = 0 if build.phase is Phase.FORWARD else 1
    weights, latency = sync[phase], min(setup.weight_latency[phase], sync[phase])
    factor = setup.rates.contention - 1.0
    durations = [t.duration for t in tasks]
    profiles: dict[tuple, Profile] = {}
    messages: dict[tuple, float] = {}  # most messages repeat a few sizes
    for tag, task, *data in build.recipes:  # in task order: messages before their computes
        if tag == "send":
            key = tuple(data)
            if key not in messages:
                messages[key] = build.zipped(codec, profiles, *data)
            durations[task] = messages[key]
        elif tag == "contended":
            alone, sent = data
            durations[task] = alone + factor * min(alone, sum(durations[t] for t in sent))
        elif tag == "linear":
            durations[task] = data[0] + factor * min(data[0], weights / 2)
        else:  # a weight collective's part on one link, after its latency
            durations[task] = (weights - latency) * data[0]
    changed = [i for i, (t, d) in enumerate(zip(tasks, durations, strict=True)) if t.duration != d]
    if not changed:
        return build.graph
    retimed = list(tasks)
    for i in changed:
        t = tasks[i]
        retimed[i] = Task(t.name, t.rank, t.lane, durations[i], t.resources, t.deps)
    return TaskGraph(retimed)


def _layer_program(build: _Builder) -> None:
    """The layer's program (module docstring) into `build`."""
    setup, phase = build.setup, build.phase
    shape, elem = setup.shape, setup.element_bytes
    qkv_bytes = (shape.n_heads + 2 * shape.n_kv_heads) * shape.head_dim * elem
    out_bytes = shape.n_heads * shape.head_dim * elem
    before, after = linear_flops_per_token(shape)
    late = phase is Phase.FORWARD and setup.gather_after_attention
    sync = {} if late else build.post_weight_sync()
    shares = POINTWISE_SHARES[0 if phase is Phase.FORWARD else 1]
    if phase is Phase.FORWARD:
        build.linear(before, "QKV projection", shares[0])
        build.remap(True, qkv_bytes, "remap q/k/v")
        build.attention()
        if late:
            sync = build.post_weight_sync()
        build.remap(False, out_bytes, "remap output")
        build.linear(after, "output projection + MLP", shares[1])
    else:
        build.linear(after, "output projection + MLP", shares[1])
        build.remap(True, out_bytes, "remap output gradient")
        build.attention()
        build.remap(False, qkv_bytes, "remap q/k/v gradient")
        build.linear(before, "QKV projection", shares[0])
    for rank, task in sync.items():
        build.wait(rank, [task])


def attention_graph(setup: LayerSetup, phase: Phase) -> TaskGraph:
    """The task graph of one layer's attention engine alone (no linear modules, no remap)."""
    build = _Builder(setup, phase)
    build.attention()
    return build.graph
