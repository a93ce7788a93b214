"""The driver's side of an elastic run (`ray.min_nodes`): room for whole nodes.

Ray Train sizes an elastic worker group itself (`ScalingConfig(num_workers=(min, max))`)
and waits, without a limit, while the cluster holds fewer than the minimum. The driver
counts the room the cluster has, in whole topology nodes (a Ray node of 2G GPUs holds
two), and stops the run with one line naming `ray.min_nodes` when it stays below the
minimum for `comm.init_timeout_s`: before training starts, and after a node is lost.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import ray

from ray_zep.errors import TopologyError

POLL_S = 1.0
STALE_VIEW_RETRY_S = 5.0
"""The longest an elastic group's start waits for its placement. Ray Train starts an
elastic group only at a size its view of the cluster has room for, and that view is
refreshed about every 20 s: right after a node is lost it may still count the lost node.
A placement that takes longer than this is that stale size; Ray Train then gives up and
decides again on a fresh view (a controller retry, not one of `ray.max_failures`)."""


def placement_wait_s(init_timeout_s: float, elastic: bool) -> float:
    """How long Ray Train waits to place a worker group: `comm.init_timeout_s` for a
    fixed group (an autoscaling cluster may be adding its nodes), at most
    STALE_VIEW_RETRY_S for an elastic one."""
    return min(init_timeout_s, STALE_VIEW_RETRY_S) if elastic else init_timeout_s


def node_room(gpus_per_node: int, use_gpu: bool) -> int:
    """Whole topology nodes the alive Ray nodes have room for (one worker a GPU, or a
    CPU on a CPU cluster)."""
    resource = "GPU" if use_gpu else "CPU"
    return sum(
        int(node["Resources"].get(resource, 0)) // gpus_per_node
        for node in ray.nodes()
        if node.get("Alive")
    )


class RoomWatch:
    """Raises once the room stays below `least` nodes for `timeout_s`.

    Args:
        room: returns the room now, in whole nodes.
        least: `ray.min_nodes`.
        timeout_s: `comm.init_timeout_s`.
    """

    def __init__(self, room: Callable[[], int], least: int, timeout_s: float) -> None:
        self.room = room
        self.least = least
        self.timeout_s = timeout_s
        self._short_since: float | None = None
        self._checked = float("-inf")

    def check(self, now: float | None = None, what: str = "training cannot go on") -> None:
        """Look at the room (at most every POLL_S seconds).

        Raises:
            TopologyError: it has been below `least` for `timeout_s`.
        """
        now = time.monotonic() if now is None else now
        if now - self._checked < POLL_S:
            return
        self._checked = now
        room = self.room()
        if room >= self.least:
            self._short_since = None
            return
        if self._short_since is None:
            self._short_since = now
        if now - self._short_since >= self.timeout_s:
            raise TopologyError(
                f"config key ray.min_nodes={self.least}: the Ray cluster has had room for "
                f"{room} node(s) for comm.init_timeout_s={self.timeout_s:g} s, {what}; add "
                "nodes, or lower ray.min_nodes"
            )

    def wait(self, what: str) -> None:
        """Block until the room reaches `least`.

        Raises:
            TopologyError: it did not within `timeout_s`.
        """
        while True:
            self.check(what=what)
            if self._short_since is None:
                return
            time.sleep(POLL_S)
