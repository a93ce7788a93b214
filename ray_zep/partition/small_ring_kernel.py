"""The searches for a small ring inside one node (`ray_zep.partition.level_fill`), compiled
(`ray_zep.partition.compiled`): the fill asks for one for each whole sequence that fits
under the level on no rank, hundreds a level at 4,096 GPUs.

Both take the fewest ranks (2 .. G) of one node whose work room and token room take a
member of a ring over `n` tokens (`member`: its member work at each size); rank arrays
are every rank's, node after node.
"""

from __future__ import annotations

import numpy as np

from ray_zep.partition.compiled import compiled


@compiled
def spare_ring(
    in_ring: np.ndarray,
    tokens: np.ndarray,
    load: np.ndarray,
    n: int,
    member: np.ndarray,
    level: float,
    capacity: int,
    gpus: int,
) -> tuple[np.ndarray, int]:
    """Among ranks in no ring: the node with the least load over all its GPUs of those
    that have such ranks for the fewest, and its least loaded ones (the lowest on ties).
    Returns (the ranks, ascending; the size's index into `member`), no ranks where no
    node has two."""
    sizes = gpus - 1
    need = np.empty(sizes, dtype=np.int64)
    for k in range(sizes):
        need[k] = -(-n // (k + 2))
    least_need, least_member = need.min(), member.min()
    nodes = load.size // gpus
    # nodes with two ranks that could take a member of some size (with room for a member
    # of the widest ring, loaded lightly enough for the least member work): only they can
    near = np.zeros(nodes, dtype=np.bool_)
    for node in range(nodes):
        could = 0
        for rank in range(node * gpus, (node + 1) * gpus):
            if (not in_ring[rank] and tokens[rank] <= capacity - least_need
                    and load[rank] <= level - least_member):  # fmt: skip
                could += 1
        near[node] = could >= 2
    for k in range(sizes):
        best, at = np.inf, -1
        for node in range(nodes):
            if not near[node] or _fitting(in_ring, tokens, load, node, gpus, need[k],
                                          member[k], level, capacity, False) < k + 2:  # fmt: skip
                continue
            held = _node_load(load, node, gpus)
            if held < best:
                best, at = held, node
        if at >= 0:
            return _least_loaded(in_ring, tokens, load, at, gpus, need[k], member[k], level,
                                 capacity, k + 2, -1, in_ring, False), k  # fmt: skip
    return np.zeros(0, dtype=np.int64), -1


@compiled
def co_member_ring(
    labels: np.ndarray,
    tokens: np.ndarray,
    load: np.ndarray,
    n: int,
    member: np.ndarray,
    level: float,
    capacity: int,
    gpus: int,
) -> tuple[np.ndarray, int]:
    """Among ranks that are members of one same ring (`labels`: its index, negative for
    none or several): the least loaded rank (the lowest on ties) whose ring has such
    ranks for the fewest on its node, and that ring's least loaded ones there. Returns
    (the ranks, ascending; the size's index into `member`), no ranks where none has."""
    nodes = load.size // gpus
    taken = labels < 0
    for k in range(gpus - 1):
        degree, need = k + 2, -(-n // (k + 2))
        best, at = np.inf, -1
        for node in range(nodes):
            if _fitting(taken, tokens, load, node, gpus, need, member[k], level, capacity,
                        True) < degree:  # fmt: skip
                continue
            for rank in range(node * gpus, (node + 1) * gpus):
                if not _fits(taken[rank], tokens[rank], load[rank], need, member[k], level,
                             capacity, True) or load[rank] >= best:  # fmt: skip
                    continue
                if _peers(labels, taken, tokens, load, rank, gpus, need, member[k], level,
                          capacity) >= degree:  # fmt: skip
                    best, at = load[rank], rank
        if at >= 0:
            node = at // gpus
            return _least_loaded(taken, tokens, load, node, gpus, need, member[k], level,
                                 capacity, degree, labels[at], labels, True), k  # fmt: skip
    return np.zeros(0, dtype=np.int64), -1


@compiled
def _fits(taken, tokens, load, need, member, level, capacity, room_first) -> bool:
    """Whether a rank (`taken`: not free for this ring) has the token and work room for
    a member: the work room as the array code it replaces compares it."""
    if taken or capacity - tokens < need:
        return False
    if room_first:
        return level - load >= member
    return load + member <= level


@compiled
def _fitting(taken, tokens, load, node, gpus, need, member, level, capacity, room_first):
    """How many of `node`'s ranks `_fits`."""
    count = 0
    for rank in range(node * gpus, (node + 1) * gpus):
        if _fits(taken[rank], tokens[rank], load[rank], need, member, level, capacity,
                 room_first):  # fmt: skip
            count += 1
    return count


@compiled
def _peers(labels, taken, tokens, load, rank, gpus, need, member, level, capacity) -> int:
    """How many ranks of `rank`'s node share its ring and `_fits` (itself among them)."""
    node, count = rank // gpus, 0
    for peer in range(node * gpus, (node + 1) * gpus):
        if labels[peer] == labels[rank] and _fits(
            taken[peer], tokens[peer], load[peer], need, member, level, capacity, True
        ):
            count += 1
    return count


@compiled
def _node_load(load, node, gpus) -> float:
    """The node's GPUs' load summed as numpy sums a row of it (pairwise, eight at a time
    from eight GPUs on), so that ties fall as they did."""
    row = load[node * gpus : (node + 1) * gpus]
    if gpus < 8:
        total = 0.0
        for value in row:
            total += value
        return total
    lanes = row[:8].copy()
    whole = gpus - gpus % 8
    for start in range(8, whole, 8):
        for lane in range(8):
            lanes[lane] += row[start + lane]
    total = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + (
        (lanes[4] + lanes[5]) + (lanes[6] + lanes[7])
    )
    for rest in range(whole, gpus):
        total += row[rest]
    return total


@compiled
def _least_loaded(taken, tokens, load, node, gpus, need, member, level, capacity, degree,
                  label, labels, room_first) -> np.ndarray:  # fmt: skip
    """The `degree` least loaded of `node`'s ranks that `_fits` (and, where `label` is
    not negative, that are members of that ring), the lowest first on ties; ascending."""
    chosen = np.zeros(degree, dtype=np.int64)
    used = np.zeros(gpus, dtype=np.bool_)
    for slot in range(degree):
        best, pick = np.inf, -1
        for gpu in range(gpus):
            rank = node * gpus + gpu
            if used[gpu] or (label >= 0 and labels[rank] != label):
                continue
            if not _fits(taken[rank], tokens[rank], load[rank], need, member, level, capacity,
                         room_first):  # fmt: skip
                continue
            if load[rank] < best:
                best, pick = load[rank], gpu
        used[pick] = True
        chosen[slot] = node * gpus + pick
    return np.sort(chosen)
