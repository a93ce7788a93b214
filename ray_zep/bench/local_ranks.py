"""The gloo processes a bench measures on this machine.

Each rank is forked from a server process that imported torch and the trainer once
(multiprocessing's `forkserver`), where a spawned rank imports them itself: seconds per
rank. Once the server runs, 15 processes started in 2 s instead of 19 s on two cores; a
single bench of 2 or 4 ranks takes as long either way (`bench memory`: 10.9 vs 11.3 s,
19.8 vs 20.3 s), as the server's own imports cost what the ranks' did in parallel. What
gains is a process that starts ranks again and again, as the test suite does. The server
never touches CUDA, so a rank may still use a GPU.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

PRELOADED = ("torch", "torch.distributed.checkpoint", "torch._dynamo", "ray_zep.train.loop")
"""What the server imports before it forks: what a training rank needs (FSDP2 imports
torch's compiler front end on its first shard)."""


def rank_context() -> multiprocessing.context.BaseContext:
    """The forkserver context, its server (started on first use) preloading PRELOADED."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOADED))
    return context


def start_ranks(fn: Callable[..., Any], args: tuple, nprocs: int) -> None:
    """Run `fn(rank, *args)` on `nprocs` forked processes; return once all have ended.

    Raises:
        torch.multiprocessing.ProcessRaisedException: a rank raised (its traceback).
        torch.multiprocessing.ProcessExitedException: a rank died.
    """
    rank_context()
    mp.start_processes(fn, args, nprocs=nprocs, join=True, start_method="forkserver")
