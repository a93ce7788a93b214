"""The test suite's pooled ranks (`tests.helpers.procs`) start every call as a new
process would: a process group that only the call's garbage holds ends with the call,
and so do its threads."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist

from tests.helpers.procs import run_ranks

pytestmark = pytest.mark.dist


def _gloo_threads(rank: int, world: int) -> int:
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                names.append(comm.read().strip())
        except FileNotFoundError:  # the thread ended while we listed them
            continue
    return sum(name.startswith(("gloo_", "pt_gloo")) for name in names)


def _group_in_a_cycle(rank: int, world: int) -> int:
    """A new group that only a reference cycle holds once the call returns, as a trained
    model's FSDP state and mesh hold theirs."""
    holder: dict = {"group": dist.new_group(list(range(world)))}
    holder["self"] = holder
    dist.barrier(group=holder["group"])
    return _gloo_threads(rank, world)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux's /proc")
def test_a_pooled_call_leaves_no_group_threads_behind() -> None:
    before = run_ranks(_gloo_threads, 2)
    during = run_ranks(_group_in_a_cycle, 2)
    assert all(d > b for d, b in zip(during, before, strict=True)), (before, during)
    for _ in range(2):  # a leak would grow by a group's threads each call
        run_ranks(_group_in_a_cycle, 2)
    after = run_ranks(_gloo_threads, 2)
    # fewer where an earlier test's groups were still held by a thread that has ended since
    assert all(a <= b for a, b in zip(after, before, strict=True)), (before, after)
