"""The exchange kinds: how the K and V of a ring position reach the other positions.

Each kind is described once here (`EXCHANGES`), with the facts and formulas every
other module reads instead of branching on the kind: the engine and the simulator
play a kind by its `play` (each holds one function per `Play`), the schedule tallies
its `calls_per_layer`, the plan statistics and traffic take its `carried_tokens`,
`collective` and `layer_seconds`, routing routes what is `routable`, and the
simulator's array form takes what `plays_on_arrays`.

Adding a kind that plays like an existing one (an `Exchange` member, its entry in
`EXCHANGES`) touches this file only, plus the planner that chooses it (with a new
placement, the axes table too). A kind that needs a new play adds here a `Play`
member and its branch of each formula below, and the play's path to
`ray_zep.attention.engine` (forward and backward) and its builder to
`ray_zep.sim.program`: three files plus the planner, four if it needs a collective
that `ray_zep.attention.kv_exchange` lacks.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from enum import Enum

import numpy as np


class Exchange(Enum):
    """How the K and V of a ring position reach the other positions."""

    RING = "ring"
    """Rotated rank to rank, overlapped with the compute of the current step."""
    RING_KEPT = "ring_kept"
    """Rotated as `RING` in the forward, every position's K/V kept for the backward,
    which then sends only the dK/dV accumulators round the ring: a quarter fewer bytes
    (float32 dK/dV) for the memory of the other positions' K/V."""
    ALL_GATHER = "all_gather"
    """Gathered from every position before attention (LLaMA-3 style)."""


class Play(Enum):
    """How the engine runs a kind (and the simulator replays it)."""

    ROTATE = "rotate"
    """K/V travel hop by hop to the next position, the next step's transfer posted
    before the current step's compute; backward rotates K/V again and passes the
    dK/dV accumulators around the ring back to their owners. A group of one position
    runs this play as its single local step, with nothing to send."""
    GATHER = "gather"
    """One collective gathers every position's K/V before attention; backward
    reduce-scatters dK/dV after it. Nothing overlaps the collectives."""


@dataclass(frozen=True)
class ExchangeKind:
    """One exchange kind's facts (the numbers are per member, forward, one layer
    unless said otherwise; R is the item's ring size).

    Attributes:
        exchange: the kind.
        play: how the engine and the simulator run it.
        spans_world: a group must hold every rank of the world.
        keeps_kv: a rotating kind keeps the K/V it received in the forward, so that
            its backward sends no K/V (`Play.GATHER` always keeps what it gathered).
    """

    exchange: Exchange
    play: Play
    spans_world: bool
    keeps_kv: bool = False

    @property
    def rotates(self) -> bool:
        """K/V move hop by hop between ring neighbours, overlapped with compute."""
        return self.play is Play.ROTATE

    def backward_order(self, steps: int) -> list[int]:
        """The order a rotating ring's backward computes its `steps` in: where the
        forward's K/V were kept (`keeps_kv`: every other block is at hand from the start),
        the position's own block (step 0) last, so that the last dK/dV message (to an
        owner under `parallel.dkv_wire=owner`, else the accumulator coming home) is in
        flight during its compute rather than after the ring's, and an accumulator starts
        on the member after its owner with no message to get there; else in step order,
        since a ring rotating its K/V again holds its own block first."""
        order = list(range(steps))
        return [*order[1:], 0] if self.keeps_kv and steps > 1 else order

    @property
    def routable(self) -> bool:
        """Its transfers are point to point, so routing may carry them through proxies."""
        return self.rotates

    @property
    def one_sender_per_nic(self) -> bool:
        """A ring crosses each node boundary from one GPU, which has its NIC alone; a
        collective's members share their node's NICs."""
        return self.rotates

    @property
    def collective(self) -> bool:
        """Its bytes move in collectives (not ring point-to-point)."""
        return not self.rotates

    @property
    def plays_on_arrays(self) -> bool:
        """The simulator may replay a large ring of it on arrays (`ray_zep.sim.ring_form`
        writes the rotating play's schedule as a recurrence)."""
        return self.rotates

    def play_for(self, ring: int) -> Play:
        """The play of an item of `ring` positions: one position exchanges nothing and
        runs as a single local step, whatever the kind."""
        return self.play if ring > 1 else Play.ROTATE

    def carried_tokens(self, rotated, widest, ring):
        """Token rows a member sends (elementwise on arrays): a rotating member's R - 1
        messages, every position's K/V but its successor's, each trimmed to the rows its
        layout keeps on (`rotated`: `ray_zep.partition.carried.Carried.sent`); a
        gathering member R - 1 copies of the widest position's buffer (the collective's
        ring algorithm, padded).

        Args:
            rotated: the rows a rotating member's messages carry in one pass.
            widest: tokens of the largest position.
            ring: R.
        """
        if self.rotates:
            return rotated
        return (ring - 1) * widest

    def calls_per_layer(self, ring: int, owner: bool = False) -> Counter:
        """Communication calls a member issues in one forward and backward (Ulysses
        exchanges and routing aside): rotating, R - 1 K/V sends and receives forward,
        again backward unless it keeps them, plus R dK/dV sends and receives (R - 1 each
        where they go straight to their owners, `owner`, or where it keeps them: its own
        block comes last, `backward_order`); gathering, one all-gather and one
        reduce-scatter. None for a group of one position."""
        if ring < 2:
            return Counter()
        if self.rotates:
            rotations = 1 if self.keeps_kv else 2
            dkv = ring - 1 if owner or self.keeps_kv else ring
            return Counter(p2p=2 * (ring - 1) * rotations + 2 * dkv)
        return Counter(all_gather=1, reduce_scatter=1)

    def layer_seconds(self, compute, step, ring, heads=0.0):
        """Modelled forward time of an item (elementwise on arrays), R > 1.

        A rotating member computes its diagonal step, then R - 1 steps each lasting
        the longer of its share of the compute and one transfer; a gathering member
        waits for R - 1 transfers, then computes. `heads` (the Ulysses exchange) is
        never overlapped.

        Args:
            compute: the busiest member's attention compute.
            step: seconds of one transfer of the largest position's K/V.
            ring: R.
            heads: seconds of the Ulysses exchange.
        """
        steps = ring - 1
        if self.rotates:
            share = compute / ring
            return share + steps * np.maximum(share, step) + heads
        return compute + steps * step + heads


EXCHANGES: dict[Exchange, ExchangeKind] = {
    kind.exchange: kind
    for kind in (
        ExchangeKind(Exchange.RING, Play.ROTATE, spans_world=False),
        ExchangeKind(Exchange.RING_KEPT, Play.ROTATE, spans_world=False, keeps_kv=True),
        ExchangeKind(Exchange.ALL_GATHER, Play.GATHER, spans_world=True),
    )
}
"""Every exchange kind, by its `Exchange` value."""
