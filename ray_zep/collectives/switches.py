"""The rank's compression switches (`comm.compression`) and their byte tally.

One `AdaptiveCollectives` per group that carries compressible traffic: the
job's group (gradient all-reduce, ring K/V) and, under FSDP2, the shard group.
They share the rank's `StreamTally`, which the trainer sums over ranks each
step into metrics.jsonl's `compression` (bytes per stream, raw and on the wire).
Groups as large as the job reuse its profile instead of measuring again.
"""

from __future__ import annotations

from ray_zep.collectives.adaptive import AdaptiveCollectives
from ray_zep.collectives.tally import StreamTally
from ray_zep.config import Compression, Config
from ray_zep.distributed import Comm
from ray_zep.distributed.group import Group


class CompressionSwitches:
    """The switches of one rank (collective to build when compression is on).

    Attributes:
        tally: bytes per stream since the last step's accounting.
        world: the job group's switch; None with compression off or one process.
    """

    def __init__(self, config: Config, comm: Comm) -> None:
        self.tally = StreamTally()
        self._config = config.comm
        self._on = config.comm.compression is not Compression.OFF and comm.group is not None
        self.world = self._new(comm.world) if self._on else None

    def for_group(self, g: Group | None) -> AdaptiveCollectives | None:
        """A switch over `g` (collective over `g`), or None with compression off."""
        if not self._on or g is None:
            return None
        if self.world is not None and g.size == self.world.g.size:
            return self._new(g, self.world.switcher.profile)
        return self._new(g)

    def _new(self, g: Group, profile=None) -> AdaptiveCollectives:
        c = self._config
        refresh, streams = c.compression_refresh_calls, c.compression_streams
        return AdaptiveCollectives(g, c.compression, refresh, self.tally, streams, profile)
