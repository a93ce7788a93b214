"""Run a function on N spawned processes joined by a gloo process group.

Each process calls `fn(rank, world, *args)`; whatever rank r returns is saved
with torch.save and handed back in rank order. A process that raises fails the
whole call with that rank's traceback.
"""

from __future__ import annotations

import socket
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ray_zep.mesh import init_process_group

INIT_TIMEOUT_S = 60.0
COLLECTIVE_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ranks(
    fn: Callable[..., Any], world: int, *args: Any, timeout_s: float = COLLECTIVE_TIMEOUT_S
) -> list[Any]:
    """Run `fn` on `world` processes (no process group when world == 1)."""
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _entry,
            args=(world, port, Path(tmp), fn, args, timeout_s),
            nprocs=world,
            join=True,
            start_method="spawn",
        )
        return [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _entry(
    rank: int,
    world: int,
    port: int,
    out: Path,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    timeout_s: float,
) -> None:
    torch.set_num_threads(1)
    if world > 1:
        init_process_group("gloo", rank, world, "127.0.0.1", port, INIT_TIMEOUT_S, timeout_s)
    try:
        result = fn(rank, world, *args)
    except BaseException:
        raise RuntimeError(f"rank {rank} failed:\n{traceback.format_exc()}") from None
    finally:
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()
    torch.save(result, out / f"rank{rank}.pt")
