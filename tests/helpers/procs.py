"""Run a function on N processes joined by a gloo process group.

Each process calls `fn(rank, world, *args)`; whatever rank r returns is handed
back in rank order. A process that raises fails the whole call with that rank's
traceback.

`run_ranks` reuses one pool of N processes per world size for the whole test
session, and forks each pooled process from the server that imported torch and the
trainer once (`ray_zep.bench.local_ranks`, as the benches' ranks are): a spawned
process spends seconds on those imports, more than most tests' work. Between two calls a
pool destroys every process group but the default one, collects the garbage the
call left (a model, an FSDP state or a mesh in a reference cycle keeps its gloo groups
alive, each with three threads that poll), and restores the global RNG state a fresh
process starts with, so a call sees what a new process would. Groups that something
still reaches survive the collection; a pool whose ranks hold too many of them is
ended after its call (`GROUP_THREADS_KEPT`).
A pool whose call fails (an error on any rank, a dead process, a timeout) is
killed, and the next call starts a new one. `run_fresh_ranks` forks new processes
for tests that break their process group on purpose (stopped peers).
"""

from __future__ import annotations

import atexit
import gc
import io
import multiprocessing.connection
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ray_zep.bench.local_ranks import rank_context, start_ranks
from ray_zep.distributed.launch import free_port, init_process_group

INIT_TIMEOUT_S = 60.0
COLLECTIVE_TIMEOUT_S = 60.0
CALL_TIMEOUT_S = 540.0
"""A pooled call that has not returned by then fails (below pytest's own 600 s)."""
POOL_WORLDS_KEPT = 4
"""Pools kept alive at once (each process holds a few hundred MB of imports): the suite's
worlds of 1, 2, 4 and 8 ranks, about 15 processes."""
PORT_ATTEMPTS = 3
"""Tries at starting a pool: the rendezvous port `free_port` found free may be taken (by
another test process's connections) before rank 0 listens on it."""
PORT_IN_USE = "EADDRINUSE"
"""What gloo's store says when its port is taken: the one start failure tried again."""
GROUP_THREADS_KEPT = 30
"""A pool whose ranks hold more gloo threads than this beyond their own group's, after a
call and its collection, is ended (the next call starts a new one): FSDP2 keeps the mesh
of a model it sharded reachable after the model is gone, and each group lives on with its
three threads. A hundred such groups took 11-17% of a core in each idle rank; after the
suite's first 400 tests, four ranks held 98 each, and the multi-process tests after them
ran 1.4-2x slower."""


def run_ranks(
    fn: Callable[..., Any], world: int, *args: Any, timeout_s: float = COLLECTIVE_TIMEOUT_S
) -> list[Any]:
    """Run `fn` on the pooled processes of `world` ranks (no process group when world == 1)."""
    if timeout_s != COLLECTIVE_TIMEOUT_S or os.environ.get("RAY_ZEP_TEST_FRESH_RANKS") == "1":
        return run_fresh_ranks(fn, world, *args, timeout_s=timeout_s)
    pool = _pool(world)
    try:
        results = pool.call(fn, args)
    except BaseException:
        _POOLS.pop(world, None)
        pool.close(kill=True)
        raise
    if pool.dirty:
        _POOLS.pop(world, None)
        pool.close()
    return results


def run_fresh_ranks(
    fn: Callable[..., Any], world: int, *args: Any, timeout_s: float = COLLECTIVE_TIMEOUT_S
) -> list[Any]:
    """Run `fn` on `world` new processes, ended after the call."""
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        start_ranks(_fresh_entry, (world, port, Path(tmp), fn, args, timeout_s), world)
        return [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _fresh_entry(
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


class RankPool:
    """`world` processes in one gloo group, serving calls one at a time."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.dirty = False
        """Whether the last call left the ranks holding too many groups (`GROUP_THREADS_KEPT`)."""
        self.conns: list[multiprocessing.connection.Connection] = []
        self.procs = []
        for attempt in range(1, PORT_ATTEMPTS + 1):
            failed = self._start(free_port())
            if failed is None:
                return
            self.close(kill=True)
            if PORT_IN_USE not in failed or attempt == PORT_ATTEMPTS:
                raise RuntimeError(f"a pool of {world} ranks did not start:\n{failed}")

    def _start(self, port: int) -> str | None:
        """Start the ranks on a rendezvous at `port`; None once every rank has joined the
        group, else the first failure's traceback."""
        context = rank_context()
        self.conns, self.procs = [], []
        for rank in range(self.world):
            ours, theirs = context.Pipe()
            proc = context.Process(
                target=_serve, args=(rank, self.world, port, theirs), daemon=True,
                name=f"rank{rank}",
            )  # fmt: skip
            proc.start()
            theirs.close()
            self.conns.append(ours)
            self.procs.append(proc)
        waiting = list(self.conns)
        deadline = time.monotonic() + INIT_TIMEOUT_S + 30
        while waiting:
            ready = multiprocessing.connection.wait(
                waiting, timeout=max(0, deadline - time.monotonic())
            )
            if not ready:
                return f"ranks did not join the group in {INIT_TIMEOUT_S + 30:.0f} s"
            for conn in ready:
                try:
                    status, payload = conn.recv()
                except EOFError:
                    return "a rank died before joining the group"
                if status != "ready":
                    return payload
                waiting.remove(conn)
        return None

    def call(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> list[Any]:
        for conn in self.conns:
            conn.send((fn, args))
        results: list[Any] = [None] * self.world
        self.dirty = False
        waiting = dict(enumerate(self.conns))
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while waiting:
            left = deadline - time.monotonic()
            ready = multiprocessing.connection.wait(list(waiting.values()), timeout=max(0, left))
            if not ready:
                raise TimeoutError(f"ranks {sorted(waiting)} did not return in {CALL_TIMEOUT_S} s")
            for rank, conn in list(waiting.items()):
                if conn not in ready:
                    continue
                try:
                    status, payload, threads = conn.recv()
                except EOFError:
                    raise RuntimeError(f"rank {rank} died (exit code {self._exit(rank)})") from None
                if status == "error":
                    raise RuntimeError(f"rank {rank} failed:\n{payload}")
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
                self.dirty |= threads > GROUP_THREADS_KEPT
                del waiting[rank]
        return results

    def _exit(self, rank: int) -> int | None:
        self.procs[rank].join(timeout=5)
        return self.procs[rank].exitcode

    def close(self, kill: bool = False) -> None:
        for conn, proc in zip(self.conns, self.procs, strict=True):
            if not kill and proc.is_alive():
                try:
                    conn.send(None)
                except (BrokenPipeError, OSError):
                    kill = True
            conn.close()
        for proc in self.procs:
            if kill:
                proc.kill()
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()


_POOLS: dict[int, RankPool] = {}


def _pool(world: int) -> RankPool:
    pool = _POOLS.pop(world, None)
    if pool is None or not all(p.is_alive() for p in pool.procs):
        if pool is not None:
            pool.close(kill=True)
        pool = RankPool(world)
    _POOLS[world] = pool  # most recently used last
    while len(_POOLS) > POOL_WORLDS_KEPT:
        _POOLS.pop(next(iter(_POOLS))).close()
    return pool


@atexit.register
def close_pools(kill: bool = False) -> None:
    """End every pooled process (the next `run_ranks` starts new ones); `kill`: at once,
    without letting them leave their process groups."""
    while _POOLS:
        _POOLS.popitem()[1].close(kill=kill)


def _serve(rank: int, world: int, port: int, conn: multiprocessing.connection.Connection) -> None:
    torch.set_num_threads(1)
    if world > 1:
        try:
            init_process_group(
                "gloo", rank, world, "127.0.0.1", port, INIT_TIMEOUT_S, COLLECTIVE_TIMEOUT_S
            )
        except BaseException:
            conn.send(("failed", traceback.format_exc()))
            return
    conn.send(("ready", None))
    rng_state = torch.get_rng_state()
    own_threads = gloo_threads()
    gc.freeze()  # what the process holds now (torch's modules): no collection scans it again
    while (task := conn.recv()) is not None:
        fn, args = task
        torch.set_rng_state(rng_state)
        try:
            result = fn(rank, world, *args)
            buffer = io.BytesIO()
            torch.save(result, buffer)
            reply = ("ok", buffer.getvalue())
        except BaseException:
            reply = ("error", traceback.format_exc())
        _destroy_subgroups()
        gc.collect()  # groups a call's objects hold in reference cycles, and their threads
        conn.send((*reply, gloo_threads() - own_threads))
    if world > 1 and dist.is_initialized():
        dist.destroy_process_group()


def gloo_threads() -> int:
    """This process's threads that gloo's process groups run (Linux; 0 elsewhere)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0
    count = 0
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                count += comm.read().startswith(("gloo_", "pt_gloo"))
        except OSError:  # the thread ended while we listed them
            continue
    return count


def _destroy_subgroups() -> None:
    """Every process group the call created, so groups never pile up across calls.

    DTensor caches sharding decisions by DeviceMesh (in Python and in C++), and meshes
    compare by their ranks and names, not their groups: a later call's mesh over new
    groups would hit entries that name this call's groups. The caches go with the groups.
    """
    if not dist.is_initialized():
        return
    from torch.distributed import distributed_c10d as c10d
    from torch.distributed.tensor import DTensor

    cached = DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding
    # torch 2.9: a thread's own holder of the lru_cache, and no C++ cache beside it
    clear = getattr(cached, "cache_clear", None) or cached.cache.cache_clear
    clear()
    native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if native is not None:
        native()
    world_group = c10d.GroupMember.WORLD
    for group in list(c10d._world.pg_map):
        if group is not world_group:
            dist.destroy_process_group(group)
