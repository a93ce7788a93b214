"""The host usage of the driver and the data actor, for every step's row.

The ranks measure their own at the end of each step (`StepStats.host`); the driver adds
its own and the data actor's, which it asks for in the background and uses as last heard,
so a step's row never waits on the actor (nor fails while Ray starts it again).
"""

from __future__ import annotations

import contextlib
from typing import Any

import ray

from ray_zep.host_usage import HostUsage, host_usage

DRIVER = "driver"
DATA = "data"


class UsagePoll:
    """Args:
    data_actor: the run's DataActor handle.
    """

    def __init__(self, data_actor: Any) -> None:
        self.data_actor = data_actor
        self._pending: ray.ObjectRef | None = data_actor.host_usage.remote()
        self._data: HostUsage | None = None

    def sample(self) -> dict[str, HostUsage]:
        """`driver` now and `data` as last heard (asked from the start, so it has answered
        by the first step; absent until it has)."""
        if self._pending is not None and ray.wait([self._pending], timeout=0)[0]:
            with contextlib.suppress(ray.exceptions.RayError):  # it died; Ray restarts it
                self._data = ray.get(self._pending)
            self._pending = None
        if self._pending is None:
            self._pending = self.data_actor.host_usage.remote()
        found = {DRIVER: host_usage()}
        if self._data is not None:
            found[DATA] = self._data
        return found
