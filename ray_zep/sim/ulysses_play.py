"""The Ulysses head exchanges of USP items in a simulated layer, as the engine runs them.

Whole (`ulysses_exchange`): the members of each ring position swap rows for heads
between the linear modules and the ring, and back after it (`ray_zep.attention.ulysses`);
each exchange is an all-to-all-v of the position (`_exchange_parts`).

In pieces (`LayerSetup.ulysses_chunks` > 1, `UlyssesPieces`; the engine's
`ray_zep.attention.ulysses_chunks`): every member splits its rows of an item into pieces
(`chunk_sizes`). Forward: it projects Q/K/V a piece at a time and posts each piece's
exchange before projecting the next (every USP item of the rank in turn, then its other
rows); the ring starts once every piece has arrived; after every ring the output's
pieces are posted at once, and the rank projects its other rows, then each piece as it
arrives, then runs the MLP. Backward: the MLP's backward, then the output projection's a
piece at a time (last piece first), each piece's output gradient posted before the next;
after the rings the dQ/dK/dV pieces go back at once, and the QKV projection's backward
runs on the other rows, then on each piece as it arrives. A member posts each piece as
one batch of sends and receives on one communicator (`ray_zep.attention.kv_exchange`),
and NCCL runs a communicator's batches one after another on its stream: a piece moves
once its position's previous piece has arrived, so pieces arrive in the order they were
posted, each at the links' whole pace rather than all together at a share of it. A
piece's compute is slowed while its rank's earlier pieces are in flight
(`ComputeRates.contention`, for the shorter of the compute and the transfers, as a ring
step beside its messages), and by the weights' collectives for its share of the rank's
whole projection (`_retime`'s `piece` recipe; so is the MLP, the rest of the part the
output projection is of). The matmuls run at the same rate over a piece as over all rows.
"""

from __future__ import annotations

from collections import defaultdict

from ray_zep.attention.ulysses_chunks import chunk_sizes
from ray_zep.costmodel import BACKWARD_LINEAR_FACTOR
from ray_zep.options import CompressionStream
from ray_zep.partition.plan import QueueItem
from ray_zep.routing.routes import Phase
from ray_zep.sim.graph_builder import FP32_BYTES, GraphBuilder, moving_seconds
from ray_zep.sim.layer_work import linear_part_seconds
from ray_zep.sim.wire import Stream
from ray_zep.topology import LinkKind

PIECE_RECIPE = "piece"
"""`GraphBuilder.recipes` tag of a piece's compute: (alone, its share of the rank's whole
projection, the messages in flight beside it)."""


def member_tokens(build: GraphBuilder, item: QueueItem) -> list[int]:
    """Tokens of every member of `item`, in `item.ranks` order."""
    placements = [build.setup.plan.placement(s) for s in item.seqs]
    return [sum(p.member_tokens(m) for p in placements) for m in range(len(item.ranks))]


def ulysses_sizes(build: GraphBuilder, item: QueueItem, incoming: bool):
    """(bytes per row, whether a message carries its sender's rows, `Stream`) of the
    exchange before (`incoming`) or after the ring, this phase."""
    shape, u = build.setup.shape, item.ulysses
    q_per = shape.n_heads // u
    kv_per = shape.n_kv_heads // u if u <= shape.n_kv_heads else 1
    e, elem = shape.head_dim, build.setup.element_bytes
    forward = build.phase is Phase.FORWARD
    name = CompressionStream.ULYSSES_ALL_TO_ALL.value
    qkv, out = (q_per + 2 * kv_per) * e, q_per * e  # values per row
    if forward and incoming:  # Q/K/V of my rows, the peer's heads
        mine, per_row, stream = True, qkv * elem, Stream(name, elem)
    elif forward:  # attention output of the peer's rows, my heads
        mine, per_row, stream = False, out * elem, Stream(name, elem)
    elif incoming:  # output gradient of my rows, the peer's heads
        mine, per_row, stream = True, out * elem, Stream(name, elem, True)
    else:  # dQ/dK/dV of the peer's rows, my heads (`ulysses.ulysses_gradient_dtype`)
        wire = elem if u <= shape.n_kv_heads else FP32_BYTES  # float32 for shared heads
        mine, per_row, stream = False, qkv * wire, Stream(name, wire, True)
    return per_row, mine, stream


def ulysses_exchange(build: GraphBuilder, item: QueueItem, incoming: bool) -> None:
    """The whole exchange before (`incoming`) or after the ring; every member waits for it."""
    posted = {r: build.point[r] for r in item.ranks}
    done, _ = _exchange_parts(build, item, member_tokens(build, item), incoming, posted)
    for rank in item.ranks:
        build.wait(rank, done[rank])


def _exchange_parts(
    build, item: QueueItem, rows: list[int], incoming: bool, posted, after=None
) -> tuple:
    """Every member's messages to the others of its position (`rows[m]`: the rows of
    member m, in `item.ranks` order, that a message to or from it carries), played as an
    all-to-all-v per rank and link kind (`GraphBuilder.rank_exchange`), as the engine
    posts them, one batch of all pairs: a member's part moves the larger of what it sends
    and receives over that kind, from when every member of its position has posted. Pair
    by pair, a message would hold its sender's port while it waits for a receiver the
    other members are sending to, as no all-to-all does (the remap's all-to-all-v is
    played the same way, `_Builder.remap`). By rank: every part of its position (what it
    waits for: its own and what it receives), and its own parts (what runs beside its
    compute). `after`: by rank, what each member's part waits for besides every member's
    post (the position's previous piece, `UlyssesPieces`)."""
    per_row, mine, stream = ulysses_sizes(build, item, incoming)
    name = "Ulysses in" if incoming else "Ulysses out"
    u, node = item.ulysses, build.node
    done, own = defaultdict(list), defaultdict(list)
    for position in range(item.ring_size):
        group = item.ranks[position * u : (position + 1) * u]
        nbytes = [rows[position * u + m] * per_row for m in range(u)]
        deps = [posted[r] for r in group]
        if after:
            deps += sorted({t for r in group for t in after.get(r, ())})
        for me, src in enumerate(group):
            moved = {}  # link kind: (sent, received)
            for peer, dst in enumerate(group):
                if peer == me:
                    continue
                kind = LinkKind.INTRA_NODE if node[src] == node[dst] else LinkKind.INTER_NODE
                sent, got = moved.get(kind, (0.0, 0.0))
                out, back = (nbytes[me], nbytes[peer]) if mine else (nbytes[peer], nbytes[me])
                moved[kind] = (sent + out, got + back)
            own[src] = [build.rank_exchange(src, kind, max(pair), deps, name, stream)
                         for kind, pair in moved.items() if max(pair) > 0]  # fmt: skip
        every = [t for src in group for t in own[src]]
        for src in group:
            done[src] = every
    return done, own


class UlyssesPieces:
    """One phase of a layer whose USP items exchange heads in pieces (module docstring)."""

    def __init__(self, build: GraphBuilder) -> None:
        self.build = build
        self.k = build.setup.ulysses_chunks
        self.items = [(i, item) for i, item in enumerate(build.setup.plan.items())
                      if item.ulysses > 1]  # fmt: skip
        self.pieces: dict[int, list[list[int]]] = {}
        """Per item index, each piece's rows of every member (`item.ranks` order)."""
        self.member: dict[tuple[int, int], int] = {}  # (item index, rank): its member index
        self.split: dict[int, int] = defaultdict(int)  # rank: its rows of USP items
        self.held: dict[int, list[int]] = defaultdict(list)  # rank: its USP items' indices
        for index, item in self.items:
            tokens = member_tokens(build, item)
            sizes = [chunk_sizes(n, self.k) for n in tokens]
            self.pieces[index] = [[piece[c] for piece in sizes] for c in range(self.k)]
            for m, rank in enumerate(item.ranks):
                self.member[index, rank] = m
                self.split[rank] += tokens[m]
                self.held[rank].append(index)
        forward = build.phase is Phase.FORWARD
        self.order = list(range(self.k)) if forward else list(reversed(range(self.k)))
        self.factor = 1.0 if forward else BACKWARD_LINEAR_FACTOR
        self.arrivals: dict[tuple[int, int], list[int]] = defaultdict(list)
        self.departures: dict[tuple[int, int], list[tuple]] = defaultdict(list)
        """Per (item index, rank), each piece's parts after the ring: (all, its own)."""
        self.total: list[float] = []
        self.previous: dict[int, list[int]] = {}
        """Per rank, every part of the piece it posted last (the next one moves after it)."""

    @classmethod
    def of(cls, build: GraphBuilder) -> UlyssesPieces | None:
        """The pieces of this layer, or None where its exchanges run whole."""
        setup = build.setup
        if setup.ulysses_chunks <= 1 or setup.remap is not None:
            return None
        if not any(item.ulysses > 1 for item in setup.plan.items()):
            return None
        return cls(build)

    def project_and_post(self, flops: float, elements: float, name: str, whole) -> None:
        """Each USP item's rows a piece at a time, posting each piece's exchange before
        the next piece; then the rank's other rows, beside the last pieces in flight.
        `whole`: (FLOPs, elements) per token of the linear part the projection is of
        (the weights' collectives slow that part as a whole, `_compute`)."""
        build = self.build
        tokens = self._totals(*whole)
        in_flight: dict[int, list[int]] = defaultdict(list)
        for index, item in self.items:
            for c in self.order:
                rows = self.pieces[index][c]
                for m, rank in enumerate(item.ranks):
                    if rows[m]:
                        task = self._compute(rank, rows[m], flops, elements, name, in_flight[rank])
                        build.wait(rank, [task])
                posted = {rank: build.point[rank] for rank in item.ranks}
                sent, own = _exchange_parts(build, item, rows, True, posted, self.previous)
                for rank in item.ranks:
                    in_flight[rank] = own[rank]
                    self.arrivals[index, rank] += sent[rank]
                    self.previous[rank] = sent[rank]
        for rank, count in enumerate(tokens):
            rest = count - self.split[rank]
            if rest > 0 or not self.split[rank]:
                build.wait(
                    rank, [self._compute(rank, rest, flops, elements, name, in_flight[rank])]
                )

    def attention(self) -> None:
        """Every item's ring, a USP item's once its pieces have arrived; then every USP
        item's pieces back, all posted at once."""
        build = self.build
        for index, item in enumerate(build.setup.plan.items()):
            if item.ulysses > 1:
                for rank in item.ranks:
                    build.wait(rank, self.arrivals[index, rank])
            build.ring_item(index, item)
        for index, item in self.items:
            posted = {rank: build.point[rank] for rank in item.ranks}
            for c in self.order:
                sent, own = _exchange_parts(build, item, self.pieces[index][c], False, posted,
                                            self.previous)  # fmt: skip
                for rank in item.ranks:
                    self.departures[index, rank].append((sent[rank], own[rank]))
                    self.previous[rank] = sent[rank]

    def wait_and_project(self, flops: float, elements: float, name: str, whole) -> None:
        """The rank's other rows beside the pieces in flight, then each piece of its USP
        items as it arrives, beside the pieces after it (`whole`: `project_and_post`'s)."""
        build = self.build
        tokens = self._totals(*whole)
        for rank, count in enumerate(tokens):
            mine = [(i, self.departures[i, rank]) for i in self.held[rank]]
            flying = [t for _, pieces in mine for _, own in pieces for t in own]
            rest = count - self.split[rank]
            if rest > 0 or not mine:
                build.wait(rank, [self._compute(rank, rest, flops, elements, name, flying)])
            for index, pieces in mine:
                for j, c in enumerate(self.order):
                    build.wait(rank, pieces[j][0])
                    rows = self.pieces[index][c][self.member[index, rank]]
                    if rows:
                        later = [t for _, own in pieces[j + 1 :] for t in own]
                        task = self._compute(rank, rows, flops, elements, name, later)
                        build.wait(rank, [task])

    def rest(self, flops: float, elements: float, name: str, whole) -> None:
        """The rest of the linear part `whole` (the MLP beside the output projection) on
        every rank's rows, after what came before."""
        tokens = self._totals(*whole)
        for rank, count in enumerate(tokens):
            self.build.wait(rank, [self._compute(rank, count, flops, elements, name, [])])

    def _totals(self, flops: float, elements: float) -> list[int]:
        """Every rank's linear tokens, noting the seconds of its whole linear part alone."""
        tokens = self.build.setup.linear_tokens()
        rates = self.build.setup.rates
        self.total = [linear_part_seconds(n, flops, elements, rates, self.factor) for n in tokens]
        return tokens

    def _compute(self, rank: int, rows: int, flops, elements, name: str, messages) -> int:
        """A piece of a linear part: `rows` rows alone, slowed by the weights' collectives
        for its share of the rank's whole part and by `messages` in flight."""
        build = self.build
        setup = build.setup
        alone = linear_part_seconds(rows, flops, elements, setup.rates, self.factor)
        whole = self.total[rank]
        fraction = alone / whole if whole > 0 else 0.0
        tasks = build.graph.tasks
        moving = moving_seconds(rank, messages, tasks, lambda t: tasks[t].duration,
                                setup.rates.grouped_exchange)  # fmt: skip
        sync = setup.weight_sync[0 if build.phase is Phase.FORWARD else 1]
        slowed = (setup.rates.contention - 1.0) * min(alone, fraction * sync / 2 + moving)
        task = build.compute(rank, alone + slowed, name, alone)
        if build.record:
            build.recipes.append((PIECE_RECIPE, task, alone, fraction, messages))
        return task
