"""numpy's sum of a float64 array, compiled (`ray_zep.partition.compiled`): the kernels
that add up loads sum them as the array code they replaced did (pairwise), so that ties
fall where they fell (tests/test_compiled_kernels.py).
"""

from __future__ import annotations

import numpy as np

from ray_zep.partition.compiled import compiled


@compiled
def pairwise_sum(values, start, count) -> float:
    """numpy's sum of `values[start : start + count]` (float64, contiguous): blocks of at
    most 128 (`block_sum`), halved (to multiples of 8) above that and added as the two
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
            sums[done] = block_sum(values, at, size)
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
def block_sum(values, start, count) -> float:
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
