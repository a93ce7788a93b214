"""The data actor: builds every step's per-rank shards ahead of time.

One actor per job reads the dataset, fills global batches to the token budget,
places them on the ranks (the strategy's planner) and `ray.put`s each rank's
shard into the object store `data.prefetch` steps ahead. Workers receive object
references and read their shard straight from the store, so the actor never
serialises a shard twice and the plan is made once, in one place.

It is a threaded actor (`max_concurrency` > 1): a producer thread fills the
buffer while worker calls wait on it. `start` rewinds it to a checkpoint's
cursor; rank 0 calls it whenever training (re)starts. A typed data error (say
an overlong document under `data.overlong=error`) stays: after a restart every
shard request fails with it at once, so retries do not replay the data.

The driver creates it with `max_restarts`: when its process dies, Ray starts it again
on the driver's node, and the new process reads the dataset again (a source is read
whole when it opens, so a file that becomes unreadable later does not disturb a running
actor). Until rank 0 calls `start` (which it does before any rank asks for a shard), a
restarted actor answers every shard request with a CommError: the workers restart at
once from the newest complete checkpoint and train exactly the batches that follow it.
If the dataset cannot be read any more, the answer is the typed error naming the file,
which ends the run.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import ray

from ray_zep.config import Config, config_from_dict
from ray_zep.config.sizes import num_ranks
from ray_zep.data.batching import BatchStream, Cursor
from ray_zep.data.catalog import open_configured_source
from ray_zep.data.regroup import regroup
from ray_zep.data.shards import shard_for
from ray_zep.data.source import TokenSource
from ray_zep.errors import CommError, ZepError
from ray_zep.host_usage import HostUsage, host_usage
from ray_zep.logs import setup_logging
from ray_zep.topology import Topology

log = logging.getLogger(__name__)


class DataActor:
    """Produces shards for the batches of steps [start, train.steps), `train.micro_batches`
    batches a step, each cut into micro-batches for the live nodes if there are fewer
    than configured (`ray_zep.data.regroup`).

    Args:
        config: the run's config as plain data (`config_to_dict`).
        topology: the run's topology as plain data (`Topology.to_dict`).
    """

    def __init__(self, config: dict[str, Any], topology: dict[str, Any]) -> None:
        setup_logging(role="data")
        self.config: Config = config_from_dict(config)
        self.topology = Topology.from_dict(topology)
        self.num_ranks = num_ranks(self.config, self.topology)
        self._cond = threading.Condition()
        self._ready: dict[int, list[ray.ObjectRef]] = {}
        self._fetched: dict[int, set[int]] = {}
        self._error: BaseException | None = None
        self._data_error: ZepError | None = None
        """A typed error of the data itself: it would recur on every restart."""
        self._generation = 0
        self.source: TokenSource | None = None
        try:
            self.source = open_configured_source(self.config)
        except ZepError as exc:  # a file that became unreadable since the run started
            log.error("%s", exc)
            self._data_error = exc

    def ready(self) -> bool:
        return True

    def host_usage(self) -> HostUsage:
        """This process's resident memory and open file descriptors."""
        return host_usage()

    def start(self, step: int, cursor: dict[str, Any] | None, nodes: int | None = None) -> None:
        """Produce the batches of step `step` on, with the data cursor of the checkpoint
        before it, for training on `nodes` of the topology's nodes (default: all)."""
        with self._cond:
            live = self.topology.with_nodes(nodes or self.topology.nodes)
            self.num_ranks = num_ranks(self.config, live)
            self._generation += 1
            self._ready.clear()
            self._fetched.clear()
            self._error = self._data_error
            generation = self._generation
            self._cond.notify_all()
        if self._data_error is not None:
            log.error("data stream not restarted: %s", self._data_error)
            return
        assert self.source is not None  # opened, or _data_error holds why not
        stream = BatchStream.from_config(
            self.source,
            self.config,
            self.topology.world_size,
            cursor=Cursor.from_dict(cursor) if cursor else None,
            start_index=step * self.config.train.micro_batches,
        )
        threading.Thread(
            target=self._produce,
            args=(stream, generation, live),
            daemon=True,
            name=f"data-producer-{generation}",
        ).start()
        log.info(
            "data stream starts at step %d (cursor %s) for %d of %d nodes",
            step, cursor or "start", live.nodes, self.topology.nodes,
        )  # fmt: skip

    def get_shards(self, step: int, rank: int, timeout_s: float) -> list[ray.ObjectRef]:
        """References to rank `rank`'s shards of step `step`, one per micro-batch (in a
        list, so Ray passes the references themselves rather than resolving them)."""
        with self._cond:
            if self._generation == 0:  # rank 0 starts a stream before any rank asks for one
                raise self._data_error or CommError(
                    "the data actor's process died and Ray started it again; the workers "
                    "start again from the newest complete checkpoint"
                )
            arrived = self._cond.wait_for(
                lambda: step in self._ready or self._error is not None, timeout=timeout_s
            )
            if self._error is not None:
                raise self._error
            if not arrived:
                raise CommError(
                    f"the data actor had no shard for step {step} after comm.timeout_s="
                    f"{timeout_s:g}; the dataset may be too slow to read"
                )
            refs = self._ready[step][rank]
            taken = self._fetched.setdefault(step, set())
            taken.add(rank)
            if len(taken) == self.num_ranks:
                del self._ready[step]
                del self._fetched[step]
                self._cond.notify_all()
            return refs

    def _produce(self, stream: BatchStream, generation: int, live: Topology) -> None:
        prefetch = self.config.data.prefetch
        micro = self.config.train.micro_batches
        while stream.next_index < self.config.train.steps * micro:
            with self._cond:
                self._cond.wait_for(
                    lambda: len(self._ready) < prefetch or self._generation != generation
                )
                if self._generation != generation:
                    return
            try:
                step = stream.next_index // micro
                world = self.topology.world_size
                parts = [
                    part
                    for _ in range(micro)
                    for part in regroup(stream.next_batch(), self.config, world, live.world_size)
                ]
                per_part = [shard_for(part, self.config, live) for part in parts]
                refs = [[ray.put(shards[rank]) for shards in per_part] for rank in
                        range(num_ranks(self.config, live))]  # fmt: skip
            except BaseException as exc:  # surfaced to the workers by get_shards
                with self._cond:
                    if self._generation == generation:
                        self._error = exc
                        if isinstance(exc, ZepError):
                            self._data_error = exc
                        self._cond.notify_all()
                return
            with self._cond:
                if self._generation != generation:
                    return
                self._ready[step] = refs
                self._cond.notify_all()
