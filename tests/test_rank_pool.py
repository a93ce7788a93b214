"""The test suite's pooled ranks (`tests.helpers.procs`) start every call as a new
process would: a process group that only the call's garbage holds ends with the call,
and so do its threads; a pool whose ranks still hold many groups after a call is ended."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist

from tests.helpers import procs
from tests.helpers.procs import gloo_threads, run_ranks

pytestmark = [
    pytest.mark.dist,
    pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux's /proc"),
]

_HELD: list = []
"""Groups a call leaves reachable, as FSDP2 leaves the mesh of a model it sharded."""


def _threads(rank: int, world: int) -> tuple[int, int]:
    return os.getpid(), gloo_threads()


def _group_in_a_cycle(rank: int, world: int) -> int:
    """A new group that only a reference cycle holds once the call returns."""
    holder: dict = {"group": dist.new_group(list(range(world)))}
    holder["self"] = holder
    dist.barrier(group=holder["group"])
    return gloo_threads()


def _groups_held(rank: int, world: int, count: int) -> float:
    """Holds `count` new groups; returns the gloo threads each took (three on torch 2.13,
    fewer on some older ones)."""
    before = gloo_threads()
    for _ in range(count):
        _HELD.append(dist.new_group(list(range(world))))
        dist.barrier(group=_HELD[-1])
    return (gloo_threads() - before) / count


def test_a_pooled_call_leaves_no_group_threads_behind() -> None:
    # from new processes: a group an earlier test left in the pool may end between the
    # counts, taking as many threads as the call's own group adds
    procs.close_pools()
    before = [n for _, n in run_ranks(_threads, 2)]
    during = run_ranks(_group_in_a_cycle, 2)
    assert all(d > b for d, b in zip(during, before, strict=True)), (before, during)
    for _ in range(2):  # a leak would grow by a group's threads each call
        run_ranks(_group_in_a_cycle, 2)
    after = [n for _, n in run_ranks(_threads, 2)]
    # fewer where an earlier test's groups were still held by a thread that has ended since
    assert all(a <= b for a, b in zip(after, before, strict=True)), (before, after)


def test_a_pool_whose_ranks_still_hold_many_groups_is_ended() -> None:
    # from new processes: a pool that earlier tests left near the bound would be ended
    # by the two groups that must be kept
    procs.close_pools()
    pids = [pid for pid, _ in run_ranks(_threads, 2)]
    per_group = min(run_ranks(_groups_held, 2, 2))  # a few: kept
    assert [pid for pid, _ in run_ranks(_threads, 2)] == pids
    assert per_group > 0, "a held group runs no gloo thread this test counts"
    run_ranks(_groups_held, 2, int(procs.GROUP_THREADS_KEPT // per_group) + 1)
    fresh = run_ranks(_threads, 2)
    assert not {pid for pid, _ in fresh} & set(pids), "the pool was kept"
    assert all(n <= procs.GROUP_THREADS_KEPT for _, n in fresh), fresh
