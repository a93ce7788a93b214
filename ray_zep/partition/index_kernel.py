"""The load index the whole-sequence fill deals by (`fill_kernel.deal`), compiled
(`ray_zep.partition.compiled`): ranks ordered by modelled load, for best-fit queries under
a token bound.

The ranks with token room sit sorted by (load, -rank) in blocks of at most `BLOCK` (a rank
whose load changes moves within a block or two, not through an array of every rank), so
that each query is two bisections; the others sit in a heap by tokens, from which they
return when the bound rises (sequences come longest first, so the bound rarely falls;
when it does, the index is rebuilt). The index is a tuple of arrays
(`load_index.new_index`); the caller owns `load` and `tokens` (every rank's) and calls
`move` after it changes a rank's entries. Answers equal array scans, ties going to the
lowest rank (tests/test_load_index.py).
"""

from __future__ import annotations

import numpy as np

from ray_zep.partition.compiled import compiled

_READY, _HEAP, _BOUND, _BOUND_SET, _BLOCKS, _FREE = range(6)
"""Where the index's counters keep how many ranks are filed, the heap's size, the token
bound and whether one is set, how many blocks hold filed ranks and how many are free
(`load_index.new_index`)."""
BLOCK = 64
"""Filed ranks a block holds at most (a full one splits in two)."""


@compiled
def set_bound(index, most: int, load, tokens) -> None:
    """Only ranks holding at most `most` tokens answer from now on."""
    meta, filed_in, held, ranks = index[2], index[3], index[5], index[6]
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
    block, at = _last_under(index, room)
    return -index[1][block, at] if block >= 0 else -1


@compiled
def least_loaded(index) -> int:
    """The rank with the least load (lowest rank on ties); -1 for none."""
    loads, meta, order = index[0], index[2], index[8]
    if not meta[_READY]:
        return -1
    return fullest_under(index, loads[order[0], 0])


@compiled
def take(index, room: float, work: float, count: int, then: int, load, tokens) -> int:
    """Best fit in one pass: the fullest rank with load not above `room`, else the least
    loaded (lowest rank on ties), given `work` and `count` tokens and filed again; -1
    where no rank answers. `then` (-1: none): the bound the caller sets next, before any
    other query; a rank over today's bound but within that one is filed at once."""
    loads, keys, meta, filed_in, filed, _, _, _, order, _ = index
    if not meta[_READY]:
        return -1
    block, at = _last_under(index, room)
    if block < 0:
        block, at = _last_under(index, loads[order[0], 0])
    rank = -keys[block, at]
    load[rank] += work
    tokens[rank] += count
    _remove(index, block, at)
    if tokens[rank] <= meta[_BOUND] or (then >= 0 and tokens[rank] <= then):
        _add(index, load[rank], -rank)
        filed[rank] = load[rank]
    else:
        filed_in[rank] = False
        _push(index, tokens[rank], rank, tokens)
    return rank


@compiled
def move(index, rank: int, load, tokens) -> None:
    """Files `rank` again after its load or tokens changed."""
    meta, filed_in, filed = index[2], index[3], index[4]
    if filed_in[rank]:
        block, at = _find(index, filed[rank], -rank)
        _remove(index, block, at)
        filed_in[rank] = False
    if tokens[rank] <= meta[_BOUND]:
        _insert(index, rank, load)
    else:
        _push(index, tokens[rank], rank, tokens)


@compiled
def _rebuild(index, load, tokens) -> None:
    loads, keys, meta, filed_in, filed, _, _, sizes, order, spare = index
    world = load.size
    descending = np.arange(world - 1, -1, -1)  # -rank ascending, kept by the stable sort
    by_load = descending[np.argsort(load[descending], kind="mergesort")]
    meta[_READY], meta[_HEAP], meta[_BLOCKS] = 0, 0, 0
    half = BLOCK // 2
    for rank in by_load:
        if tokens[rank] > meta[_BOUND]:
            continue
        if meta[_READY] % half == 0:  # a new block, half full when done
            order[meta[_BLOCKS]] = meta[_BLOCKS]
            sizes[meta[_BLOCKS]] = 0
            meta[_BLOCKS] += 1
        block = meta[_BLOCKS] - 1
        loads[block, sizes[block]], keys[block, sizes[block]] = load[rank], -rank
        sizes[block] += 1
        meta[_READY] += 1
    meta[_FREE] = 0
    for block in range(sizes.size - 1, meta[_BLOCKS] - 1, -1):
        spare[meta[_FREE]] = block
        meta[_FREE] += 1
    for rank in range(world):
        filed[rank] = load[rank]
        filed_in[rank] = tokens[rank] <= meta[_BOUND]
        if not filed_in[rank]:
            _push(index, tokens[rank], rank, tokens)


@compiled
def _insert(index, rank, load) -> None:
    _add(index, load[rank], -rank)
    index[4][rank] = load[rank]
    index[3][rank] = True


@compiled
def _last_under(index, room) -> tuple[int, int]:
    """(block, place) of the last filed rank with load at most `room`; (-1, -1) for none."""
    loads, meta, sizes, order = index[0], index[2], index[7], index[8]
    low, high = 0, meta[_BLOCKS]  # the first block whose first load is over `room`
    while low < high:
        middle = (low + high) // 2
        if room < loads[order[middle], 0]:
            high = middle
        else:
            low = middle + 1
    if not low:
        return -1, -1
    block = order[low - 1]
    first, last = 0, sizes[block]
    while first < last:
        middle = (first + last) // 2
        if room < loads[block, middle]:
            last = middle
        else:
            first = middle + 1
    return block, first - 1


@compiled
def _before(loads, keys, block, at, load, key) -> bool:
    """Whether the entry at (`block`, `at`) sorts before (`load`, `key`)."""
    return loads[block, at] < load or (loads[block, at] == load and keys[block, at] < key)


@compiled
def _home(index, load, key) -> tuple[int, int]:
    """(position in the block order, place) where (`load`, `key`) sorts: the first entry
    not before it; past the last block's last entry where every entry is."""
    loads, keys, meta, sizes, order = index[0], index[1], index[2], index[7], index[8]
    low, high = 0, meta[_BLOCKS]  # the first block whose last entry is not before it
    while low < high:
        middle = (low + high) // 2
        block = order[middle]
        if _before(loads, keys, block, sizes[block] - 1, load, key):
            low = middle + 1
        else:
            high = middle
    if low == meta[_BLOCKS]:
        return low - 1, sizes[order[low - 1]]
    block = order[low]
    first, last = 0, sizes[block]
    while first < last:
        middle = (first + last) // 2
        if _before(loads, keys, block, middle, load, key):
            first = middle + 1
        else:
            last = middle
    return low, first


@compiled
def _find(index, load, key) -> tuple[int, int]:
    """(block, place) of the filed entry (`load`, `key`)."""
    position, at = _home(index, load, key)
    return index[8][position], at


@compiled
def _add(index, load, key) -> None:
    """Files (`load`, `key`) where it sorts; a full block splits in two first."""
    loads, keys, meta, _, _, _, _, sizes, order, spare = index
    meta[_READY] += 1
    if not meta[_BLOCKS]:
        meta[_FREE] -= 1
        block = spare[meta[_FREE]]
        order[0], sizes[block], meta[_BLOCKS] = block, 1, 1
        loads[block, 0], keys[block, 0] = load, key
        return
    position, at = _home(index, load, key)
    block = order[position]
    if sizes[block] == BLOCK:  # split: the upper half to a new block after it
        meta[_FREE] -= 1
        upper = spare[meta[_FREE]]
        half = BLOCK // 2
        loads[upper, :half] = loads[block, half:]
        keys[upper, :half] = keys[block, half:]
        sizes[block], sizes[upper] = half, half
        for p in range(meta[_BLOCKS], position + 1, -1):
            order[p] = order[p - 1]
        order[position + 1] = upper
        meta[_BLOCKS] += 1
        if at > half:
            block, at = upper, at - half
    for i in range(sizes[block], at, -1):
        loads[block, i], keys[block, i] = loads[block, i - 1], keys[block, i - 1]
    loads[block, at], keys[block, at] = load, key
    sizes[block] += 1


@compiled
def _remove(index, block, at) -> None:
    """Drops the entry at (`block`, `at`); an emptied block leaves the order."""
    loads, keys, meta, _, _, _, _, sizes, order, spare = index
    meta[_READY] -= 1
    size = sizes[block]
    for i in range(at, size - 1):
        loads[block, i], keys[block, i] = loads[block, i + 1], keys[block, i + 1]
    sizes[block] = size - 1
    if size > 1:
        return
    position = 0
    while order[position] != block:
        position += 1
    for p in range(position, meta[_BLOCKS] - 1):
        order[p] = order[p + 1]
    meta[_BLOCKS] -= 1
    spare[meta[_FREE]] = block
    meta[_FREE] += 1


@compiled
def _push(index, count, rank, tokens) -> None:
    """(`count`, `rank`) onto the heap of (tokens, rank), the least first; a full heap
    first keeps its live entries alone, once each (those `set_bound` would file)."""
    meta, filed_in, held, ranks = index[2], index[3], index[5], index[6]
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
