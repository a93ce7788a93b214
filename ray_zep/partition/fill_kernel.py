"""The whole-sequence fill (`ray_zep.partition.level_fill.fill_whole`), compiled
(`ray_zep.partition.compiled`), in one file: numba's cache checks a kernel's own file, not
those of the kernels it calls, so kernels that call each other live together.

- The load index: ranks with token room in arrays sorted by (load, -rank), so that each
  best-fit query is a bisection, the others in a heap by tokens, from which they return
  when the bound rises (sequences come longest first, so the bound rarely falls; when it
  does, the index is rebuilt). A tuple of arrays (`new_index`): the sorted loads and
  negated ranks, each rank's filed load and whether it is filed, the heap's tokens and
  ranks, and `_META`'s counters. The caller owns `load` and `tokens` and calls `move`
  after it changes a rank's entries; `ray_zep.partition.load_index.LoadIndex` wraps it.
- The small-ring searches: the fewest ranks (2 .. G) of one node whose work and token
  room take a member of a ring over `n` tokens, on ranks in no ring (`spare_ring`) or on
  members of one ring (`co_member_ring`).
- `deal`: sequences in order, each to the fullest rank with room under the level, else,
  while they may still become small rings, to a small ring, else to the least loaded
  rank; it gives up once a rank reaches its bound or the rest is `hopeless`, and hands
  back each sequence that takes a small ring or spills (the fill places those).

Answers equal the array code they replace, bit for bit (sums as numpy sums).
"""

from __future__ import annotations

import numpy as np

from ray_zep.partition.compiled import compiled

# the load index

_READY, _HEAP, _BOUND, _BOUND_SET = range(4)
"""Where `meta` keeps how many ranks are filed, the heap's size, the token bound and
whether one is set."""


def new_index(world: int, spare: int = 256) -> tuple:
    """An empty index of `world` ranks whose heap holds `spare` entries more than there
    are ranks (a full heap drops its stale entries: a rank holds one live entry at most)."""
    heap = world + spare
    return (np.zeros(world), np.zeros(world, dtype=np.int64), np.zeros(4, dtype=np.int64),
            np.zeros(world, dtype=np.bool_), np.zeros(world),
            np.zeros(heap, dtype=np.int64), np.zeros(heap, dtype=np.int64))  # fmt: skip


@compiled
def set_bound(index, most: int, load, tokens) -> None:
    """Only ranks holding at most `most` tokens answer from now on."""
    _, _, meta, filed_in, _, held, ranks = index
    if meta[_BOUND_SET] and most == meta[_BOUND]:
        return
    if not meta[_BOUND_SET] or most < meta[_BOUND]:
        meta[_BOUND], meta[_BOUND_SET] = most, 1
        _rebuild(index, load, tokens)
        return
    meta[_BOUND] = most
    while meta[_HEAP] and held[0] <= most:
        count, rank = _pop(held, ranks, meta)
        if count == tokens[rank] and not filed_in[rank]:
            _insert(index, rank, load)


@compiled
def fullest_under(index, room: float) -> int:
    """The rank with the most load not above `room` (lowest rank on ties); -1 for none."""
    loads, negated, meta, _, _, _, _ = index
    at = _after(loads, meta[_READY], room)
    return -negated[at - 1] if at else -1


@compiled
def least_loaded(index) -> int:
    """The rank with the least load (lowest rank on ties); -1 for none."""
    loads, negated, meta, _, _, _, _ = index
    if not meta[_READY]:
        return -1
    return -negated[_after(loads, meta[_READY], loads[0]) - 1]


@compiled
def take(index, room: float, work: float, count: int, then: int, load, tokens) -> int:
    """Best fit in one pass: the fullest rank with load not above `room`, else the least
    loaded (lowest rank on ties), given `work` and `count` tokens and filed again; -1
    where no rank answers. `then` (-1: none): the bound the caller sets next, before any
    other query; a rank over today's bound but within that one is filed at once."""
    loads, negated, meta, filed_in, filed, _, _ = index
    size = meta[_READY]
    if not size:
        return -1
    at = _after(loads, size, room)
    if not at:
        at = _after(loads, size, loads[0])
    rank = -negated[at - 1]
    load[rank] += work
    tokens[rank] += count
    if tokens[rank] <= meta[_BOUND] or (then >= 0 and tokens[rank] <= then):
        _refile(loads, negated, meta[_READY], at - 1, load[rank], -rank)
        filed[rank] = load[rank]
    else:
        _delete(loads, negated, meta, at - 1)
        filed_in[rank] = False
        _push(index, tokens[rank], rank, tokens)
    return rank


@compiled
def move(index, rank: int, load, tokens) -> None:
    """Files `rank` again after its load or tokens changed."""
    loads, negated, meta, filed_in, filed, _, _ = index
    if filed_in[rank]:
        at = _at(loads, negated, meta[_READY], filed[rank], -rank)
        if tokens[rank] <= meta[_BOUND]:
            _refile(loads, negated, meta[_READY], at, load[rank], -rank)
            filed[rank] = load[rank]
            return
        _delete(loads, negated, meta, at)
        filed_in[rank] = False
    if tokens[rank] <= meta[_BOUND]:
        _insert(index, rank, load)
    else:
        _push(index, tokens[rank], rank, tokens)


@compiled
def _rebuild(index, load, tokens) -> None:
    loads, negated, meta, filed_in, filed, _, _ = index
    world = load.size
    descending = np.arange(world - 1, -1, -1)  # -rank ascending, kept by the stable sort
    order = descending[np.argsort(load[descending], kind="mergesort")]
    meta[_READY], meta[_HEAP] = 0, 0
    for rank in order:
        if tokens[rank] <= meta[_BOUND]:
            loads[meta[_READY]], negated[meta[_READY]] = load[rank], -rank
            meta[_READY] += 1
    for rank in range(world):
        filed[rank] = load[rank]
        filed_in[rank] = tokens[rank] <= meta[_BOUND]
        if not filed_in[rank]:
            _push(index, tokens[rank], rank, tokens)


@compiled
def _insert(index, rank, load) -> None:
    loads, negated, meta, filed_in, filed, _, _ = index
    _insort(loads, negated, meta, load[rank], -rank)
    filed[rank] = load[rank]
    filed_in[rank] = True


@compiled
def _after(loads, size, room) -> int:
    """How many filed ranks have load at most `room`."""
    low, high = 0, size
    while low < high:
        middle = (low + high) // 2
        if room < loads[middle]:
            high = middle
        else:
            low = middle + 1
    return low


@compiled
def _at(loads, negated, size, load, key) -> int:
    """Where (`load`, `key`) sits among the filed ranks (the first not below it)."""
    low, high = 0, size
    while low < high:
        middle = (low + high) // 2
        if loads[middle] < load or (loads[middle] == load and negated[middle] < key):
            low = middle + 1
        else:
            high = middle
    return low


@compiled
def _insort(loads, negated, meta, load, key) -> None:
    """Files (`load`, `key`) where it sorts, the entries after it moved up one in place."""
    size = meta[_READY]
    at = _at(loads, negated, size, load, key)
    while at < size and loads[at] == load and negated[at] == key:
        at += 1
    for i in range(size, at, -1):
        loads[i], negated[i] = loads[i - 1], negated[i - 1]
    loads[at], negated[at] = load, key
    meta[_READY] = size + 1


@compiled
def _refile(loads, negated, size, at, load, key) -> None:
    """The entry at `at` filed under (`load`, `key`) instead: the entries it passes moved
    one place in place (a rank's load changes by a sequence's work, so it passes few)."""
    while at + 1 < size and (loads[at + 1] < load or (loads[at + 1] == load
                                                       and negated[at + 1] < key)):  # fmt: skip
        loads[at], negated[at] = loads[at + 1], negated[at + 1]
        at += 1
    while at > 0 and (loads[at - 1] > load or (loads[at - 1] == load and negated[at - 1] > key)):
        loads[at], negated[at] = loads[at - 1], negated[at - 1]
        at -= 1
    loads[at], negated[at] = load, key


@compiled
def _delete(loads, negated, meta, at) -> None:
    """Drops the entry at `at`, the entries after it moved down one in place."""
    size = meta[_READY]
    for i in range(at, size - 1):
        loads[i], negated[i] = loads[i + 1], negated[i + 1]
    meta[_READY] = size - 1


@compiled
def _push(index, count, rank, tokens) -> None:
    """(`count`, `rank`) onto the heap of (tokens, rank), the least first; a full heap
    first keeps its live entries alone, once each (those `set_bound` would file)."""
    _, _, meta, filed_in, _, held, ranks = index
    if meta[_HEAP] == held.size:
        seen = np.zeros(tokens.size, dtype=np.bool_)
        live = 0
        for at in range(meta[_HEAP]):
            r = ranks[at]
            if held[at] == tokens[r] and not filed_in[r] and not seen[r]:
                seen[r] = True
                held[live], ranks[live] = held[at], r
                live += 1
        meta[_HEAP] = 0
        for at in range(live):
            _sift_in(held, ranks, meta, held[at], ranks[at])
    _sift_in(held, ranks, meta, count, rank)


@compiled
def _sift_in(held, ranks, meta, count, rank) -> None:
    at = meta[_HEAP]
    meta[_HEAP] = at + 1
    while at:
        parent = (at - 1) // 2
        if held[parent] < count or (held[parent] == count and ranks[parent] <= rank):
            break
        held[at], ranks[at] = held[parent], ranks[parent]
        at = parent
    held[at], ranks[at] = count, rank


@compiled
def _pop(held, ranks, meta) -> tuple[int, int]:
    top = (held[0], ranks[0])
    size = meta[_HEAP] - 1
    meta[_HEAP] = size
    count, rank = held[size], ranks[size]
    at = 0
    while True:
        child = 2 * at + 1
        if child >= size:
            break
        if child + 1 < size and (held[child + 1] < held[child] or (
                held[child + 1] == held[child] and ranks[child + 1] < ranks[child])):  # fmt: skip
            child += 1
        if count < held[child] or (count == held[child] and rank <= ranks[child]):
            break
        held[at], ranks[at] = held[child], ranks[child]
        at = child
    held[at], ranks[at] = count, rank
    return top


# the small-ring searches


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
        # no ring with room for a member of the widest ring, loaded lightly enough for
        # the least member work)
        could = 0
        for rank in range(node * gpus, (node + 1) * gpus):
            if (not in_ring[rank] and tokens[rank] <= capacity - least_need
                    and load[rank] <= level - least_member):  # fmt: skip
                could += 1
        if could < 2:
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
    One pass over the nodes with two ranks that could, each rank asked only for sizes up
    to the fewest found so far."""
    taken = labels < 0
    least_need, least_member = -(-n // gpus), member.min()
    best_k, best_load, best_rank = gpus - 1, np.inf, -1
    could = np.zeros(gpus, dtype=np.bool_)
    for node in range(load.size // gpus):
        # only ranks with room for a member of the widest ring and work room for the least
        # member work can, and a node needs two of them
        count = 0
        for gpu in range(gpus):
            rank = node * gpus + gpu
            could[gpu] = _fits(taken[rank], tokens[rank], load[rank], least_need, least_member,
                               level, capacity, True)  # fmt: skip
            if could[gpu]:
                count += 1
        if count < 2:
            continue
        for gpu in range(gpus):
            if could[gpu]:
                best_k, best_load, best_rank = _rank_ring(
                    labels, taken, tokens, load, node * gpus + gpu, n, member, level, capacity,
                    gpus, best_k, best_load, best_rank,
                )  # fmt: skip
    if best_rank < 0:
        return np.zeros(0, dtype=np.int64), -1
    need, label = -(-n // (best_k + 2)), labels[best_rank]
    return _least_loaded(taken, tokens, load, best_rank // gpus, gpus, need, member[best_k],
                         level, capacity, best_k + 2, label, labels, True), best_k  # fmt: skip


@compiled
def _rank_ring(labels, taken, tokens, load, rank, n, member, level, capacity, gpus, best_k,
               best_load, best_rank) -> tuple[int, float, int]:  # fmt: skip
    """`co_member_ring`'s best so far (size index, load, rank), `rank` weighed: the fewest
    of its ring's ranks on its node that fit with it, at sizes up to the best's."""
    for k in range(min(best_k + 1, gpus - 1)):
        if k == best_k and load[rank] >= best_load:
            break  # as loaded as the best at its size: it cannot take its place
        need = -(-n // (k + 2))
        if not _fits(False, tokens[rank], load[rank], need, member[k], level, capacity, True):
            continue
        if _peers(labels, taken, tokens, load, rank, gpus, need, member[k], level,
                  capacity) < k + 2:  # fmt: skip
            continue
        if k < best_k or load[rank] < best_load:
            return k, load[rank], rank
        break
    return best_k, best_load, best_rank


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
    """The node's GPUs' load summed as numpy sums a row of it, so that ties fall as they did."""
    if gpus <= 128:
        return _block_sum(load, node * gpus, gpus)
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


# the dealing

DONE, GIVEN_UP, RING, SECOND_RING, SPILL = range(5)
"""What `deal` stopped at: every sequence dealt; a rank reached the bound or the rest is
hopeless; a small ring on ranks in no ring, or on members of one ring; a spill."""
_POSITION, _RINGS_OPEN, _HOPELESS = range(3)
"""Where `deal`'s `state` keeps the next sequence, whether sequences may still become
small rings, and whether it gave up on a `hopeless` check."""


@compiled
def deal(
    state: np.ndarray,
    sizes: np.ndarray,
    works: np.ndarray,
    small: np.ndarray,
    load: np.ndarray,
    tokens: np.ndarray,
    in_ring: np.ndarray,
    labels: np.ndarray,
    index: tuple,
    local: np.ndarray,
    level: float,
    capacity: int,
    prune_above: float,
    smallest_ring: float,
    rises_above: float,
    second_rings: bool,
    gpus: int,
    check: tuple,
) -> tuple[int, np.ndarray, int]:
    """Deals sequences (`sizes` tokens, `works` seconds, `small` their small rings'
    member work at 2 .. G ranks, in dealing order) from `state`'s position, each whole to
    a rank (`local`), writing `load` and `tokens`. Returns (what it stopped at, the small
    ring's ranks, its size's index into the sequence's row of `small`); `state` then
    names the sequence it stopped at.

    `rises_above`: the level and a little more (a second ring, where `second_rings`, is
    sought only where the rank taking the sequence whole would end above it and the
    busiest rank so far);
    `check`: `hopeless_check`'s arrays (every `CHECK_EVERY`-th sequence, none where
    `check[0]` is empty)."""
    none = np.zeros(0, dtype=np.int64)
    count = sizes.size
    for position in range(state[_POSITION], count):
        state[_POSITION] = position
        n, w = sizes[position], works[position]
        if hopeless(check, position, load, tokens, capacity, prune_above):
            state[_HOPELESS] = 1
            return GIVEN_UP, none, -1
        set_bound(index, capacity - n, load, tokens)
        if w < smallest_ring:
            state[_RINGS_OPEN] = 0
        if not state[_RINGS_OPEN]:  # best fit, else the least loaded: one search
            then = capacity - sizes[position + 1] if position + 1 < count else -1
            rank = take(index, level - w, w, n, then, load, tokens)
            if rank >= 0:
                local[position] = rank
                if load[rank] >= prune_above:
                    return GIVEN_UP, none, -1
                continue
        rank = fullest_under(index, level - w)
        if rank < 0:
            rank = least_loaded(index)
            if state[_RINGS_OPEN] and gpus > 1:
                ranks, k = spare_ring(in_ring, tokens, load, n, small[position], level, capacity,
                                      gpus)  # fmt: skip
                if k >= 0:
                    return RING, ranks, k
                # a second ring only where the rank taking it whole would end busiest,
                # and more than a little over the level
                if second_rings and (rank < 0 or load[rank] + w > max(load.max(), rises_above)):
                    ranks, k = co_member_ring(labels, tokens, load, n, small[position], level,
                                              capacity, gpus)  # fmt: skip
                    if k >= 0:
                        return SECOND_RING, ranks, k
        if rank < 0:
            return SPILL, none, -1
        load[rank] += w
        if load[rank] >= prune_above:
            return GIVEN_UP, none, -1
        tokens[rank] += n
        local[position] = rank
        move(index, rank, load, tokens)
    state[_POSITION] = count
    return DONE, none, -1


@compiled
def hopeless(check, position, load, tokens, capacity, prune_above) -> bool:
    """Whether the sequences the fill has yet to deal must bring some rank to the bound:
    each adds at least the least seconds per token among them (a ring or spill of one
    spreads at least its whole work over its tokens) to ranks within their free tokens,
    so where the tokens the ranks can take before reaching it are fewer than the rest,
    the placement would be abandoned anyway: it is now. Checked every `check[3]`-th
    sequence; sums as numpy sums arrays (pairwise), so that it answers as it did."""
    rest, work, density, every, limit = check
    if rest.size == 0 or position % every:
        return False
    least = density[position]
    if least <= 0:
        return False
    world = load.size
    under = np.empty(world)
    room = np.empty(world)
    free_under = np.empty(world)
    with_room = 0
    for rank in range(world):
        free = max(0, capacity - tokens[rank])
        under[rank] = max(0.0, limit - load[rank])
        room[rank] = min(float(free), under[rank] / least)
        if free > 0:
            free_under[with_room] = under[rank]
            with_room += 1
    if pairwise_sum(free_under, 0, with_room) < work[position]:
        return True  # the ranks with free tokens lack the seconds for the rest
    return pairwise_sum(room, 0, world) < rest[position]


@compiled
def pairwise_sum(values, start, count) -> float:
    """numpy's sum of `values[start : start + count]` (float64, contiguous): blocks of at
    most 128 (`_block_sum`), halved (to multiples of 8) above that and added as the two
    halves' sums. Without recursion (numba's cache does not keep recursive kernels)."""
    starts = np.empty(64, dtype=np.int64)
    counts = np.empty(64, dtype=np.int64)
    phases = np.zeros(64, dtype=np.int64)
    sums = np.empty(64)
    frames, done = 1, 0
    starts[0], counts[0] = start, count
    while frames:
        top = frames - 1
        at, size = starts[top], counts[top]
        if size <= 128:
            sums[done] = _block_sum(values, at, size)
            done += 1
            frames -= 1
            continue
        half = size // 2
        half -= half % 8
        if phases[top] == 0:  # the first half
            phases[top] = 1
            starts[frames], counts[frames], phases[frames] = at, half, 0
            frames += 1
        elif phases[top] == 1:  # the second half
            phases[top] = 2
            starts[frames], counts[frames], phases[frames] = at + half, size - half, 0
            frames += 1
        else:  # both halves summed: their sum
            sums[done - 2] = sums[done - 2] + sums[done - 1]
            done -= 1
            frames -= 1
    return sums[0]


@compiled
def _block_sum(values, start, count) -> float:
    """numpy's sum of at most 128 values: eight running sums from eight values on."""
    if count < 8:
        total = 0.0
        for i in range(start, start + count):
            total += values[i]
        return total
    lanes = values[start : start + 8].copy()
    whole = count - count % 8
    for block in range(8, whole, 8):
        for lane in range(8):
            lanes[lane] += values[start + block + lane]
    total = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + (
        (lanes[4] + lanes[5]) + (lanes[6] + lanes[7])
    )
    for i in range(start + whole, start + count):
        total += values[i]
    return total
