"""One transformer layer of a training step as a task graph, from the plan the engine runs.

Every rank follows the engine's program (`ray_zep.attention.engine`) with the
plan's queue items in the same order, the same ring steps
(`attention.schedule.step_segments`), the same transfers with the same routes
(`routing.routes.RoutingPlan`) and the remap plan's all-to-all-v:

forward:  QKV projections (linear layout) -> remap q/k/v to the attention layout
          -> queue items -> remap the output back -> output projection and MLP
backward: the same in reverse order of modules; queue items in forward order.

The graph is built of `ray_zep.sim.graph_builder`'s primitives (messages on links,
routed transfers through proxies, collectives, zipped wires). At ring step s a rank
posts the transfer of step s (K/V for step s + 1), launches step s's compute, then
waits for both: a transfer starts once its sender and receiver have posted it.
Backward adds the dK/dV accumulator pass: it leaves after the step's compute and
after the previous accumulator has arrived (under `parallel.dkv_wire=owner` an item
inside a node or with Ulysses members sends each step's dK/dV straight to its owner
after the step's compute, in the activation dtype, `owner_backward`); under either
wire a ring that kept the forward's K/V computes its own block last
(`ExchangeKind.backward_order`). An item's K/V
exchange is built as its kind plays it (`PLAYS`, one builder per
`ray_zep.partition.exchange.Play`). The remap's all-to-all-v is played per rank and link
kind (`_Builder.remap`). A ring position's Ulysses exchange is an all-to-all-v among its
members, played the same way, whole or in pieces beside the projections
(`ray_zep.sim.ulysses_play`, `LayerSetup.ulysses_chunks`: then the layer runs
`_pieces_program`).

With `comm.compression`, the Ulysses exchanges and the remap rows go zipped where the
mode zips them, as the ring's K/V do; the compute a message overlaps is slowed by
`ComputeRates.contention` as by any communication kernel (a ring step's sends and
receives together once where they are one grouped kernel, `moving_seconds`). llama_cp's
K/V all-gather and dK/dV reduce-scatter stay plain, as in the engine. `layer_graphs`
builds a layer once for several wires.

Elementwise work (norms, RoPE, softmax outside the kernel) and kernel launch
gaps of the linear modules are not modelled.

Shapes of sizes: H query heads, K key/value heads, E head dim.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from ray_zep.attention.schedule import item_layouts
from ray_zep.collectives.switcher import Profile
from ray_zep.costmodel import (
    BACKWARD_ATTENTION_FACTOR,
    BACKWARD_LINEAR_FACTOR,
    linear_flops_per_token,
    output_projection_flops_per_token,
    pointwise_elements_per_token,
)
from ray_zep.cycle_collection import without_cycle_collection
from ray_zep.options import CompressionStream
from ray_zep.parallel.axes import SEQUENCE_AXES
from ray_zep.partition.exchange import Play
from ray_zep.partition.plan import QueueItem
from ray_zep.routing.routes import Payload, Phase, item_transfers
from ray_zep.sim.events import Lane, TaskGraph
from ray_zep.sim.graph_builder import RING_STEP, GraphBuilder, LayerSetup, moving_seconds
from ray_zep.sim.layer_work import (
    POINTWISE_SHARES,
    RecomputedPart,
    linear_part_seconds,
    recomputed_parts,
)
from ray_zep.sim.ring_form import (
    array_ring,
    hop_seconds,
    kept_ring_backward,
    ring_backward,
    ring_forward,
)
from ray_zep.sim.step_costs import step_table
from ray_zep.sim.ulysses_play import PIECE_RECIPE, UlyssesPieces, ulysses_exchange
from ray_zep.sim.wire import Stream, WireCodec
from ray_zep.topology import LinkKind


class _Builder(GraphBuilder):
    """A layer's graph as the engine runs it, rank program after rank program."""

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
        layouts = item_layouts(self.setup.plan, item)
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
        time they can overlap: the shorter of the compute and the transfers,
        `moving_seconds`)."""
        out = {}
        factor = self.setup.rates.contention - 1.0
        grouped = self.setup.rates.grouped_exchange
        tasks = self.graph.tasks

        def duration(t: int) -> float:
            return tasks[t].duration

        for rank in item.ranks:
            messages = [t for msgs in in_flight for t in msgs[rank]]
            moving = moving_seconds(rank, messages, tasks, duration, grouped)
            seconds = alone[rank] + factor * min(alone[rank], moving)
            out[rank] = self.compute(rank, seconds, f"{RING_STEP} {step}", alone[rank])
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
        during the next step's. Steps run in `ExchangeKind.backward_order`: a ring that
        kept the forward's K/V computes its own block last, while the accumulator of its
        own K/V comes home, and sends none after it; a ring rotating its K/V again sends
        the last accumulator home after the ring's compute, as the engine's
        `_ring_backward` runs."""
        previous: dict = defaultdict(list)  # dK/dV messages of the previous step
        order = item.exchange_kind.backward_order(item.ring_size)
        alone = self._alone(item, layouts, order[0])
        for at, step in enumerate(order):
            points = {r: self.point[r] for r in item.ranks}
            kv = self._post(index, item, step, Payload.KV, points, alone)
            computes = self._member_computes(item, alone, step, kv, previous)
            if item.ring_size == 1:
                for rank in item.ranks:
                    self.wait(rank, [computes[rank]])
                return
            following = order[at + 1] if at + 1 < len(order) else item.ring_size
            alone = self._alone(item, layouts, following)
            ready = {r: self.graph.join(r, [computes[r], *previous[r]]) for r in item.ranks}
            # none listed after a kept ring's own block (`listed_transfers`)
            previous = self._post(index, item, step, Payload.DKV, ready, alone)
            for rank in item.ranks:
                self.point[rank] = self.graph.join(rank, [ready[rank], *kv[rank]])
        for rank in item.ranks:
            self.wait(rank, previous[rank])

    def owner_backward(self, index: int, item: QueueItem, layouts) -> None:
        """`ring_backward` under `parallel.dkv_wire=owner`: K/V rotate as there; after step
        s's compute (s >= 1) each member posts its dK/dV to their owner and the receive of
        its own from the member p + s, and moves on once the previous step's have arrived:
        no sum waits for the previous member's, as the engine's `_owner_backward` runs.
        Steps run in `ExchangeKind.backward_order`: a ring that kept the forward's
        K/V computes its own block last, so no dK/dV message follows the ring's compute."""
        in_flight: dict = defaultdict(list)  # the owner messages of the previous step
        order = item.exchange_kind.backward_order(item.ring_size)
        alone = self._alone(item, layouts, order[0])
        for at, step in enumerate(order):
            points = {r: self.point[r] for r in item.ranks}
            kv = self._post(index, item, step, Payload.KV, points, alone)
            computes = self._member_computes(item, alone, step, kv, in_flight)
            following = order[at + 1] if at + 1 < len(order) else item.ring_size
            alone = self._alone(item, layouts, following)
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
            if not any((index, s, int(p)) in self.transfers for s in (0, 1) for p in Payload):
                plan = self.setup.plan
                for t in item_transfers(plan, index, item, self.phase, routed, all_hops=True):
                    self.transfers[t.order].append(t)
        return False

    def ring_on_arrays(self, index: int, item: QueueItem, layouts) -> None:
        """The ring as one task per member lasting what `ring_form` works out, after every
        member has reached it (and after the layer's weight collectives: played without
        messages, its transfers cannot share the links with them)."""
        ring = item.ring_size
        compute = self._step_table(item, layouts)  # members are positions: no Ulysses
        held = layouts.sum(axis=(1, 2)).astype(np.float64)
        members = np.arange(ring)[:, None]
        owners = (members - np.arange(ring)[None, :]) % ring  # the block held at each step
        rows = held[owners]  # dK/dV accumulators carry whole blocks
        sent = self.setup.plan.carried(item).rows((members + 1) % ring, owners)  # K/V: trimmed
        kv = self._hop_seconds(item, sent.astype(np.float64), Payload.KV, compute)
        following = np.concatenate([compute[:, 1:], np.zeros((ring, 1))], axis=1)
        contention = self.setup.rates.contention
        grouped = self.setup.rates.grouped_exchange
        if self.phase is Phase.FORWARD:
            ends = ring_forward(compute, kv, contention, grouped)
        elif item.exchange_kind.keeps_kv:  # no K/V sent; its own block last
            following = np.roll(compute, -1, axis=1)  # after step R - 1 comes step 0
            dkv = self._hop_seconds(item, rows, Payload.DKV, following)
            ends = kept_ring_backward(compute, dkv, contention, grouped)
        else:
            dkv = self._hop_seconds(item, rows, Payload.DKV, following)
            ends = ring_backward(compute, kv, dkv, contention, grouped)
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
        cost = self.setup.cost
        rows = int(layouts.sum(axis=(1, 2)).max())
        forward = self.phase is Phase.FORWARD
        block = rows * self.kv_row_bytes(item, Payload.KV if forward else Payload.DKV)
        seconds = cost.all_gather_seconds(block, item.ranks)
        if forward:
            self.collective(list(item.ranks), seconds, "K/V all-gather")
        # each position's steps summed in step order (a running sum: a ring of 4,096 members
        # has 16M of them)
        totals = np.cumsum(self._step_table(item, layouts), axis=1)[:, -1].tolist()
        for member, rank in enumerate(item.ranks):
            total = totals[member // item.ulysses]
            self.wait(rank, [self.compute(rank, total, "attention (gathered)")])
        if not forward:
            self.collective(list(item.ranks), seconds, "dK/dV reduce-scatter")

    def attention(self) -> None:
        for index, item in enumerate(self.setup.plan.items()):
            if item.ulysses > 1:
                ulysses_exchange(self, item, True)
            self.ring_item(index, item)
            if item.ulysses > 1:
                ulysses_exchange(self, item, False)

    def remap(self, to_attention: bool, row_bytes: int, name: str) -> None:
        """The remap all-to-all-v: linear -> attention layout (`to_attention`) or back.

        Played per rank and link kind, as an all-to-all-v runs: a rank's part moves the
        larger of what it sends and receives over that kind at once (its messages go as
        one batch and pay one latency, which holds no link: `ray_zep.sim.events`), on
        its own port or its NIC (shared with the rank beside it), from
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
        moved: dict[tuple, list[float]] = defaultdict(lambda: [0.0, 0.0])  # sent, got
        peers: dict[int, set[int]] = defaultdict(set)
        senders: dict[int, set[int]] = defaultdict(set)
        for src, dst, tokens in self.setup.remap.transfers:
            a, b = (dst, src) if to_attention else (src, dst)
            kind = LinkKind.INTRA_NODE if self.node[a] == self.node[b] else LinkKind.INTER_NODE
            nbytes = tokens * row_bytes
            moved[a, kind][0] += nbytes
            moved[b, kind][1] += nbytes
            peers[a].add(b)
            peers[b].add(a)
            senders[b].add(a)
        parts: dict[int, list[int]] = defaultdict(list)
        for (rank, kind), (sent, got) in moved.items():
            deps = [posted[rank], *(posted[p] for p in sorted(peers[rank]))]
            parts[rank].append(self.rank_exchange(rank, kind, max(sent, got), deps, name, stream))
        for rank in peers:
            arrived = [t for peer in sorted(senders[rank]) for t in parts[peer]]
            self.wait(rank, [*parts[rank], *arrived])

    def recompute(self, part: RecomputedPart | None) -> None:
        """`part` of the block's forward computed again on every rank's linear tokens, as
        activation checkpointing makes its backward do (none: nothing)."""
        if part is None:
            return
        for rank, tokens in enumerate(self.setup.linear_tokens()):
            task = self.compute(rank, part.seconds(tokens, self.setup.rates), part.name)
            self.wait(rank, [task])

    def linear(self, flops_per_token: float, name: str, pointwise_share: float) -> None:
        """The matmuls of `flops_per_token` and `pointwise_share` of the layer's element-wise
        work on every rank's linear tokens, slowed while weight collectives run."""
        rates = self.setup.rates
        backward = self.phase is Phase.BACKWARD
        factor = BACKWARD_LINEAR_FACTOR if backward else 1.0
        sync = self.setup.weight_sync[1 if backward else 0]
        elements = pointwise_share * pointwise_elements_per_token(self.setup.shape)
        for rank, tokens in enumerate(self.setup.linear_tokens()):
            alone = linear_part_seconds(tokens, flops_per_token, elements, rates, factor)
            seconds = alone + (rates.contention - 1.0) * min(alone, sync / 2)
            task = self.compute(rank, seconds, name, alone)
            self.wait(rank, [task])
            if self.record:
                self.recipes.append(("linear", task, alone))


PLAYS = {Play.ROTATE: _Builder.rotated_item, Play.GATHER: _Builder.gathered_item}
"""Each play's builder of one queue item: (builder, item index, item, position layouts)."""


@without_cycle_collection
def layer_graph(setup: LayerSetup, phase: Phase) -> TaskGraph:
    """The task graph of one layer's forward or backward on every rank (module docstring)."""
    build = _Builder(setup, phase)
    _layer_program(build)
    return build.graph


Wire = tuple[WireCodec, tuple[float, float]]
"""What a layer's messages cost on: the codec and the weight collectives' seconds
(`LayerSetup.codec`, `LayerSetup.weight_sync`)."""


@without_cycle_collection
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
    gathered = min(setup.weight_latency[0], sync[0])
    parts = {  # a part of the weight collectives on one link, after its latency
        "all": weights - latency,
        "gather": sync[0] - gathered,
        "rest": weights - sync[0] - (latency - gathered),
    }
    factor, grouped = setup.rates.contention - 1.0, setup.rates.grouped_exchange
    durations = [t.duration for t in tasks]
    slowed = dict(build.graph.slowed)
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
            moving = moving_seconds(tasks[task].rank, sent, tasks, durations.__getitem__, grouped)
            slowed[task] = factor * min(alone, moving)
            durations[task] = alone + slowed[task]
        elif tag == PIECE_RECIPE:
            alone, fraction, sent = data
            moving = moving_seconds(tasks[task].rank, sent, tasks, durations.__getitem__, grouped)
            slowed[task] = factor * min(alone, fraction * weights / 2 + moving)
            durations[task] = alone + slowed[task]
        elif tag == "linear":
            slowed[task] = factor * min(data[0], weights / 2)
            durations[task] = data[0] + slowed[task]
        else:  # a weight collective's part on one link, after its latency
            durations[task] = parts[data[1]] * data[0]
    changed = [i for i, (t, d) in enumerate(zip(tasks, durations, strict=True)) if t.duration != d]
    if not changed:
        return build.graph
    retimed = list(tasks)
    for i in changed:
        t = tasks[i]
        retimed[i] = t._replace(duration=durations[i], latency=min(t.latency, durations[i]))
    spilled = parts["gather"] if build.graph.spill else 0.0
    return dataclasses.replace(build.graph, tasks=retimed, spill_bytes=spilled, slowed=slowed)


def _layer_program(build: _Builder) -> None:
    """The layer's program (module docstring) into `build`."""
    setup, phase = build.setup, build.phase
    shape, elem = setup.shape, setup.element_bytes
    qkv_bytes = (shape.n_heads + 2 * shape.n_kv_heads) * shape.head_dim * elem
    out_bytes = shape.n_heads * shape.head_dim * elem
    before, after = linear_flops_per_token(shape)
    late = phase is Phase.FORWARD and setup.gather_after_attention
    build.post_weight_spill()
    sync = {} if late else build.post_weight_sync()
    shares = POINTWISE_SHARES[0 if phase is Phase.FORWARD else 1]
    pieces = UlyssesPieces.of(build)
    if pieces is not None:
        sync = _pieces_program(build, pieces, sync, shares) or sync
    elif phase is Phase.FORWARD:
        build.linear(before, "QKV projection", shares[0])
        build.remap(True, qkv_bytes, "remap q/k/v")
        build.attention()
        if late:
            sync = build.post_weight_sync()
        build.remap(False, out_bytes, "remap output")
        build.linear(after, "output projection + MLP", shares[1])
    else:
        starting, before_qkv = recomputed_parts(shape, setup.recompute)
        build.recompute(starting)
        build.linear(after, "output projection + MLP", shares[1])
        build.remap(True, out_bytes, "remap output gradient")
        build.attention()
        build.remap(False, qkv_bytes, "remap q/k/v gradient")
        build.recompute(before_qkv)
        build.linear(before, "QKV projection", shares[0])
    for rank, task in sync.items():
        build.wait(rank, [task])


def _pieces_program(build: _Builder, pieces: UlyssesPieces, sync, shares) -> dict | None:
    """`_layer_program` where USP items exchange heads in pieces beside the projections
    (no remap); the forward's weight collective where it starts after the attention."""
    shape = build.setup.shape
    before, after = linear_flops_per_token(shape)
    out = output_projection_flops_per_token(shape)
    elements = pointwise_elements_per_token(shape)
    qkv = (before, shares[0] * elements)
    outputs = (after, shares[1] * elements)  # the output projection, the MLP's work after
    mlp = (after - out, shares[1] * elements)
    if build.phase is Phase.FORWARD:
        pieces.project_and_post(*qkv, "QKV projection", qkv)
        pieces.attention()
        late = build.post_weight_sync() if build.setup.gather_after_attention else None
        pieces.wait_and_project(out, 0.0, "output projection", outputs)
        pieces.rest(*mlp, "MLP", outputs)
        return late
    starting, before_qkv = recomputed_parts(shape, build.setup.recompute)
    build.recompute(starting)
    pieces.rest(*mlp, "MLP", outputs)
    pieces.project_and_post(out, 0.0, "output projection", outputs)
    pieces.attention()
    build.recompute(before_qkv)
    pieces.wait_and_project(*qkv, "QKV projection", qkv)
    return None


@without_cycle_collection
def attention_graph(setup: LayerSetup, phase: Phase) -> TaskGraph:
    """The task graph of one layer's attention engine alone (no linear modules, no remap)."""
    build = _Builder(setup, phase)
    build.attention()
    return build.graph
