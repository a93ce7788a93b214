"""What a rank's share of a batch costs: modelled seconds of a whole training step's work.

The balancing planners equalise these seconds, not tokens. A rank's work is the
forward and backward of every layer for the tokens it holds:

- linear modules: tokens x their FLOPs per token at the matmul rate;
- attention of a whole sequence of n tokens on the rank: n (n + 1) / 2 causal pairs
  at the causal kernel's rate for blocks of n tokens;
- a ring member holding c tokens of each of a ring's sequences (equal shares): its
  diagonal step (about c^2 / 2 causal pairs) and R - 1 later steps of the unmasked
  block its layout gives the busiest member (`Layout.busiest_member_blocks`; zigzag:
  c x c / 2 pairs at the rate of blocks of c / 2 tokens), each step
  lasting the longer of its compute and the transfer of the K and V it forwards
  (backward: K, V and the float32 dK/dV accumulators; the accumulators alone where
  the members keep the forward's K/V, `WorkModel.keeps_kv`); every member waits for the
  slowest at every step, so the ring takes the same time on all of them;
- a member of a ring of whole nodes with heads exchanged inside each ring position
  (USP: U GPUs of a node, or of several whole nodes, per ring position,
  `usp_member_seconds`): the Ulysses all-to-alls over the node's links (and its NICs,
  for a position of several nodes), then the ring over the positions with H / U heads,
  every member's hop through its own NIC (the node's GPUs all send at once, sharing
  them).

Rates are the cost model's (`ComputeRates`: measured curves where there are, the
half-rate form otherwise), evaluated on arrays so that a batch of thousands of
sequences on 4,096 ranks is costed at once.

Shapes: S sequences, G ring groups.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ray_zep.costmodel import (
    BACKWARD_ATTENTION_FACTOR,
    BACKWARD_LINEAR_FACTOR,
    BYTES_PER_ELEMENT,
    ComputeRates,
    CostModel,
    kv_bytes_per_token,
    linear_flops_per_token,
    output_projection_flops_per_token,
    pointwise_elements_per_token,
    preset_rates,
)
from ray_zep.model_shapes import ModelShape
from ray_zep.options import DkvWire
from ray_zep.partition.layout import ZIGZAG, Layout
from ray_zep.topology import LinkKind, Topology

DKV_WIRE_FACTOR = 3.0
"""Backward ring bytes over forward: K and V again plus float32 dK/dV (twice bf16);
2 with dK/dV in the K/V dtype (`parallel.dkv_wire=compute`, and `owner` where an item
sends them to their owners)."""
KV_DTYPE_DKV_FACTOR = 2.0
"""Backward ring bytes over forward with dK/dV in the K/V dtype."""
WIDE_SPAN = 5
"""The most whole nodes one USP position spans (Ulysses across them, where their GPUs
split the heads: 7B's 32 heads over two or four 8-GPU nodes, 13B's 40 over five). Each
node of such a position attends with 1 / s of the heads, so it imports 1 / s of a long
document's K/V, which bounds the longest chat documents on one-node positions. On `bench
scale`'s chat batches (4k tokens per GPU) up to five nodes against up to two: 7b 4.1%
(256 GPUs) and 9.7% (1,024) more tokens a second, 13b 25% and 43% (13B had no wide
positions before: its heads do not split over 16 GPUs); no other row of 64-1,024 GPUs
moved (BENCHMARKS.md, thirty-seventh series). A lone 242k-token group of 8 positions plays
1.15x (7B, four nodes each) and 1.26x (13B, five) its modelled member work, of one-node
positions 0.86-0.89x. (Tried in the twenty-third series, when a link served one message at
a time, the same spans lost 2.9-19% on chat: a lone group then played twice its model.)"""

FORWARD_SHARE = 1.0 / (1.0 + BACKWARD_LINEAR_FACTOR)
"""The most of the level a USP group's forward may take where a plan checks it (guests,
`ray_zep.partition.usp_guests`; wide positions, `ray_zep.partition.usp_grid`): a rank's
linear modules' forward share (its attention's is smaller). A step waits for the
forward's slowest rank, then the backward's, so a group whose forward waits on its hops
sets the forward even where its member work, forward and backward, is within the level."""


@dataclass(frozen=True)
class RingParts:
    """Per-layer parts of one ring member's attention, forward + backward, per sequence.

    Attributes:
        diagonal_s: the member's own causal step.
        step_s: compute of one later step.
        send_bytes: bytes one step forwards (forward K/V; backward adds dK/dV).
    """

    diagonal_s: np.ndarray
    step_s: np.ndarray
    send_bytes: np.ndarray


@dataclass(frozen=True)
class WorkModel:
    """Modelled step seconds of a rank's work for one model on one cluster.

    Attributes:
        shape: the model.
        rates: one GPU's compute rates.
        cost: links and latencies.
        routed: inter-node ring hops go through proxies over every NIC of the node
            (`parallel.routing`); otherwise through the sender's own NIC.
        layout: how rings cut their sequences.
        dkv_factor: backward ring bytes over forward (`DKV_WIRE_FACTOR`).
        keep_kv_bytes: the most bytes of ring peers' K/V, over all layers, that a
            member holding `capacity` tokens keeps from the forward for the backward
            (`parallel.ring_kv_keep_gb`).
        room_per_token: bytes of kept K/V room each token a member holds fewer than
            `capacity` frees (`parallel.ring_kv_room_mb`; 0: `keep_kv_bytes` alone).
        capacity: L, the most tokens a rank holds (for `room_per_token`).
        owner_dkv: `parallel.dkv_wire=owner`: rings inside a node and USP groups send
            each step's dK/dV to their owners in the K/V dtype (`QueueItem.owner_dkv`),
            each step's message no longer than the K/V's; rings across nodes pass
            accumulators of `dkv_factor`.
        ulysses_pieces: USP groups exchange heads in this many pieces beside the Q/K/V
            and output projections (`parallel.ulysses_chunks`): of each phase's
            all-to-alls, what those projections' seconds cover is hidden but a piece's
            share (`exposed_exchange`).
    """

    shape: ModelShape
    rates: ComputeRates
    cost: CostModel
    routed: bool = False
    layout: Layout = ZIGZAG
    dkv_factor: float = DKV_WIRE_FACTOR
    keep_kv_bytes: float = 0.0
    owner_dkv: bool = False
    room_per_token: float = 0.0
    capacity: int = 0
    ulysses_pieces: int = 1

    @classmethod
    def create(
        cls,
        shape: ModelShape,
        topology: Topology,
        rates: ComputeRates | None = None,
        routed: bool = False,
        dkv_wire: DkvWire = DkvWire.FLOAT32,
        keep_kv_gb: float = 0.0,
        room_mb: float = 0.0,
        capacity: int = 0,
        ulysses_pieces: int = 1,
    ) -> WorkModel:
        """The model on `topology` at `rates` (default: the topology GPU's preset), ring
        dK/dV on the wire as `dkv_wire` says, members holding `capacity` tokens keeping
        up to `keep_kv_gb` GB of their peers' K/V, `room_mb` MB more for each token
        fewer, USP head exchanges in `ulysses_pieces`."""
        rates = rates or preset_rates(topology.gpu_model)
        cost = CostModel(shape, topology, rates.attention_forward)
        factor = KV_DTYPE_DKV_FACTOR if dkv_wire is DkvWire.COMPUTE else DKV_WIRE_FACTOR
        return cls(shape, rates, cost, routed, dkv_factor=factor, keep_kv_bytes=keep_kv_gb * 1e9,
                   owner_dkv=dkv_wire is DkvWire.OWNER, room_per_token=room_mb * 1e6,
                   capacity=capacity, ulysses_pieces=ulysses_pieces)  # fmt: skip

    @cached_property
    def kept_bytes_per_token(self) -> int:
        """Bytes a ring member keeps of one peer token's K/V, over every layer."""
        return kv_bytes_per_token(self.shape) * self.layers

    def _kept_bytes(self, kept_tokens, ulysses=1) -> np.ndarray:
        per_token = self.kept_bytes_per_token
        return np.asarray(kept_tokens, dtype=np.float64) * per_token / ulysses

    def keeps_kv(self, kept_tokens, ulysses=1, held=None):
        """Whether a ring member keeping `kept_tokens` of its peers' tokens (each layer,
        1/`ulysses` of their K/V heads) stays within `keep_kv_bytes`, or, where its rings
        hold `held` tokens of it, within that and the room of the tokens it could still
        hold (`room_per_token` each; `reserved_tokens` says how many it then leaves
        free). Elementwise."""
        budget = self.keep_kv_bytes
        if held is not None and self.room_per_token > 0:
            spare = np.maximum(0.0, self.capacity - np.asarray(held, dtype=np.float64))
            budget = budget + spare * self.room_per_token
        return self._kept_bytes(kept_tokens, ulysses) <= budget

    def reserved_tokens(self, kept_tokens, ulysses=1) -> np.ndarray:
        """Tokens below `capacity` a member keeping `kept_tokens` (as `keeps_kv`) must
        leave free for them beyond `keep_kv_bytes` (0 within it; elementwise; huge where
        no `room_per_token` frees any)."""
        if isinstance(kept_tokens, int) and isinstance(ulysses, int):  # one ring: no arrays
            per_token = self.kept_bytes_per_token
            over = max(0.0, float(kept_tokens) * per_token / ulysses - self.keep_kv_bytes)
            if self.room_per_token <= 0:
                return np.iinfo(np.int64).max // 2 if over > 0 else 0
            return math.ceil(over / self.room_per_token)
        over = np.maximum(0.0, self._kept_bytes(kept_tokens, ulysses) - self.keep_kv_bytes)
        if self.room_per_token <= 0:
            return np.where(over > 0, np.iinfo(np.int64).max // 2, 0).astype(np.int64)
        return np.ceil(over / self.room_per_token).astype(np.int64)

    def hop(self, kind: LinkKind) -> tuple[float, float]:
        """(latency s, bytes/s) of one ring hop over `kind`. A ring crosses each node
        boundary from one GPU; routed, its bytes spread over all the node's NICs
        through proxies: the sender scatters all but its own share to the send proxies
        and the receiver gathers them from the receive proxies over its intra-node port,
        each relay forwarding a piece once it has all of it (`ray_zep.routing`), so the
        three hops add up. A lone ring's steps pass faster than that in the simulator,
        whose ports move the pieces before and after a step's while its pieces cross
        the NICs (`ray_zep.sim.link_sharing`): at the slower of the two, the model
        says 0.87-0.91x of the simulated layers of a lone 128k-token ring of 16-64
        members over 2-8 nodes, adding them 0.89-1.49x. In a batch, the ports also carry
        the other rings' hops: `bench scale`'s planner, costing the hops at the slower
        of the two, spread long sequences over more nodes and trained 6-16% fewer tokens
        a second on six of the sixteen rows at 64 and 256 GPUs, more on one (5.8%)."""
        cost, topo = self.cost, self.cost.topology
        bandwidth = cost.link_bandwidth(kind, one_sender_per_nic=True)
        latency = cost.link_latency(kind)
        if kind is LinkKind.INTER_NODE and self.routed:
            proxies = topo.nics_per_node
            relayed = 2 * (proxies - 1) / proxies  # dispatched and combined shares
            intra = cost.link_bandwidth(LinkKind.INTRA_NODE)
            bandwidth = 1.0 / (1.0 / (proxies * bandwidth) + relayed / intra)
            latency += 2 * cost.link_latency(LinkKind.INTRA_NODE)
        return latency, bandwidth

    @property
    def layers(self) -> int:
        return self.shape.n_layers

    @cached_property
    def _linear_per_token_s(self) -> float:
        before, after = linear_flops_per_token(self.shape)
        per_token = (1 + BACKWARD_LINEAR_FACTOR) * (before + after) * self.layers
        elements = pointwise_elements_per_token(self.shape) * self.layers
        return per_token / self.rates.matmul + self.rates.pointwise_seconds(elements)

    @cached_property
    def _projections_per_token_s(self) -> float:
        """Forward seconds of one token's Q/K/V and output projections, one layer."""
        before, _ = linear_flops_per_token(self.shape)
        return (before + output_projection_flops_per_token(self.shape)) / self.rates.matmul

    def linear_seconds(self, tokens: np.ndarray) -> np.ndarray:
        """Forward + backward of every layer's matmuls and element-wise work over
        `tokens` tokens."""
        return np.asarray(tokens, dtype=np.float64) * self._linear_per_token_s

    def rate(self, tokens: np.ndarray, causal: bool, backward: bool) -> np.ndarray:
        """`ComputeRates.attention_rate` over an array of block lengths."""
        tokens = np.maximum(np.asarray(tokens, dtype=np.float64), 1.0)
        return self.rates.attention_rates(tokens, causal, backward)

    def _pair_seconds(self, pairs: np.ndarray, tokens: np.ndarray, causal: bool) -> np.ndarray:
        """Forward + backward seconds of `pairs` (query, key) pairs, one layer."""
        flops = 4.0 * self.shape.n_heads * self.shape.head_dim * pairs
        forward = flops / self.rate(tokens, causal, backward=False)
        backward = BACKWARD_ATTENTION_FACTOR * flops / self.rate(tokens, causal, backward=True)
        return forward + backward + 2 * self.rates.call_overhead_s

    def whole_seconds(self, lengths: np.ndarray) -> np.ndarray:
        """Work of each sequence whole on one rank (linear + causal attention), seconds."""
        n = np.asarray(lengths, dtype=np.float64)
        attention = self._pair_seconds(n * (n + 1) / 2, n, causal=True)
        return self.linear_seconds(n) + self.layers * attention

    def ring_parts(self, lengths: np.ndarray, degree: np.ndarray) -> RingParts:
        """Parts of a member of a ring of `degree` ranks over each sequence (degree >= 2)."""
        n = np.asarray(lengths, dtype=np.float64)
        c = n / np.asarray(degree, dtype=np.float64)
        diagonal_pairs, diagonal_length, pairs, length = self.layout.busiest_member_blocks(c)
        diagonal = self._pair_seconds(diagonal_pairs, diagonal_length, causal=True)
        step = self._pair_seconds(pairs, length, causal=False)
        send = c * kv_bytes_per_token(self.shape)
        return RingParts(diagonal, step, send)

    def ring_member_seconds(
        self, parts: RingParts, tokens: float | np.ndarray, degree, kind: LinkKind
    ) -> np.ndarray:
        """Work of a ring member: `parts` summed over the ring's sequences (or one
        sequence each), `tokens` it holds, `degree` members, over links of `kind`."""
        owner = self.owner_dkv and kind is LinkKind.INTRA_NODE
        ring = self._ring_seconds(parts, degree, self.hop(kind), owner)
        return self.linear_seconds(tokens) + self.layers * ring

    def ring_forward_seconds(
        self, parts: RingParts, tokens: np.ndarray, degree, kind: LinkKind
    ) -> np.ndarray:
        """The forward's part of `ring_member_seconds`: the linear modules' forward and the
        ring's forward steps, each the longer of its compute and its hop."""
        latency, bandwidth = self.hop(kind)
        share = 1.0 / (1.0 + BACKWARD_ATTENTION_FACTOR)
        steps = np.asarray(degree, dtype=np.float64) - 1
        send = latency + parts.send_bytes / bandwidth
        ring = parts.diagonal_s * share + steps * np.maximum(parts.step_s * share, send)
        linear = self.linear_seconds(tokens) / (1.0 + BACKWARD_LINEAR_FACTOR)
        return linear + self.layers * ring

    def _ring_seconds(
        self, parts: RingParts, degree, hop: tuple[float, float], owner: bool = False
    ) -> np.ndarray:
        """One layer of a ring of `degree` positions, forward + backward, each step the
        longer of its compute and its hop (`hop`: latency s, bytes/s); `owner`: its
        dK/dV go to their owners in the K/V dtype (`owner_dkv`)."""
        latency, bandwidth = hop
        steps = np.asarray(degree, dtype=np.float64) - 1
        # the bytes a member keeps and the tokens it holds, in token rows of every K/V head
        held = parts.send_bytes / kv_bytes_per_token(self.shape)
        kept = steps * held
        factor = KV_DTYPE_DKV_FACTOR if owner else self.dkv_factor
        backward = factor - np.where(self.keeps_kv(kept, held=held), 1.0, 0.0)
        send_f = latency + parts.send_bytes / bandwidth
        send_b = latency + backward * parts.send_bytes / bandwidth
        # forward and backward parts of the step's compute, weighted as `_pair_seconds` is
        share_f = 1.0 / (1.0 + BACKWARD_ATTENTION_FACTOR)
        step_f, step_b = parts.step_s * share_f, parts.step_s * (1 - share_f)
        return parts.diagonal_s + steps * (np.maximum(step_f, send_f) + np.maximum(step_b, send_b))

    def whole_forward_seconds(self, lengths: np.ndarray) -> np.ndarray:
        """The forward's part of `whole_seconds`."""
        n = np.asarray(lengths, dtype=np.float64)
        flops = 4.0 * self.shape.n_heads * self.shape.head_dim * n * (n + 1) / 2
        attention = flops / self.rate(n, True, backward=False) + self.rates.call_overhead_s
        linear = self.linear_seconds(n) / (1.0 + BACKWARD_LINEAR_FACTOR)
        return linear + self.layers * attention

    def alone_ring_seconds(self, lengths: np.ndarray, degree: np.ndarray) -> np.ndarray:
        """Work of a member of each sequence's ring of `degree` ranks, the sequence alone
        on it: inside one node up to the topology's GPUs per node, across nodes beyond."""
        lengths = np.asarray(lengths, dtype=np.float64)
        degree = np.asarray(degree)
        parts = self.ring_parts(lengths, degree)
        tokens = lengths / degree
        intra = self.ring_member_seconds(parts, tokens, degree, LinkKind.INTRA_NODE)
        inter = self.ring_member_seconds(parts, tokens, degree, LinkKind.INTER_NODE)
        return np.where(degree <= self.cost.topology.gpus_per_node, intra, inter)

    def usp_member_seconds(
        self, lengths: np.ndarray, positions: np.ndarray, ulysses: np.ndarray | int = 0
    ) -> np.ndarray:
        """Work of a member of each sequence's USP group alone on it: `positions` ring
        positions of `ulysses` GPUs each (0: the node's GPUs, every position a whole node;
        a multiple of them: every position that many whole nodes) exchanging heads
        (module docstring). The ring is costed at its
        hops across nodes (a group of more GPUs than a node has some): every member
        sends through its NIC, sharing it with the GPUs the node maps to it, as in a
        full batch (a lone group of half-node positions the simulator plays 21-25%
        faster than this: `tests/test_narrow_usp.py`; a lone group of positions of
        several nodes 15-26% slower, its all-to-alls beside the weights' collectives on
        the NICs of a batch of one document, `WIDE_SPAN`; the grid's full batches step
        faster with these groups as costed here, BENCHMARKS.md, twenty-third and
        thirty-seventh series).

        U must split the heads as Ulysses needs (`usp_widths`)."""
        n = np.asarray(lengths, dtype=np.float64)
        return self.usp_group_seconds(self.ring_parts(n, positions), n, positions, ulysses)

    def usp_group_seconds(
        self, parts: RingParts, tokens: np.ndarray, positions, ulysses: np.ndarray | int = 0
    ) -> np.ndarray:
        """Work of a member of each USP group (`usp_member_seconds`' positions and U) that
        holds several sequences: `parts` their `ring_parts` at the group's positions
        summed, `tokens` their lengths summed. Each ring step forwards every sequence's
        chunk and computes every block, and one all-to-all moves all the rows (one queue
        item, `AttentionPlan.items`); one sequence gives `usp_member_seconds`."""
        return self._usp_total(*self._usp_group(parts, tokens, positions, ulysses))

    def usp_group_forward_seconds(
        self, parts: RingParts, tokens: np.ndarray, positions, ulysses: np.ndarray | int = 0
    ) -> np.ndarray:
        """The forward's part of `usp_group_seconds`: the linear modules' forward, the
        all-to-alls of Q/K/V in and the output out, and the ring's forward steps, each
        the longer of its compute and its hop."""
        return self.usp_group_costs(parts, tokens, positions, ulysses)[1]

    def usp_group_costs(
        self, parts: RingParts, tokens: np.ndarray, positions, ulysses: np.ndarray | int = 0
    ) -> tuple[np.ndarray, np.ndarray]:
        """(`usp_group_seconds`, `usp_group_forward_seconds`) at once."""
        group = self._usp_group(parts, tokens, positions, ulysses)
        member, exchange, heads, positions, (latency, bandwidth) = group
        share = 1.0 / (1.0 + BACKWARD_ATTENTION_FACTOR)
        hop = latency + heads.send_bytes / bandwidth
        ring = heads.diagonal_s * share + (positions - 1) * np.maximum(heads.step_s * share, hop)
        linear = self.linear_seconds(member) / (1.0 + BACKWARD_LINEAR_FACTOR)
        return self._usp_total(*group), linear + self.layers * (exchange[0] + ring)

    def _usp_total(self, member, exchange, heads: RingParts, positions, inter) -> np.ndarray:
        """`usp_group_seconds` of `_usp_group`'s parts: the linear modules, both phases'
        all-to-alls and the ring."""
        ring = self._ring_seconds(heads, positions, inter, self.owner_dkv)
        return self.linear_seconds(member) + self.layers * (exchange[0] + exchange[1] + ring)

    def _usp_group(self, parts: RingParts, tokens, positions, ulysses):
        """What `usp_group_seconds` adds up: each member's tokens, the all-to-alls'
        seconds (forward, backward), the parts of a member's heads, the positions and
        the hop across nodes."""
        member, exchange, u = self._usp_exchange(tokens, positions, ulysses)
        heads = RingParts(parts.diagonal_s / u, parts.step_s / u, parts.send_bytes / u)
        inter = (self.cost.link_latency(LinkKind.INTER_NODE),
                 self.cost.link_bandwidth(LinkKind.INTER_NODE))  # fmt: skip
        return member, exchange, heads, np.asarray(positions, dtype=np.float64), inter

    def usp_exchange_seconds(self, tokens, positions, ulysses) -> tuple[np.ndarray, np.ndarray]:
        """(forward, backward) seconds of one layer's all-to-alls that a member of each
        USP group (`usp_member_seconds`' positions and U; `tokens`: the group's) leaves
        exposed, the exchanges run in the model's `ulysses_pieces`."""
        return self._usp_exchange(tokens, positions, ulysses)[1]

    def _usp_exchange(self, tokens, positions, ulysses):
        """(each member's tokens, the exposed all-to-alls' seconds (forward, backward), U)
        of `_usp_group`."""
        n = np.asarray(tokens, dtype=np.float64)
        positions = np.asarray(positions, dtype=np.float64)
        gpus = self.cost.topology.gpus_per_node
        u = np.where(np.asarray(ulysses) > 0, ulysses, gpus).astype(np.float64)
        member = n / (positions * u)
        per_row = ulysses_row_bytes(self.shape, u)  # (U-1)/U of each member's rows leave
        forward_row = ulysses_row_bytes(self.shape, u, forward=True)
        latency, bandwidth = self.hop(LinkKind.INTRA_NODE)
        # a position of several whole nodes (U > G) sends (U - G) / U of its rows across
        # nodes, every GPU at once on the NICs they share, beside the rest inside the node
        near = member * (np.minimum(u, gpus) - 1) / u * per_row / bandwidth
        across = np.maximum(u - gpus, 0) / u
        far = member * across * per_row / self.cost.link_bandwidth(LinkKind.INTER_NODE)
        latency = np.where(across > 0, self.cost.link_latency(LinkKind.INTER_NODE), latency)
        moved = np.maximum(near, far)
        forward = 2 * latency + moved * forward_row / per_row
        projections = member * self._projections_per_token_s
        exchange = exposed_exchange(forward, 4 * latency + moved - forward, projections,
                                    self.ulysses_pieces)  # fmt: skip
        return member, exchange, u

    def usp_widths(self) -> tuple[int, ...]:
        """`usp_widths` of the model's shape on its topology."""
        return usp_widths(self.shape, self.cost.topology)


def ulysses_row_bytes(shape: ModelShape, u: np.ndarray | int, forward: bool = False) -> np.ndarray:
    """Bytes of one token's row, every head, through a step's four Ulysses all-to-alls
    among `u` members (a member sends (U - 1) / U of them to the others): Q/K/V in and
    the output out in the forward; the output's gradient in and dQ/dK/dV out in the
    backward, in float32 where members share K/V heads
    (`ray_zep.attention.ulysses.ulysses_gradient_dtype`; each member then gets one K/V
    head, so the row carries U of them). `forward`: the forward's two alone."""
    u = np.asarray(u)
    qkv = (shape.n_heads + 2 * np.maximum(shape.n_kv_heads, u)) * shape.head_dim
    out = shape.n_heads * shape.head_dim
    if forward:
        return (qkv + out) * BYTES_PER_ELEMENT
    gradient = np.where(u > shape.n_kv_heads, 4, BYTES_PER_ELEMENT)
    return (qkv + 2 * out) * BYTES_PER_ELEMENT + qkv * gradient


def exposed_exchange(forward, backward, projections, pieces: int):
    """(forward, backward) seconds of a USP member's all-to-alls, one layer, left exposed
    when they run in `pieces` beside the Q/K/V and output projections (`projections`:
    their forward seconds; the backward's are `BACKWARD_LINEAR_FACTOR` times): each
    phase hides what the projections cover of it, but a piece's share (the first piece
    of the way in, the last of the way out). One piece hides nothing. Contention
    between the pieces and the matmuls is left out, as for the ring's steps."""
    if pieces <= 1:
        return forward, backward
    hidden = 1.0 - 1.0 / pieces
    back = projections * BACKWARD_LINEAR_FACTOR
    return (forward - np.minimum(forward, projections) * hidden,
            backward - np.minimum(backward, back) * hidden)  # fmt: skip


def usp_widths(shape: ModelShape, topology: Topology) -> tuple[int, ...]:
    """Ulysses widths U a USP position may take, narrowest first, that split the model's
    heads evenly (`ModelShape.ulysses_fault`): the divisors of the GPUs per node above 1,
    and the GPUs of up to `WIDE_SPAN` whole nodes (the planner's and the step bound's)."""
    gpus = topology.gpus_per_node
    inside = [u for u in range(2, gpus + 1) if gpus % u == 0]
    wide = [gpus * s for s in range(2, min(WIDE_SPAN, topology.nodes) + 1) if gpus > 1]
    return tuple(u for u in [*inside, *wide] if shape.ulysses_fault(u) is None)
