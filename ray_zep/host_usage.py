"""What a process holds of its host: resident memory and open file descriptors.

Every rank, the data actor and the driver report these with each step (metrics.jsonl
`rss_bytes` and `open_fds`, Prometheus `ray_zep_process_*`), so a long run shows
whether any of them grows (`ray-zep bench soak` reads them back).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class HostUsage:
    rss_bytes: int
    """Resident set size."""
    open_fds: int
    """Open file descriptors (handles on Windows)."""


_PROCESS: dict[int, psutil.Process] = {}
"""This process's handle, by pid (a forked child must not read its parent's)."""


def host_usage() -> HostUsage:
    """This process's usage now (tens of microseconds: two reads under /proc on Linux)."""
    pid = os.getpid()
    process = _PROCESS.get(pid)
    if process is None:
        _PROCESS.clear()
        process = _PROCESS[pid] = psutil.Process(pid)
    fds = process.num_fds() if hasattr(process, "num_fds") else process.num_handles()
    return HostUsage(int(process.memory_info().rss), int(fds))
