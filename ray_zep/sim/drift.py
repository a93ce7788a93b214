"""A step's layers with ranks running ahead of one another, as far as the weights'
collectives let them.

The layers repeat with identical work, so `ray_zep.sim.program` plays one forward and
one backward layer with every rank starting together. Played so n_layers times, a rank
waits at every layer for the layer's slowest, but the ranks that set the forward are not
those that set the backward: a rank of short whole sequences (linear modules: forward
1/3 of its work) is the forward's slowest, a ring member (attention: forward 1/3.5 of
its work) the backward's. On cluster A's 4k-token batches the forward's busiest rank
computes 1.14-1.17x the mean rank's forward, the backward's 1.04-1.06x.

What holds a rank back across layers is what it shares with others:

- ring and Ulysses peers (the ranks of one queue item, `AttentionPlan.items`) exchange
  K/V inside every layer: they move together, at the pace of their slowest (each such
  group of items sharing ranks is one *band* here, every lone rank its own);
- the remap all-to-all-v and the expert all-to-alls join every rank in every layer:
  with either, all ranks move together, as one band;
- FSDP2's all-gather of a block is posted `parallel.prefetch_depth` blocks ahead (torch
  `_fully_shard/_fsdp_state.py`, forward prefetch) and completes only once every rank
  of the group has posted it, so no rank starts block l before every rank has started
  block l - depth: here, more cautiously, block l - depth + 1 (depth 1: every layer
  together, as played);
- in backward FSDP2 waits for the previous block's reduce-scatter before posting the
  next (torch `_fsdp_param_group.py`, `post_backward`: the current stream waits on
  `reduce_scatter_state.event`), which needs every rank's backward of that block: a
  rank may lead by at most one block (none at depth 1).

So `drifting_layers` plays each band's n_layers forward and backward layers with its
own layer times (the latest of its ranks' ends in the layers played together) under
those leads; the step's layers end when the last band ends. Not counted: a gather posted
early waits on the GPU until the last rank posts it, its kernel holding a few SMs of a
rank that is ahead, which has the slack for it. Replicated weights (no
per-block collectives) and weight-passing modes stay in step here, as played.

Shapes: W ranks, B bands.
"""

from __future__ import annotations

import numpy as np

from ray_zep.partition.plan import AttentionPlan
from ray_zep.sim.events import Timeline

BACKWARD_LEAD = 1
"""Blocks a rank may run ahead in backward (the reduce-scatter wait, module docstring)."""


def rank_ends(timeline: Timeline, world: int) -> np.ndarray:
    """(W,) when each rank's last task of the layer ends (a collective for a later layer
    aside, `TaskGraph.ahead`)."""
    tasks = timeline.graph.tasks
    ranks = np.fromiter((t.rank for t in tasks), dtype=np.int64, count=len(tasks))
    ends = timeline.end.astype(np.float64, copy=True)
    ahead = timeline.graph.ahead
    ends[ahead.start : ahead.stop] = 0.0
    out = np.zeros(world)
    np.maximum.at(out, ranks, ends)
    return out


def bands(plan: AttentionPlan) -> np.ndarray:
    """(W,) the band of each rank: ranks joined by queue items spanning several ranks,
    labelled by their lowest rank."""
    world = plan.world
    label = np.arange(world)
    joined = [np.asarray(item.ranks) for item in plan.items() if len(item.ranks) > 1]
    if not joined:
        return label
    members = np.concatenate(joined)
    owners = np.repeat(np.arange(len(joined)), [len(r) for r in joined])
    while True:  # each item takes its members' lowest label, each rank its items' lowest
        low = np.full(len(joined), world)
        np.minimum.at(low, owners, label[members])
        before = label.copy()
        np.minimum.at(label, members, low[owners])
        label = label[label]
        if np.array_equal(label, before):
            return label


def drifting_layers(
    forward: Timeline,
    backward: Timeline,
    plan: AttentionPlan,
    n_layers: int,
    depth: int,
    together: bool,
) -> float:
    """Seconds of the step's n_layers forward and backward layers (module docstring):
    blocks gathered `depth` ahead; all ranks in one band where `together` (a remap or
    expert all-to-all in every layer). depth 1 or `together`: n_layers x (forward +
    backward makespan), as played."""
    lockstep = n_layers * (forward.makespan + backward.makespan)
    lead = min(depth - 1, n_layers - 1)
    if together or lead < 1:
        return lockstep
    world = plan.world
    _, band = np.unique(bands(plan), return_inverse=True)
    count = int(band.max()) + 1
    if count == 1:
        return lockstep
    layer_forward, layer_backward = np.zeros(count), np.zeros(count)  # each band's layer
    np.maximum.at(layer_forward, band, rank_ends(forward, world))
    np.maximum.at(layer_backward, band, rank_ends(backward, world))
    ends = _played(np.zeros(count), layer_forward, n_layers, lead)
    ends = _played(ends, layer_backward, n_layers, min(lead, BACKWARD_LEAD))
    return min(lockstep, float(ends.max()))


def _played(start: np.ndarray, seconds: np.ndarray, n_layers: int, lead: int) -> np.ndarray:
    """(B,) when each band ends n_layers layers of `seconds` (B,) each, starting at
    `start`, none starting layer l before every band has started layer l - lead."""
    starts = np.empty((n_layers, len(seconds)))
    starts[0] = start
    for layer in range(1, n_layers):
        starts[layer] = starts[layer - 1] + seconds
        if layer >= lead:
            np.maximum(starts[layer], starts[layer - lead].max(), out=starts[layer])
    return starts[-1] + seconds
