"""Step time of the weight-passing executor (`ray_zep.pipeline.runner`) on a `Hardware` cluster.

The model plays the runner's program on one device; devices run it in lockstep
(each transfer involves all of them), so one timeline stands for all. Two
link resources per device, the node's NIC (shared by its GPUs) and the GPU's
intra-node link, serve transfers first-come first-served; a transfer takes
`latency x hops + bytes / bandwidth` (NCCL's pipelined ring for broadcast and
reduce). The compute stream waits where the runner waits.

What each mode's transport costs (B: shard bytes, D nodes, G GPUs each):

- tawpipe: fetch = broadcast over the owner's rail (D devices, B per NIC,
  async), then a broadcast in the node (B per GPU, blocking when the shard is
  taken); gradient = reduce in the node (async), then over the rail (async,
  posted one shard later).
- fsdp: the comparison the TawPipe paper draws: every unit all-gathered over
  all GPUs before it computes (forward, and again in backward) and its
  gradient reduce-scattered, each one pipelined ring collective moving B per
  NIC, async. ray_zep trains this mode with torch's FSDP2 (parallel.weights=
  fsdp), which runs the same collectives per transformer block.
- ring_relay: the executor's ring relay is store and forward: the owner's send
  runs async, every further hop waits for the one before, while the devices
  wait in the runner (P - 2 hops on the compute stream, for shards and for
  gradients). It is not WeiPipe's staggered schedule (there the devices run
  different chunks at once and every ring link carries shards each time
  slot), which the executor does not run; `ray_zep.sim.weipipe_schedule`
  models that one, as the TawPipe paper's baseline.

Shards and gradients travel as the executor sends them: in the compute dtype (bf16
on a GPU, `ShardWire.value_bytes`; float32 master weights stay with their owner).
With `comm.compression` on (`ShardWire.codec`) the executor chains every transfer
through point-to-point messages (`ray_zep.pipeline.transport`): a grouped broadcast
or reduce becomes a store-and-forward chain through its members, each hop plain or
zipped as the switcher's cost rule decides (`ray_zep.sim.wire.WireCodec`); a shard
is coded once at its owner and decoded at every hop (each member waits for it
whole before passing it on), a gradient sum is coded and decoded at every hop. Memory
(`sequences_that_fit`) counts the own shard with its gradient and Adam moments,
the borrowed shard (float32 parameters), the staging buffer and the gradients
in flight (bf16), every shard boundary and one shard's activations (recompute on).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ray_zep.collectives.switcher import Kind
from ray_zep.config import Compression, TopologyConfig
from ray_zep.costmodel import (
    BACKWARD_ATTENTION_FACTOR,
    BACKWARD_LINEAR_FACTOR,
    ComputeRates,
    causal_attention_flops,
    head_flops_per_token,
    linear_flops_per_token,
    pointwise_elements_per_token,
)
from ray_zep.model_shapes import ModelShape
from ray_zep.options import CompressionStream
from ray_zep.parallel.axes import WEIGHTS_AXES, Passing, WeightsMode
from ray_zep.parallel.pipeline_layout import WeightLayout
from ray_zep.pipeline.messages import Message, fetch_messages, reduce_messages
from ray_zep.sim.hardware import Hardware
from ray_zep.sim.wire import PLAIN, Stream, WireCodec
from ray_zep.topology import build_topology

WEIGHT_BYTES = 2
"""Shards and gradients travel in the compute dtype, bf16 (`ShardedWeights`)."""
PARAM_BYTES = 4
"""A borrowed shard's parameters and the shard boundaries are float32."""
ACTIVATION_BYTES_PER_TOKEN_LAYER = 34
"""Activation bytes of one block per token per unit of model dim, bf16 with flash
attention (Korthikanti et al., 2022: 34 s b h, the 5 a s^2 b term gone)."""
OPTIMIZER_BYTES = 16
"""Own shard per parameter: float32 weight, gradient and two Adam moments."""


def tawpipe_testbed() -> Hardware:
    """TawPipe's testbed: topology preset `tawpipe_a100` (3 x 8 GPUs, 10 GbE) with the
    A100 preset rates."""
    return Hardware.preset(build_topology(TopologyConfig(preset="tawpipe_a100", nodes=3)))


@dataclass(frozen=True)
class Workload:
    """What one device trains per step.

    Attributes:
        shape: the model.
        lengths: sequence lengths (the device's own, or a global batch with `share`).
        share: the device's fraction of `lengths` (1 / devices for a global batch).
        recompute: `parallel.shard_recompute`.
    """

    shape: ModelShape
    lengths: tuple[int, ...]
    share: float = 1.0
    recompute: bool = True

    @property
    def tokens(self) -> float:
        return self.share * sum(self.lengths)

    def attention_flops(self) -> float:
        """Forward attention FLOPs of one block."""
        return self.share * sum(causal_attention_flops(n, self.shape) for n in self.lengths)


def unit_sizes(shape: ModelShape) -> list[int]:
    """Parameters of the runner's units: embedding, each block, norm + output."""
    block = shape.linear_params_per_layer() + 2 * shape.dim
    embedding = shape.vocab_size * shape.dim
    return [embedding, *[block] * shape.n_layers, embedding + shape.dim]


def shard_compute(work: Workload, rates: ComputeRates, units: range) -> tuple[float, float]:
    """(forward, backward) seconds of one shard on one device's tokens: matmuls, causal
    attention at the rate of each sequence's length, element-wise work."""
    shape, last = work.shape, work.shape.n_layers + 1
    before, after = linear_flops_per_token(shape)
    blocks = sum(1 <= unit <= shape.n_layers for unit in units)
    matmul = blocks * work.tokens * (before + after)
    if last in units:
        matmul += work.tokens * head_flops_per_token(shape)
    elements = blocks * work.tokens * pointwise_elements_per_token(shape)
    pointwise = rates.pointwise_seconds(elements)
    forward = matmul / rates.matmul + pointwise / 3
    backward = BACKWARD_LINEAR_FACTOR * matmul / rates.matmul + 2 * pointwise / 3
    for n in work.lengths:
        flops = blocks * work.share * causal_attention_flops(n, shape)
        forward += rates.attention_seconds(flops, n, True, False)
        backward += rates.attention_seconds(BACKWARD_ATTENTION_FACTOR * flops, n, True, True)
    return forward, backward


@dataclass(frozen=True)
class Transfer:
    """One shard's fetch or gradient sum under a weights mode.

    Attributes:
        posted: (link, seconds) parts that run async from the post, in order.
        blocking: (link, seconds) parts the compute stream waits out when it takes the
            shard (fetch) or relays the sum (gradient).
        relayed: (link, seconds) async parts posted at the relay (gradients only).
        inter_bytes: bytes over NICs, summed over the nodes.
        intra_bytes: bytes over intra-node links, summed over the GPUs.
    """

    posted: tuple[tuple[str, float], ...] = ()
    blocking: tuple[tuple[str, float], ...] = ()
    relayed: tuple[tuple[str, float], ...] = ()
    inter_bytes: float = 0.0
    intra_bytes: float = 0.0


@dataclass(frozen=True)
class ShardWire:
    """How shards and gradient sums travel (module docstring).

    Attributes:
        codec: ZipCCL as `comm.compression` sets it (`RunModel.codec`); PLAIN: off.
        value_bytes: bytes of a value in the compute dtype (2: bf16 on a GPU).
    """

    codec: WireCodec = PLAIN
    value_bytes: int = WEIGHT_BYTES

    @property
    def chained(self) -> bool:
        """Whether the executor sends every transfer as point-to-point messages."""
        return self.codec.mode is not Compression.OFF

    def hop(self, c: Hardware, link: str, size: float, gradient: bool, first: bool):
        """(link, seconds) of one message of `size` bytes: a shard's (coded at its
        owner: the `first` hop) or a gradient sum's (coded at every hop)."""
        latency, bandwidth = _link_rates(c, link)
        plain = latency + size / bandwidth
        stream = CompressionStream.SHARD_GRADIENTS if gradient else CompressionStream.WEIGHT_SHARDS
        if not self.codec.zips(stream.value):
            return link, plain
        coded = Stream(stream.value, self.value_bytes, gradient, encodes=gradient or first)
        profile = self.codec.message_profile(latency, bandwidth, coded.encodes, coded.decodes)
        return link, self.codec.seconds(plain, profile, Kind.ALL_TO_ALL, coded, size)

    def chain(self, c: Hardware, link: str, members: int, size: float, gradient: bool, first):
        """The hops of a chain through `members` devices (`first`: it starts at the owner)."""
        return tuple(
            self.hop(c, link, size, gradient, first and k == 0) for k in range(members - 1)
        )


def _link_rates(hw: Hardware, link: str) -> tuple[float, float]:
    """(latency in seconds, bytes/s) of a "nic" (the node's NICs) or "intra" link."""
    if link == "nic":
        return hw.inter_latency, hw.node_nic_bandwidth
    return hw.intra_latency, hw.intra_bandwidth


def _ring(hw: Hardware, members: int, size: float, link: str) -> float:
    """A pipelined ring broadcast or reduce over `members` devices."""
    if members <= 1:
        return 0.0
    latency, bandwidth = _link_rates(hw, link)
    return (members - 1) * latency + size / bandwidth


def _hop_link(hw: Hardware, src: int) -> str:
    """The link from device `src` to the next one around the ring."""
    crosses = (src + 1) % hw.devices // hw.gpus_per_node != src // hw.gpus_per_node
    return "nic" if crosses else "intra"


def _volume(messages: list[Message], size: float, gpus_per_node: int) -> dict[str, float]:
    inter = sum(size for src, dst in messages if src // gpus_per_node != dst // gpus_per_node)
    return {"inter_bytes": inter, "intra_bytes": len(messages) * size - inter}


def transfers(
    mode: WeightsMode,
    layout: WeightLayout,
    sizes: list[int],
    c: Hardware,
    shard: int,
    wire: ShardWire = ShardWire(),
) -> tuple[Transfer, Transfer]:
    """(fetch, gradient sum) of one shard."""
    size = wire.value_bytes * sum(sizes[u] for u in layout.units[shard])
    d, g, p = c.nodes, c.gpus_per_node, c.devices
    fetched = _volume(fetch_messages(layout, shard), size, g)
    summed = _volume(reduce_messages(layout, shard), size, g)
    if layout.passing is Passing.GROUPED and wire.chained:
        rail = wire.chain(c, "nic", d, size, False, True)
        node = wire.chain(c, "intra", g, size, False, d <= 1)
        gradient_node = wire.chain(c, "intra", g, size, True, True)
        gradient_rail = wire.chain(c, "nic", d, size, True, True)
        return (
            Transfer(posted=rail, blocking=node, **fetched),
            Transfer(posted=gradient_node, relayed=gradient_rail, **summed),
        )
    if layout.passing is Passing.GROUPED:
        rail, node = ("nic", _ring(c, d, size, "nic")), ("intra", _ring(c, g, size, "intra"))
        return (
            Transfer(posted=(rail,), blocking=(node,), **fetched),
            Transfer(posted=(node,), relayed=(rail,), **summed),
        )
    if WEIGHTS_AXES[mode].fsdp:
        link = "nic" if d > 1 else "intra"
        whole = (link, max(_ring(c, p, size, link), _ring(c, g, size, "intra")))
        return Transfer(posted=(whole,), **fetched), Transfer(posted=(whole,), **summed)
    owner = layout.owners[shard]
    fetch_hops = [
        wire.hop(c, _hop_link(c, (owner + k) % p), size, False, k == 0) for k in range(p - 1)
    ]
    sum_hops = [
        wire.hop(c, _hop_link(c, (owner + 1 + k) % p), size, True, True) for k in range(p - 1)
    ]
    return (
        Transfer(posted=tuple(fetch_hops[:1]), blocking=tuple(fetch_hops[1:]), **fetched),
        Transfer(posted=tuple(sum_hops[:1]), blocking=tuple(sum_hops[1:]), **summed),
    )


@dataclass
class _Links:
    """When each link is next free."""

    free: dict[str, float] = field(default_factory=lambda: {"nic": 0.0, "intra": 0.0})

    def run(self, parts: tuple[tuple[str, float], ...], start: float) -> float:
        """Run parts in order from `start`; returns when the last ends."""
        t = start
        for link, seconds in parts:
            t = max(t, self.free[link]) + seconds
            self.free[link] = t
        return t


@dataclass(frozen=True)
class StepModel:
    """One simulated step of one device.

    Attributes:
        seconds: step time.
        compute_seconds: time the compute stream computes.
        inter_bytes / intra_bytes: per step, summed over nodes / GPUs.
        tokens: one device's tokens per step.
    """

    seconds: float
    compute_seconds: float
    inter_bytes: float
    intra_bytes: float
    tokens: float

    @property
    def bubble(self) -> float:
        """Share of the step the compute stream waits."""
        return 1.0 - self.compute_seconds / self.seconds

    @property
    def tokens_per_gpu_s(self) -> float:
        return self.tokens / self.seconds


def simulate_step(
    mode: WeightsMode, work: Workload, c: Hardware, wire: ShardWire = ShardWire()
) -> StepModel:
    """The runner's program for one step (module docstring): tawpipe, ring_relay or fsdp,
    its shards and gradient sums on `wire` (the fsdp comparison's collectives stay plain)."""
    sizes = unit_sizes(work.shape)
    layout = WeightLayout.build(WEIGHTS_AXES[mode].passing, sizes, c.nodes, c.gpus_per_node)
    count = layout.shards
    if WEIGHTS_AXES[mode].fsdp:
        wire = ShardWire(value_bytes=wire.value_bytes)
    plan = [transfers(mode, layout, sizes, c, s, wire) for s in range(count)]
    compute = [shard_compute(work, c.rates, layout.units[s]) for s in range(count)]
    links, t, busy = _Links(), 0.0, 0.0
    ready: dict[int, float] = {}
    volume = [0.0, 0.0]

    def post_fetch(shard: int) -> None:
        ready[shard] = links.run(plan[shard][0].posted, t)
        volume[0] += plan[shard][0].inter_bytes
        volume[1] += plan[shard][0].intra_bytes

    def take(shard: int) -> float:
        return links.run(plan[shard][0].blocking, max(t, ready.pop(shard)))

    post_fetch(0)
    for shard in range(count):
        t = take(shard)
        ahead = shard + 1 if shard + 1 < count else count - 2
        if ahead >= 0:
            post_fetch(ahead)
        t += compute[shard][0]
        busy += compute[shard][0]
    sums = _Sums(plan, links, volume)
    for shard in reversed(range(count)):
        if shard < count - 1:
            t = take(shard)
            if shard >= 1:
                post_fetch(shard - 1)
        seconds = compute[shard][1]
        if work.recompute and shard < count - 1:
            seconds += compute[shard][0]
        t += seconds
        busy += seconds
        t = sums.after_backward(shard, t)
    t = sums.drain(t)
    return StepModel(t, busy, volume[0], volume[1], work.tokens)


@dataclass
class _Sums:
    """The runner's gradient sums: after each shard's backward the sum posted two
    shards ago lands, the one posted last time is relayed, and this one is posted."""

    plan: list[tuple[Transfer, Transfer]]
    links: _Links
    volume: list[float]
    flight: list[list] = field(default_factory=list)
    """[shard, posted part done, relayed part done or None], oldest first."""

    def after_backward(self, shard: int, t: float) -> float:
        if len(self.flight) == 2:
            t = self._land(t)
        if self.flight:
            t = self._relay(t)
        transfer = self.plan[shard][1]
        self.flight.append([shard, self.links.run(transfer.posted, t), None])
        self.volume[0] += transfer.inter_bytes
        self.volume[1] += transfer.intra_bytes
        return t

    def drain(self, t: float) -> float:
        while self.flight:
            t = self._land(t) if self.flight[0][2] is not None else self._relay(t)
        return t

    def _land(self, t: float) -> float:
        _, posted, relayed = self.flight.pop(0)
        return max(t, posted, relayed)

    def _relay(self, t: float) -> float:
        """Waits for the posted part when there is more to do, as the runner does."""
        entry = self.flight[0]
        transfer = self.plan[entry[0]][1]
        if transfer.blocking or transfer.relayed:
            t = self.links.run(transfer.blocking, max(t, entry[1]))
        entry[2] = self.links.run(transfer.relayed, t) if transfer.relayed else entry[1]
        return t


LOGIT_BYTES = 10
"""Per token per vocabulary entry at the head: bf16 logits, their float32 copy for
the loss and its gradient."""


def sequences_that_fit(
    shape: ModelShape, seq_len: int, c: Hardware, recompute: bool = True, most: int = 64
) -> int:
    """Sequences per device per step whose training fits `c.usable_memory_bytes` (0: none).

    Counts the largest shard as own (with gradient and Adam moments), borrowed and
    staging, three gradient sums in flight, the float32 shard boundaries, and the
    activations of one shard (recompute) or of every block, with the head's logits.
    """
    sizes = unit_sizes(shape)
    layout = WeightLayout.build(Passing.GROUPED, sizes, c.nodes, c.gpus_per_node)
    largest = max(sum(sizes[u] for u in units) for units in layout.units)
    fixed = (OPTIMIZER_BYTES + PARAM_BYTES + 4 * WEIGHT_BYTES) * largest
    blocks = max(len(units) for units in layout.units) if recompute else shape.n_layers
    per_token = PARAM_BYTES * shape.dim * layout.shards
    per_token += ACTIVATION_BYTES_PER_TOKEN_LAYER * shape.dim * blocks
    per_token += LOGIT_BYTES * shape.vocab_size
    room = c.usable_memory_bytes - fixed
    return max(0, min(most, int(room // (per_token * seq_len))))
