"""More token room for the same global batch: L raised, `data.batch_fill` lowered to match.

Under budget packing a batch holds `data.batch_fill` x ranks x L tokens, and L
(`train.tokens_per_rank`) is also the most tokens the planner may put on one rank. A batch
of documents longer than L (or sparse in work: a 30k-token document at 4k tokens per GPU
needs ranks for its tokens, not its work) fills those ranks with tokens long before it
fills them with work, and the work policy has no room left to even the work out. The same
batch with a larger L, and a lower fill, gives it that room, at the price of memory: the
fullest rank may hold more tokens, so more activations (or more recomputation, where they
no longer fit).

On `ray-zep bench scale`'s grid (64-1,024 GPUs, 4k tokens per GPU, 7b and 13b) L at 1.6
rather than 1.25 x the mean moved the default placement's step from -7.3% (github, 1,024
GPUs) to +6.0% (github, 64 GPUs), and made 13b ranks checkpoint some blocks; at 16k tokens
per GPU, where every row already recomputes, 19 of 24 rows were slower (BENCHMARKS.md,
twentieth series). Which way it goes depends on the batch, the model and the memory, so
`ray-zep plan --auto` plays it (`ROOM_FACTORS`) rather than assuming it, and then the
factors next to the fastest on a ladder of `ROOM_STEP` (`next_room`, up to `ROOM_MOST`):
the 7b github batches at 1,024 and 4,096 GPUs train 3.5% and 4.3% more tokens a second at
L x 2 than at x 1.5 (BENCHMARKS.md, fifty-third series). `ROOM_MOST` itself is played
every time: on four rows of `bench scale`'s 4k grid 2 x is the fastest where going up one
step at a time from 1.5 x stopped short of it (7b prolong64k at 4,096 GPUs 2.6% more tokens
a second, 7b github at 256 GPUs 1.8%, 7b prolong64k and chat at 1,024 GPUs 0.5% and 0.3%;
fifty-fourth series). Once both of the fastest's neighbours are played, the gaps between it
and the nearest factors played are halved (`ROOM_HALVINGS`), where the step can turn on
whether the fullest rank must recompute activations.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

from ray_zep.config import Config, Packing, batch_budget

ROOM_STEP = 0.25
"""The ladder of factors `next_room` searches: one factor to the next."""
ROOM_MOST = 2.0
"""The largest factor tried (`next_room`)."""
ROOM_HALVINGS = 2
"""Once both of the fastest factor's neighbours on the ladder are played, the gap between it
and each is halved this many times (`next_room`): the step can change sharply between two
factors of the ladder, where a rank of the larger L must recompute activations that one of
a slightly smaller L keeps. On `bench scale`'s 13b github batch at 16k tokens per GPU, at 64
GPUs L x 1.125 rather than 1.25 needs no recomputation (was the feed-forward of one block in
each of 3 micro-batches) and trains 0.7% more tokens a second; at 1,024 GPUs x 1.6875 rather
than 1.75 none (was 3 blocks' in each of 4), 0.4% more (BENCHMARKS.md, seventy-third
series). `plan --auto` plays up to 2 x `ROOM_HALVINGS` more rooms of its fastest
composition for it."""
ROOM_FACTORS = (1.25, 1.5, ROOM_MOST)
"""L x these are tried for the fastest budget-packed composition (`ray_zep.sim.auto`)."""


def next_room(
    played: Sequence[float], fastest: float, most: float = ROOM_MOST, halvings: int = ROOM_HALVINGS
) -> float | None:
    """The next factor of L to play after `played`, `fastest` the one whose step was
    fastest (fitting): its neighbour on the ladder of `ROOM_STEP` (the one above at most
    `most`), the larger first, not yet played and between the smallest played and `most`;
    once both are played (or out of that range), the middle between the fastest and the
    nearest factor played on either side, the larger first, while they lie more than
    `ROOM_STEP` / 2^`halvings` apart; None after that."""
    low = min(played)

    def nearest(side: int) -> float | None:  # the nearest played factor on `side` of the fastest
        beyond = [p for p in played if (p - fastest) * side > 1e-9]
        return min(beyond, key=lambda p: abs(p - fastest)) if beyond else None

    for side, factor in ((1, min(fastest + ROOM_STEP, most)), (-1, fastest - ROOM_STEP)):
        inside = low - 1e-9 <= factor <= most + 1e-9
        near = nearest(side)
        closer = near is not None and abs(near - fastest) <= abs(factor - fastest) + 1e-9
        if inside and not closer and not any(abs(factor - p) < 1e-9 for p in played):
            return factor
    finest = ROOM_STEP / 2**halvings
    for side in (1, -1):
        near = nearest(side)
        if near is not None and abs(near - fastest) > finest + 1e-9:
            return (fastest + near) / 2
    return None


def play_around(
    played: Sequence[float],
    fastest: float,
    play: Callable[[float], float],
    most: float = ROOM_MOST,
    halvings: int = ROOM_HALVINGS,
) -> None:
    """Plays the factors `next_room` gives after `played` (`fastest` the fastest of them),
    one at a time until it gives none (`halvings`: its gaps halved that many times):
    `play(factor)` plays one and returns the fastest factor so far."""
    played = list(played)
    following = next_room(played, fastest, most, halvings)
    while following is not None:
        fastest = play(following)
        played.append(following)
        following = next_room(played, fastest, most, halvings)


def with_room(config: Config, factor: float, world: int) -> Config | None:
    """`config` with L x `factor` (rounded up) and `data.batch_fill` lowered so that the
    batch budget (`batch_budget`, the data actor's) stays the same; None where its
    batches are rank-packed (each rank's bin is L tokens: a larger L is another batch)."""
    if config.data.packing is not Packing.BUDGET or factor <= 1.0:
        return None
    capacity = config.train.tokens_per_rank
    budget = batch_budget(config.data.batch_fill, world, capacity)
    wider = math.ceil(capacity * factor)
    fill = (budget + 0.5) / (world * wider)
    if batch_budget(fill, world, wider) != budget:  # float rounding: keep the budget exact
        return None
    train = dataclasses.replace(config.train, tokens_per_rank=wider)
    data = dataclasses.replace(config.data, batch_fill=fill)
    return dataclasses.replace(config, train=train, data=data)
