"""A lower bound on the step of a batch: the compute no placement can shed and the K/V
exchange no placement can avoid.

The compute part spreads every FLOP evenly at unsplit rates, like the ideal step
(`ray_zep.sim.ideal`), but with no kernel call's fixed cost (one call may attend many
packed sequences) and each sequence's attention at the faster of the engine's and the
model's own kernel rates, so that no packing beats it.

A sequence longer than a GPU's (or a node's) token capacity must span several GPUs
(nodes), and then some of them must import K and V: among the GPUs a
sequence spans, order them by the latest token each holds. The last one holds the
sequence's final query, which attends to every key, so it imports at least the
tokens it does not hold, n - (what it holds) >= n - L; the one before it holds the
latest token of what remains, and imports at least n - 2L, and so on. So, per layer:

- one GPU imports at least max(0, n - L) tokens' K/V, and one node at least
  max(0, n - G x L) (G GPUs per node; L = `train.tokens_per_rank`);
- all GPUs together import at least sum over j >= 1 of max(0, n - j x L), all nodes
  sum over j of max(0, n - j x G x L); summed over the batch's sequences.

Those bytes cross in the forward (K and V, in the activation dtype); their dK/dV go
back in the backward (at best in the same dtype), a phase that cannot overlap the
forward. A GPU receives at most over its intra-node link and a NIC at once, a node
over all its NICs, the cluster over all nodes'. The exchange bound is the largest of
these four transfers, forward and backward, over every layer.

The weights mode's collectives are the same under every placement
(`ray_zep.sim.step.weights_of`; the backward's gather again over the node where the run
keeps its blocks sharded there, `parallel.reshard_to_node`): each block's, which compute
may hide, and those no
compute hides (before the first block, after the last). Where FSDP's groups span
nodes, a node's NICs carry both those collectives and the K/V it imports, so they
add there (`_shared_nics`): in the forward a node must receive every other node's
shard of each block it gathers, besides its K/V; in the backward it must send its
part of every other node's gradient shard besides its dK/dV (or receive the blocks
gathered again, unless `parallel.reshard_to_node` keeps that gather inside the node),
each direction of a NIC at its bandwidth; hsdp's per-block
all-reduce between the nodes' replicas crosses them in the backward.

While those per-block collectives run, they take SMs from the compute they overlap
(`ComputeRates.contention`): the simulator slows each linear module by the contention
over the shorter of its own time and half its phase's block collectives, under every
placement, and running them exposed instead would cost more. The bound counts the least
that can add for the mean rank (`_linear_contention`): a rank holding x linear tokens, at
most L, is slowed over at least x / L of what one holding L would be, min being concave.

A step's backward starts after its forward has ended (the loss needs every layer's
output), so the two phases add. Each phase lasts at least the largest of its own parts:
its share of the ideal compute (the forward's matmuls and attention, the backward's),
its exchange (K/V in the forward, dK/dV in the backward), its blocks' collectives and
its shared NIC time. The step's bound is the two phases' bounds together, plus the
exposed collectives, the optimizer's share and the step's fixed work. (Taking the
larger of the whole step's compute and its whole exchange instead would let a forward
bound by the NICs borrow the backward's compute to hide them.) Zipped collectives
(`comm.compression`) are counted at the codec's best ratio.

A ring position of U GPUs exchanging heads (USP: part of a node, a node, or s whole
nodes up to `WIDE_SPAN`) attends with H / U heads on each GPU (H / s on each node) for
the T <= U x L tokens it holds, and imports only those heads' K/V of the other n - T:
(n - T) / U tokens' K/V of every head on a GPU ((n - T) / s on a node). Before that its
all-to-all brings each holder its heads' Q, K and V of the position's tokens it does not
hold (or their hidden rows, if fewer bytes), at least T - L (T - G x L) tokens' worth.
The sum is linear in T, so least where the tail position holds one holder's tokens or as
many as it may (`_split_import`); each term takes the least over the U (s) the planner
may take (`ray_zep.partition.work.usp_widths`), all of them together at least the sum
over j of max(0, n - j x U x L) (max(0, n - j x s x G x L)) tokens' K/V of every head.

This holds for placements that move K and V to the queries (heads, with queries, only
inside a position of at most `WIDE_SPAN` nodes, as above) and hold at most L tokens a
rank: every placement here and the baselines modelled beside them but `ulysses`, whose
all-to-all spans every rank and is not covered by this argument (the tests play it
against the bound like every other variant). It is tight where the compute rules (short
sequences) and where one long sequence spans the fewest nodes it fits on.

Shapes: S sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ray_zep.costmodel import (
    BACKWARD_ATTENTION_FACTOR,
    BACKWARD_LINEAR_FACTOR,
    GRAD_BYTES_PER_ELEMENT,
    linear_flops_per_token,
    pointwise_elements_per_token,
)
from ray_zep.options import Compression
from ray_zep.parallel.axes import WEIGHTS_AXES, Family
from ray_zep.parallel.memory import mean_block_params
from ray_zep.partition.work import usp_widths
from ray_zep.sim.events import Lane
from ray_zep.sim.ideal import fixed_seconds
from ray_zep.sim.idle import TRANSFERS, WAITS, idle_causes
from ray_zep.sim.layer_work import POINTWISE_SHARES, linear_part_seconds
from ray_zep.sim.step import RunModel, StepResult, head_seconds, weights_of
from ray_zep.sim.weights import WeightsCost
from ray_zep.sim.wire import ZIP_RATIOS


@dataclass(frozen=True)
class StepBound:
    """The bound of one batch and what sets it.

    Attributes:
        seconds: the bound.
        compute_s: the batch's compute spread evenly at unsplit rates (forward,
            backward and the head), with the least the weights' per-block collectives
            slow the linear modules they overlap.
        contention_s: that least slowdown (part of `compute_s`).
        exchange_s: the K/V every placement must move, forward and backward.
        weights_s: the weights mode's per-block collectives, every block.
        fixed_s: the collectives no compute hides, the optimizer's share and the step's
            fixed work.
        limit: what sets the exchange ("gpu", "node", "cluster gpus", "cluster nodes";
            "none" for a batch that fits without any).
        shared_nics_s: the busiest importing node's NICs, busy with its K/V and with
            FSDP's per-block collectives where those span nodes (`_shared_nics`).
        phases: the forward's and the backward's part of the bound: in each, the
            largest of its compute, its exchange, its blocks' collectives and its
            shared NIC time (the totals above are both phases').
        setting: which of those sets each phase, forward and backward.
    """

    seconds: float
    compute_s: float
    exchange_s: float
    weights_s: float
    fixed_s: float
    limit: str
    shared_nics_s: float = 0.0
    contention_s: float = 0.0
    phases: tuple[float, float] = (0.0, 0.0)
    setting: tuple[str, str] = ("compute", "compute")

    @property
    def exchange_bound(self) -> bool:
        """The exchange outweighs the compute and the weights over the whole step."""
        return self.exchange_s > max(self.compute_s, self.weights_s)

    @property
    def largest(self) -> str:
        """What sets the bound: the part that sets both phases, or each phase's (`forward:
        ..., backward: ...`), or what no compute hides where that outweighs them."""
        if self.fixed_s > sum(self.phases):
            return "exposed collectives, optimizer and fixed work"
        forward, backward = self.setting
        return forward if forward == backward else f"forward: {forward}, backward: {backward}"


def step_bound(lengths: np.ndarray, run: RunModel) -> StepBound:
    """The lower bound on the step of a batch of sequences of `lengths` under `run`
    (module docstring)."""
    fixed = fixed_seconds(run)
    compute = _unsplit_compute(lengths, run)  # (forward, backward)
    topology = run.hardware.topology
    capacity = run.config.train.tokens_per_rank
    gpus = topology.gpus_per_node
    gpu_in = topology.intra_node_bandwidth + topology.nic_bandwidth
    node_in = topology.nics_per_node * topology.nic_bandwidth
    lengths = np.asarray(lengths, dtype=np.int64)
    # a GPU (node) of a USP position holds H / U (H / s) of the heads (`_split_import`)
    widths = (1, *usp_widths(run.shape, topology))
    spans = (1, *(u // gpus for u in widths if u > gpus))
    # tokens, for the NICs below too
    node_import = min(_split_import(lengths, gpus * capacity, s, run) for s in spans)
    seconds = {
        "gpu": min(_split_import(lengths, capacity, u, run) for u in widths) / gpu_in,
        "node": node_import / node_in,
        "cluster gpus": min(_all_imports(lengths, u * capacity) for u in widths)
        / (topology.world_size * gpu_in),
        "cluster nodes": min(_all_imports(lengths, s * gpus * capacity) for s in spans)
        / (topology.nodes * node_in),
    }
    limit = max(seconds, key=seconds.__getitem__)
    shape = run.shape
    ratio = _best_zip_ratio(run)
    token_bytes = 2 * shape.n_kv_heads * shape.head_dim * run.element_bytes / ratio
    # K and V in the forward, their gradients back in the backward: each phase moves them
    exchange = shape.n_layers * token_bytes * seconds[limit]
    if exchange <= 0:
        limit = "none"
    blocks = shared = contention = (0.0, 0.0)
    if WEIGHTS_AXES[run.config.parallel.weights].family is Family.AUTOGRAD:
        paid = weights_of(run)  # weight passing: its own model, counted as nothing here
        blocks = tuple(shape.n_layers * s for s in paid.layer_sync)
        fixed += paid.exposed
        shared = _shared_nics(run, paid, shape.n_layers * token_bytes * node_import, ratio)
        contention = _linear_contention(float(lengths.sum()), run, paid.layer_sync)
        compute = tuple(c + extra for c, extra in zip(compute, contention, strict=True))
    names = ("compute", f"K/V exchange ({limit})", "weight collectives",
             "K/V and weight collectives on one node's NICs")  # fmt: skip
    parts = [(compute[p], exchange, blocks[p], shared[p]) for p in (0, 1)]
    phases = tuple(max(part) for part in parts)
    setting = tuple(names[int(np.argmax(part))] for part in parts)
    return StepBound(sum(phases) + fixed, sum(compute), 2 * exchange, sum(blocks), fixed, limit,
                     sum(shared), sum(contention), phases, setting)  # fmt: skip


def _best_zip_ratio(run: RunModel) -> float:
    """What bytes on a wire shrink by at best: the codec's best ratio where the run zips
    collectives, else 1."""
    if run.config.comm.compression is Compression.OFF:
        return 1.0
    return max(ZIP_RATIOS.values())


def _shared_nics(
    run: RunModel, paid: WeightsCost, node_kv: float, ratio: float
) -> tuple[float, float]:
    """Seconds the NICs of the node importing the most K/V are busy with it and with
    FSDP's per-block collectives (module docstring), forward and backward, `node_kv` its
    K/V bytes per phase.
    The first block's gather and the last one's reduce-scatter (hsdp: all-reduce) are
    exposed (counted in the bound's fixed part), so n - 1 blocks are counted in each
    phase. hsdp across nodes crosses them in the backward only: each block's gradient
    all-reduced with the other nodes' replicas, of which a node must receive, and send,
    at least (N - 1) / N. 0 where every collective stays inside a node."""
    topology, shape = run.hardware.topology, run.shape
    groups = paid.groups
    nodes = np.asarray([topology.node_of(r) for r in groups[0]]) if groups else np.zeros(1)
    foreign = int((nodes != nodes[0]).sum())  # the group's ranks on other nodes
    block = mean_block_params(shape)
    blocks = shape.n_layers - 1
    node_bytes_s = topology.nics_per_node * topology.nic_bandwidth
    if not foreign:
        if not paid.backward_groups:
            return 0.0, 0.0
        share = (topology.nodes - 1) / topology.nodes
        replicas = blocks * share * block * GRAD_BYTES_PER_ELEMENT / ratio  # each way
        return node_kv / node_bytes_s, (node_kv + replicas) / node_bytes_s
    shard = block / nodes.size
    gathered = blocks * foreign * shard * run.element_bytes / ratio  # received per phase
    scattered = blocks * foreign * shard * GRAD_BYTES_PER_ELEMENT / ratio  # sent
    again = run.config.parallel.reshard_after_forward and not paid.regather_in_node
    regathered = gathered if again else 0.0
    forward = node_kv + gathered
    backward = max(node_kv + scattered, regathered)
    return forward / node_bytes_s, backward / node_bytes_s


def _unsplit_compute(lengths: np.ndarray, run: RunModel) -> tuple[float, float]:
    """Seconds of the batch's forward and of its backward spread evenly over the ranks:
    every matmul and element-wise pass at its rate (the element-wise work split between
    the phases as the layer graph splits it, `POINTWISE_SHARES`), every sequence's causal
    attention whole at
    the fastest kernel rate for its length, no call overheads, the head."""
    rates, shape, world = run.hardware.rates, run.shape, run.hardware.devices
    n = np.asarray(lengths, dtype=np.float64)
    flops = 4.0 * shape.n_heads * shape.head_dim * n * (n + 1) / 2

    def fastest(backward: bool) -> np.ndarray:
        return np.maximum(*(rates.attention_rates(n, True, backward, autograd)
                            for autograd in (False, True)))  # fmt: skip

    tokens = float(n.sum())
    matmul = tokens * sum(linear_flops_per_token(shape)) * shape.n_layers / rates.matmul
    pointwise = shape.n_layers * rates.pointwise_seconds(
        tokens * pointwise_elements_per_token(shape)
    )
    head = head_seconds(tokens, shape, rates) / (1 + BACKWARD_LINEAR_FACTOR)  # its forward
    attention = [float((flops / fastest(b)).sum()) * shape.n_layers for b in (False, True)]
    forward = matmul + head + sum(POINTWISE_SHARES[0]) * pointwise + attention[0]
    backward = (BACKWARD_LINEAR_FACTOR * (matmul + head) + sum(POINTWISE_SHARES[1]) * pointwise
                + BACKWARD_ATTENTION_FACTOR * attention[1])  # fmt: skip
    return forward / world, backward / world


def _linear_contention(
    tokens: float, run: RunModel, layer_sync: tuple[float, float]
) -> tuple[float, float]:
    """The least seconds, forward and backward, that a block's collectives (`layer_sync`,
    each phase's) add to the mean rank's linear modules over `tokens` spread on every rank
    (module docstring): each module of a rank holding x tokens is slowed by contention - 1
    times min(t(x), s), t its time alone, s half the phase's collectives; t is linear in x
    and x <= L, so min(t(x), s) >= t(x) min(1, s / t(L)), whose mean over the ranks is
    that of the mean rank."""
    rates, shape = run.hardware.rates, run.shape
    capacity = run.config.train.tokens_per_rank
    mean = tokens / run.hardware.devices
    elements = pointwise_elements_per_token(shape)
    out = []
    for phase, factor in ((0, 1.0), (1, BACKWARD_LINEAR_FACTOR)):
        half = layer_sync[phase] / 2
        seconds = 0.0
        for flops, share in zip(linear_flops_per_token(shape), POINTWISE_SHARES[phase],
                                strict=True):  # fmt: skip
            full = linear_part_seconds(capacity, flops, share * elements, rates, factor)
            seconds += full * mean / capacity * (min(1.0, half / full) if full > 0 else 0.0)
        out.append((rates.contention - 1.0) * shape.n_layers * seconds)
    return out[0], out[1]


def _split_import(lengths: np.ndarray, holds: int, split: int, run: RunModel) -> float:
    """Tokens' K/V of every head the busiest holder of `holds` tokens receives for one
    sequence where the heads are split over `split` holders (module docstring): the tail
    position's K/V of the others, 1 / `split` of the heads, and its all-to-all, each
    holder receiving its heads' Q, K and V (or the hidden rows, if fewer bytes) of the
    position's tokens it does not hold; least where the position holds either one
    holder's tokens or as many as it may."""
    largest = float(lengths.max(initial=0))
    if split == 1:
        return max(largest - holds, 0.0)
    shape = run.shape
    kv = 2 * shape.n_kv_heads * shape.head_dim
    swapped = min((shape.n_heads + 2 * shape.n_kv_heads) * shape.head_dim / split, shape.dim)
    held = min(largest, split * holds)  # tokens the tail position holds at most
    fewest = max(largest - holds, 0.0) / split
    most = max(largest - held, 0.0) / split + max(held - holds, 0.0) * swapped / kv
    return min(fewest, most)


def _all_imports(lengths: np.ndarray, holds: int) -> float:
    """Tokens all holders of `holds` tokens each import together: sum over sequences
    and j >= 1 of max(0, n - j x holds), in closed form (m = ceil(n / holds) - 1 full
    terms)."""
    n = lengths.astype(np.float64)
    m = np.maximum(np.ceil(n / holds) - 1, 0)
    return float((m * n - holds * m * (m + 1) / 2).sum())


def over_bound(step: StepResult, bound: StepBound, n_layers: int) -> dict[str, float] | None:
    """Where a simulated step's time beyond its bound goes (seconds; None when its layer
    timelines are not the whole step's, as in the baselines' waves and scheduled
    micro-batches):

    - imbalance: the most computing rank's compute over the mean rank's;
    - split kernels: the mean rank's compute over the bound's, its contention apart
      (split blocks' lower kernel rates, the engine's per-row work and call overheads);
    - contention: what the mean rank's compute is slowed by while communication kernels
      share its GPU (`ComputeRates.contention`: the weights' collectives over its linear
      modules, a ring's messages over its steps; `TaskGraph.slowed`) beyond the least the
      bound counts (a ring played on arrays, `ray_zep.sim.ring_form`, keeps its own in
      split kernels);
    - exposed transfers: the layers' time the most computing rank does not compute
      because a message or collective it needs is still moving (K/V, dK/dV, the
      weights' collectives, the Ulysses and remap exchanges; `ray_zep.sim.idle`);
    - waits: the rest of the time it does not compute: waits on slower ring peers and,
      after its own last task, on the layer's slowest rank (a ring the simulator plays
      on arrays, `ray_zep.sim.ring_form`: 64 members or more, unrouted, no Ulysses, is
      one task per member, so its transfers and waits count as that member's compute),
      less what the ranks' running ahead of one another across layers saves
      (`StepResult.drift_seconds`, `ray_zep.sim.drift`);
    - recompute: what backward recomputes under the run's activation checkpointing
      (`StepResult.recompute_seconds`: the fullest rank's memory decides it; the bound
      leaves it out, since micro-batches holding fewer tokens at once may need none,
      `ray_zep.sim.micro_step`);
    - rest: everything else (the optimizer beyond its ideal share, the experts'
      all-to-alls; negative where the exchange or the weights set the bound, which the
      compute then partly hides).

    A step of several micro-batches (`StepResult.micro_steps`) runs them one after
    another: each part is the sum of the micro-batches' own (imbalance, transfers and
    waits each micro-batch's busiest rank's), and the rest holds the weights'
    collectives and fixed work they repeat.
    """
    own = [_busiest_rank_parts(one, n_layers) for one in step.micro_steps or (step,)]
    if any(one is None for one in own):
        return None
    parts = {key: float(sum(one[key] for one in own)) for key in own[0]}
    parts["contention"] -= bound.contention_s
    parts["split kernels"] = parts.pop("mean compute") - bound.compute_s - parts["contention"]
    parts = {key: parts[key] for key in PARTS}
    parts["rest"] = step.step_seconds - bound.seconds - sum(parts.values())
    return parts


PARTS = ("imbalance", "split kernels", "contention", "exposed transfers", "waits", "recompute")
"""`over_bound`'s parts, before the rest."""


def _busiest_rank_parts(step: StepResult, n_layers: int) -> dict[str, float] | None:
    """One batch's step: its most computing rank's compute over the mean rank's, the mean
    rank's compute with the head and what contention adds to it, that rank's exposed
    transfers and waits, and the recomputation (seconds); None where the timelines are
    not the whole step's."""
    if not step.timelines_whole:
        return None
    ranks = range(len({t.rank for t in step.forward.graph.tasks}))
    compute = np.asarray([step.forward.busy(r, Lane.COMPUTE) + step.backward.busy(r, Lane.COMPUTE)
                          for r in ranks]) * n_layers  # fmt: skip
    busiest = int(compute.argmax())
    idle = [idle_causes(timeline, busiest) for timeline in (step.forward, step.backward)]
    slowed = sum(sum(t.graph.slowed.values()) for t in (step.forward, step.backward))
    return {
        "imbalance": float(compute.max() - compute.mean()),
        "mean compute": float(compute.mean() + step.head_seconds),
        "contention": n_layers * slowed / len(ranks),
        "exposed transfers": n_layers * sum(one[TRANSFERS] for one in idle),
        "waits": n_layers * sum(one[WAITS] for one in idle) - step.drift_seconds,
        "recompute": step.recompute_seconds,
    }
