"""The searches for a small ring inside one node (`fill_kernel.deal`), compiled
(`ray_zep.partition.compiled`): the fewest ranks (2 .. G) of one node whose work room and
token room take a member of a ring over `n` tokens (`member`: its member work at each
size), on ranks in no ring (`spare_ring`) or on members of one same ring
(`co_member_ring`). Rank arrays are every rank's, node after node. Answers equal scans
of every rank, ties included (tests/test_load_index.py, tests/test_co_rings.py).
"""

from __future__ import annotations

import numpy as np

from ray_zep.partition.compiled import compiled
from ray_zep.partition.sum_kernel import block_sum, pairwise_sum

FREE = -1
"""The ring label (`ray_zep.partition.co_rings.RingLabels`) of a rank in no ring."""
SEVERAL = -2
"""The ring label of a rank in more than one ring (it takes no further one)."""


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
    node has two. One pass over the nodes, each asked only for sizes up to the fewest
    found so far."""
    sizes = gpus - 1
    need = np.empty(sizes, dtype=np.int64)
    for k in range(sizes):
        need[k] = -(-n // (k + 2))
    least_need, least_member = need.min(), member.min()
    best_k, best_load, best_node = sizes, np.inf, -1
    for node in range(load.size // gpus):
        # only a node with two ranks that could take a member of some size can (ranks in
        # no ring with room for a member of the widest ring and for the least member
        # work: a rank that fits any size fits these)
        if _fitting(in_ring, tokens, load, node, gpus, least_need, least_member, level,
                    capacity, False) < 2:  # fmt: skip
            continue
        for k in range(min(best_k + 1, sizes)):
            if _fitting(in_ring, tokens, load, node, gpus, need[k], member[k], level, capacity,
                        False) < k + 2:  # fmt: skip
                continue
            held = _node_load(load, node, gpus)
            if k < best_k or held < best_load:
                best_k, best_load, best_node = k, held, node
            break
    if best_node < 0:
        return np.zeros(0, dtype=np.int64), -1
    return _least_loaded(in_ring, tokens, load, best_node, gpus, need[best_k], member[best_k],
                         level, capacity, best_k + 2, -1, in_ring, False), best_k  # fmt: skip


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
    (the ranks, ascending; the size's index into `member`), no ranks where none has.
    One pass over the nodes with two ranks that could, each asked only for sizes up to
    the fewest found so far, a rank only where it is less loaded than the best."""
    taken = labels < 0
    least_need, least_member = -(-n // gpus), member.min()
    best_k, best_load, best_rank = gpus - 1, np.inf, -1
    could = np.zeros(gpus, dtype=np.bool_)
    fits = np.zeros(gpus, dtype=np.bool_)
    for node in range(load.size // gpus):
        # only ranks with room for a member of the widest ring and work room for the least
        # member work can, and a node needs two of them
        first, count = node * gpus, 0
        for gpu in range(gpus):
            rank = first + gpu
            could[gpu] = _fits(taken[rank], tokens[rank], load[rank], least_need, least_member,
                               level, capacity, True)  # fmt: skip
            if could[gpu]:
                count += 1
        k = 0
        while count >= 2 and k <= best_k and k < gpus - 1:
            need = -(-n // (k + 2))
            for gpu in range(gpus):
                rank = first + gpu
                fits[gpu] = could[gpu] and _fits(False, tokens[rank], load[rank], need, member[k],
                                                 level, capacity, True)  # fmt: skip
            for gpu in range(gpus):
                rank = first + gpu
                if not fits[gpu] or (k == best_k and load[rank] >= best_load):
                    continue
                peers = 0  # its ring's ranks on the node that fit, itself among them
                for other in range(gpus):
                    if fits[other] and labels[first + other] == labels[rank]:
                        peers += 1
                if peers >= k + 2:
                    best_k, best_load, best_rank = k, load[rank], rank
            k += 1
    if best_rank < 0:
        return np.zeros(0, dtype=np.int64), -1
    need, label = -(-n // (best_k + 2)), labels[best_rank]
    return _least_loaded(taken, tokens, load, best_rank // gpus, gpus, need, member[best_k],
                         level, capacity, best_k + 2, label, labels, True), best_k  # fmt: skip


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
def _node_load(load, node, gpus) -> float:
    """The node's GPUs' load summed as numpy sums a row of it, so that ties fall as they did."""
    if gpus <= 128:
        return block_sum(load, node * gpus, gpus)
    return pairwise_sum(load, node * gpus, gpus)


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
