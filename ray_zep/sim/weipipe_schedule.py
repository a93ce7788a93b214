"""WeiPipe's staggered weight-passing schedule on a `Hardware` cluster: the TawPipe
paper's baseline.

ray_zep does not execute this schedule (its ring baseline, `parallel.weights=
ring_relay`, relays each shard hop by hop while every device waits; see
`ray_zep.sim.weight_passing`). This module models WeiPipe as its public code runs
it (github.com/Gvilenius/weipipe, `weipipe.py`, class `WeiPipe`:
`forward_backward_step`, `_forward`, `_backward`, `grad_flow`, `flow_op`,
`grad_swap`, `update`), so that TawPipe's headline, which the paper measures
against that code (TawPipe, AAAI '26, arXiv 2511.09741: "Weight-Passing Pipeline
Parallelism (WeiPipe)" among the limitations of prior work, and the "Theoretical
Analysis" table: bubble (P-1)/(N+P-1), two weight buffers, 36 H^2 per step),
compares like with like.

The schedule on P devices, G micro-batches per device:

- the decoder blocks are cut into P chunks (`config.n_layers //= world_size`);
  every device trains its own micro-batches through all of them, each chunk's
  weights arriving from a ring neighbour;
- device r starts r slots late (`warmup-idle`); in slot k it runs a chunk's
  forward when r <= k < G P + r and a chunk's backward when P + r <= k <
  G P + P + r (`warmup_stage`, `acc_stage`, `cooldown_stage`, the last loop), so
  in the steady state every slot holds one forward and one backward; backward
  recomputes the chunk (the blocks are checkpointed: `CHECKPOINTING=1`), so it
  costs about three forwards;
- each slot posts, per ring link, a forward-weight shard to rank + 1
  (`weight0`, slots 0 to G P + P - 3), a backward-weight shard to rank - 1
  (`weight1`) and a gradient shard to rank + 1 (`grad`, both slots P to
  G P + 2 P - 3), all fp16, and waits for them in the next slot, so they overlap
  one slot of compute (the last slot of each kind posts nothing: `n_forward`,
  `n_backward` wrap to 0);
- the embedding and head are replicated: every device runs them once per
  micro-batch (`preprocess`, `calc_grad`) and all-reduces their gradients at the
  end (`update`, with `TRAIN_EMBEDDING=1` as its scripts set); the chunk
  gradients end with a swap between ranks r and P + 1 - r (`grad_swap`).

A slot ends when every device has its neighbours' shards, so the devices move
from slot to slot together: a slot lasts the longer of the busiest device's
compute in it and the slowest ring link's transfers. A link inside a node runs at
the GPU's intra-node bandwidth; the ring links that leave a node share its NICs
(full duplex: the forward-direction links carry two shards per slot, the
backward-direction ones one). With free links and G >= 2 the step lasts G P + P - 1
slots of one forward and one backward, against G P of work: WeiPipe's bubble
(P - 1) / (G P + P - 1), the paper's formula with N = G P micro-batches.

Modelling choices (each favours WeiPipe or leaves it as its code runs):

- the head's compute is spread over the micro-batch's P chunks: in the code one
  device runs it per slot, staggered like the chunks, and its neighbours only
  wait for its posts, not for its compute;
- the micro-batch size is the fastest of those that split the device's sequences
  evenly and fit its memory (`fastest_weipipe`, `micro_batch_that_fits`), as the
  paper sizes micro-batches to memory; matmuls run at one rate whatever the
  micro-batch size, so small ones are not penalised;
- `weight_flow` skips the exchange of every P-th forward slot of a device (it
  reloads its own chunk); the devices skip in different slots, so the slowest
  link still carries three shards per slot, and the model counts every slot's;
- the optimizer step is not timed (nor is it in `weight_passing`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ray_zep.model_shapes import ModelShape
from ray_zep.sim.hardware import Hardware
from ray_zep.sim.weight_passing import (
    ACTIVATION_BYTES_PER_TOKEN_LAYER,
    LOGIT_BYTES,
    OPTIMIZER_BYTES,
    WEIGHT_BYTES,
    StepModel,
    Workload,
    shard_compute,
    unit_sizes,
)


@dataclass(frozen=True)
class ChunkTimes:
    """Seconds of one slot's work on one device for one micro-batch.

    Attributes:
        forward: a chunk's forward, with its share of the head's forward.
        backward: a chunk's backward (and its recompute), with its share of the
            head's backward.
    """

    forward: float
    backward: float


def chunk_blocks(blocks: int, devices: int) -> int:
    """Blocks in the largest chunk (WeiPipe needs `devices` to divide `blocks`; the
    largest chunk sets the pace otherwise)."""
    return -(-blocks // devices)


def chunk_times(work: Workload, c: Hardware, micro_batches: int) -> ChunkTimes:
    """One micro-batch's (a 1 / `micro_batches` share of `work`) chunk times."""
    micro = Workload(work.shape, work.lengths, work.share / micro_batches, work.recompute)
    p, blocks = c.devices, work.shape.n_layers
    forward, backward = shard_compute(micro, c.rates, range(1, 1 + chunk_blocks(blocks, p)))
    head_forward, head_backward = shard_compute(micro, c.rates, range(blocks + 1, blocks + 2))
    if work.recompute:
        backward += forward
    return ChunkTimes(forward + head_forward / p, backward + head_backward / p)


@dataclass(frozen=True)
class SlotLinks:
    """One slot's transfers: (seconds, NIC bytes summed over nodes, intra-node bytes
    summed over GPUs)."""

    seconds: float
    inter_bytes: float
    intra_bytes: float


def slot_links(c: Hardware, shard_bytes: float, ahead: int, back: int) -> SlotLinks:
    """Every device sends `ahead` shards to rank + 1 and `back` shards to rank - 1.

    A node's NICs carry the shards of its ring links that leave it; a GPU's
    intra-node link those to neighbours on its node. The slot lasts as long as the
    busiest NIC or intra-node link (with one message latency).
    """
    p, g = c.devices, c.gpus_per_node
    nic = np.zeros(c.nodes)
    intra = np.zeros(p)
    for src in range(p if p > 1 else 0):
        for dst, count in (((src + 1) % p, ahead), ((src - 1) % p, back)):
            if dst // g != src // g:
                nic[src // g] += count * shard_bytes
            else:
                intra[src] += count * shard_bytes
    seconds = 0.0
    if nic.max(initial=0.0) > 0:
        seconds = nic.max() / c.node_nic_bandwidth + c.inter_latency
    if intra.max(initial=0.0) > 0:
        seconds = max(seconds, intra.max() / c.intra_bandwidth + c.intra_latency)
    return SlotLinks(seconds, float(nic.sum()), float(intra.sum()))


def slot_compute(devices: int, micro_batches: int, times: ChunkTimes) -> np.ndarray:
    """Seconds of each slot's busiest device (slots 0 to G P + 2 P - 2)."""
    p, g = devices, micro_batches
    slot = np.arange(g * p + 2 * p - 1)[None, :]
    rank = np.arange(p)[:, None]
    forward = (rank <= slot) & (slot < g * p + rank)
    backward = (p + rank <= slot) & (slot < g * p + p + rank)
    return (forward * times.forward + backward * times.backward).max(axis=0)


def slot_shards(devices: int, micro_batches: int) -> tuple[np.ndarray, np.ndarray]:
    """Shards each device sends per slot to rank + 1 (forward weights and gradients)
    and to rank - 1 (backward weights)."""
    p, g = devices, micro_batches
    slot = np.arange(g * p + 2 * p - 1)
    backward = ((p <= slot) & (slot < g * p + 2 * p - 2)).astype(int)
    return (slot < g * p + p - 2) + backward, backward


def _tail(c: Hardware, shard_bytes: float, replicated_bytes: float) -> SlotLinks:
    """The step's end: the gradient swap between ranks r and P + 1 - r, then the ring
    all-reduce of the replicated embedding and head gradients."""
    p, g = c.devices, c.gpus_per_node
    if p == 1:
        return SlotLinks(0.0, 0.0, 0.0)
    nic = np.zeros(c.nodes)
    intra = 0.0
    for src in range(p):
        dst = (p + 1 - src) % p
        if dst // g != src // g:
            nic[src // g] += shard_bytes
        elif dst != src:
            intra += shard_bytes
    swap = max(
        nic.max() / c.node_nic_bandwidth + c.inter_latency if nic.max() > 0 else 0.0,
        shard_bytes / c.intra_bandwidth + c.intra_latency if intra > 0 else 0.0,
    )
    # a ring all-reduce sends 2 (P - 1) / P of the buffer over every ring link
    moved = 2 * (p - 1) / p * replicated_bytes
    if c.nodes > 1:
        reduce = moved / c.node_nic_bandwidth + 2 * (p - 1) * c.inter_latency
        inter, inner = c.nodes * moved, (p - c.nodes) * moved
    else:
        reduce = moved / c.intra_bandwidth + 2 * (p - 1) * c.intra_latency
        inter, inner = 0.0, p * moved
    return SlotLinks(swap + reduce, float(nic.sum()) + inter, intra + inner)


def simulate_weipipe(work: Workload, c: Hardware, micro_batches: int) -> StepModel:
    """One step of WeiPipe's schedule (module docstring) with `micro_batches` per device.

    Args:
        work: what one device trains per step; each micro-batch takes an equal share.
        c: the cluster; all its GPUs form the ring, node by node.
        micro_batches: G, micro-batches per device (>= 1).

    Returns:
        The step of one device: seconds, compute seconds, bytes per step (NIC bytes
        summed over nodes, intra-node bytes over GPUs) and tokens.

    Raises:
        ValueError: `micro_batches` < 1.
    """
    if micro_batches < 1:
        raise ValueError(f"micro_batches={micro_batches} must be >= 1")
    p, g = c.devices, micro_batches
    sizes = unit_sizes(work.shape)
    shard_bytes = WEIGHT_BYTES * sizes[1] * chunk_blocks(work.shape.n_layers, p)
    times = chunk_times(work, c, g)
    compute = slot_compute(p, g, times)
    ahead, back = slot_shards(p, g)
    pairs = [(int(a), int(b)) for a, b in zip(ahead, back, strict=True)]
    links = {pair: slot_links(c, shard_bytes, *pair) for pair in set(pairs)}
    slots = [links[pair] for pair in pairs]
    seconds = float(np.maximum(compute, [s.seconds for s in slots]).sum())
    tail = _tail(c, shard_bytes, WEIGHT_BYTES * (sizes[0] + sizes[-1]))
    return StepModel(
        seconds=seconds + tail.seconds,
        compute_seconds=g * p * (times.forward + times.backward),
        inter_bytes=sum(s.inter_bytes for s in slots) + tail.inter_bytes,
        intra_bytes=sum(s.intra_bytes for s in slots) + tail.intra_bytes,
        tokens=work.tokens,
    )


def weipipe_bubble(devices: int, micro_batches: int) -> float:
    """WeiPipe's bubble with free links: (P - 1) / (G P + P - 1)."""
    p, g = devices, micro_batches
    return (p - 1) / (g * p + p - 1)


def fastest_weipipe(work: Workload, c: Hardware, most: int) -> tuple[int, StepModel] | None:
    """WeiPipe at its fastest micro-batch count G whose micro-batches hold equal whole
    numbers of the device's sequences, at most `most` each.

    Returns:
        (G, the step), or None when no such G exists.
    """
    count = len(work.lengths)
    options = [g for g in range(1, count + 1) if count % g == 0 and count // g <= most]
    steps = [(g, simulate_weipipe(work, c, g)) for g in options]
    return min(steps, key=lambda pair: pair[1].seconds) if steps else None


def micro_batch_that_fits(
    shape: ModelShape, seq_len: int, c: Hardware, recompute: bool = True, most: int = 64
) -> int:
    """Sequences per WeiPipe micro-batch whose training fits `c.usable_memory_bytes`
    (0: none).

    Counts the own chunk in float32 with its gradient and Adam moments, its fp16 copy
    and the six fp16 ring buffers (`Buffer` twice for forward weights, backward
    weights and gradients), the replicated embedding and head with their optimizer
    state and fp16 copy; and per token one micro-batch's fp16 inputs of every block
    and every chunk boundary (while a device's backward frees one micro-batch's
    chunks its forward fills the next one's), the activations of one block
    (recompute) or of every block, and the head's logits.
    """
    sizes = unit_sizes(shape)
    chunk = sizes[1] * chunk_blocks(shape.n_layers, c.devices)
    fixed = (OPTIMIZER_BYTES + 7 * WEIGHT_BYTES) * chunk
    fixed += (OPTIMIZER_BYTES + WEIGHT_BYTES) * (sizes[0] + sizes[-1])
    per_token = WEIGHT_BYTES * shape.dim * (shape.n_layers + c.devices)
    blocks = 1 if recompute else shape.n_layers
    per_token += ACTIVATION_BYTES_PER_TOKEN_LAYER * shape.dim * blocks
    per_token += LOGIT_BYTES * shape.vocab_size
    room = c.usable_memory_bytes - fixed
    return max(0, min(most, int(room // (per_token * seq_len))))
