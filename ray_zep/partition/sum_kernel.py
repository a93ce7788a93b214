"""numpy's sum of a float64 array, compiled (`ray_zep.partition.compiled`): the kernels
that add up loads sum them as the array code they replaced did (pairwise), so that ties
fall where they fell (tests/test_compiled_kernels.py). numpy 2.3 changed how: before it,
a long array is summed in buffers of 8,192 values (`NUMPY_BUFFER`), each pairwise and the
buffers one after another; from 2.3 on, pairwise over the whole array. The kernels follow
the numpy installed (the kernels' cache is stamped with its version:
`compiled.forget_stale_kernels`).
"""

from __future__ import annotations

import numpy as np

from ray_zep.partition.compiled import compiled

NUMPY_BUFFER = 0 if np.lib.NumpyVersion(np.__version__) >= "2.3.0" else 8192
"""The values numpy sums pairwise before adding the next run's sum (0: all of them): its
reduction's buffer, 8,192 values by default (`numpy.getbufsize`), before numpy 2.3."""


@compiled
def pairwise_sum(values, start, count) -> float:
    """numpy's sum of `values[start : start + count]` (float64, contiguous): `NUMPY_BUFFER`
    values at a time (all at once where it is 0), each run summed pairwise (`run_sum`)
    and the runs' sums added in order."""
    if NUMPY_BUFFER == 0 or count <= NUMPY_BUFFER:
        return run_sum(values, start, count)
    total = 0.0
    for at in range(start, start + count, NUMPY_BUFFER):
        total += run_sum(values, at, min(NUMPY_BUFFER, start + count - at))
    return total


@compiled
def run_sum(values, start, count) -> float:
    """numpy's pairwise sum of `values[start : start + count]`: blocks of at most 128
    (`block_sum`), halved (to multiples of 8) above that and added as the two halves'
    sums. Without recursion (numba's cache does not keep recursive kernels)."""
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
