"""Layer timelines whose weight gathers were posted blocks ahead (`parallel.prefetch_depth`).

A layer's graph holds one block's weight collective (`LayerSetup.weight_sync`): its ring
steps' latency, holding no link, then its bytes on every link, and the layer ends once
they have arrived. Gathered two or more blocks ahead, the collective the layer waits for
was posted in the layer before, so its latency can run there
(`WeightsCost.hidden_latency`) and the layer's graph starts with its bytes.

Whether it fits there: a communicator runs its collectives one after another, so in the
steady state of identical layers the latency of the next gather runs between the end of
this layer's bytes (E, from the layer's start) and the point where the next layer posts
its own (P, from that layer's start; the point every member has reached): a window of
(M - E) + P, M the layer's makespan. Where the latency is longer, the gathers, latency and
bytes one after another, outlast the layers' compute, and posting them earlier gains
nothing: the layer is played again as one gather ahead plays it, the whole latency
before the bytes.
"""

from __future__ import annotations

import dataclasses

from ray_zep.routing.routes import Phase
from ray_zep.sim.events import CorePool, Timeline, simulate
from ray_zep.sim.graph_builder import LayerSetup
from ray_zep.sim.program import Wire, layer_graphs

WEIGHT_BYTES = "weights gather/scatter"
"""The name of a weight collective's tasks on the links (`_Builder.post_weight_sync`)."""
WEIGHT_LATENCY = f"{WEIGHT_BYTES} latency"
"""Its latency's task, where the layer holds any (`_Builder.post_collective`)."""


def prefetched_layers(
    setup: LayerSetup, phase: Phase, wires: list[Wire], pool: CorePool | None
) -> tuple[list[LayerSetup], list[Timeline]]:
    """The timelines of `phase`'s layer under each of `wires`, and the setup each was
    played with: `setup` where its hidden latency fits before the layer (module
    docstring), else `setup` hiding none of it (as one gather ahead), that wire alone."""
    timelines = played(layer_graphs(setup, phase, wires), pool)
    setups = [setup] * len(wires)
    index = 0 if phase is Phase.FORWARD else 1
    hidden = setup.weight_latency_hidden[index]
    if hidden <= 0:
        return setups, timelines
    for k, wire in enumerate(wires):
        posted, arrived = weight_bytes(timelines[k])
        if hidden <= timelines[k].makespan - arrived + posted:
            continue
        none = list(setup.weight_latency_hidden)
        none[index] = 0.0
        setups[k] = dataclasses.replace(setup, weight_latency_hidden=(none[0], none[1]))
        timelines[k] = played(layer_graphs(setups[k], phase, [wire]), pool)[0]
    return setups, timelines


def recomputing_layers(
    setups: list[LayerSetup], mode, wires: list[Wire], pool: CorePool | None
) -> list[Timeline]:
    """The backward layer under each of `wires` of a block whose backward recomputes parts
    of its forward under checkpointing `mode`, each wire with its setup from
    `prefetched_layers` (the longer layer only widens the window its latency has)."""
    out: list[Timeline | None] = [None] * len(wires)
    alike: dict[int, list[int]] = {}
    for k, setup in enumerate(setups):
        alike.setdefault(id(setup), []).append(k)
    for indices in alike.values():
        setup = dataclasses.replace(setups[indices[0]], recompute=mode)
        graphs = layer_graphs(setup, Phase.BACKWARD, [wires[k] for k in indices])
        for k, timeline in zip(indices, played(graphs, pool), strict=True):
            out[k] = timeline
    return out


def latency_window(timeline: Timeline) -> float:
    """Seconds between the layer's weight bytes and the next layer's post, where the next
    gather's latency runs (module docstring); infinite where the layer has no weight
    collective."""
    posted, arrived = weight_bytes(timeline)
    return timeline.makespan - arrived + posted


def weight_bytes(timeline: Timeline) -> tuple[float, float]:
    """(when the layer's weight collective is posted, every member there; when its bytes
    have arrived), seconds from the layer's start; (inf, 0) where it has none."""
    tasks, start, end = timeline.graph.tasks, timeline.start, timeline.end
    parts = [i for i, t in enumerate(tasks) if t.name == WEIGHT_BYTES]
    if not parts:
        return float("inf"), 0.0
    first = parts + [i for i, t in enumerate(tasks) if t.name == WEIGHT_LATENCY]
    posted = min(max((float(end[d]) for d in tasks[i].deps), default=float(start[i]))
                 for i in first)  # fmt: skip
    return posted, max(float(end[i]) for i in parts)


def played(graphs, pool: CorePool | None) -> list[Timeline]:
    """The timeline of each graph on `pool`, each graph object played once (wires that
    change no duration share the graph)."""
    out: dict[int, Timeline] = {}
    for graph in graphs:
        if id(graph) not in out:
            out[id(graph)] = simulate(graph, pool)
    return [out[id(graph)] for graph in graphs]
