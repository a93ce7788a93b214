"""Creating the default process group outside Ray (tests, torchrun-style launches)."""

from __future__ import annotations

import datetime
import socket

import torch.distributed as dist


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that nothing listens on now (for a local rendezvous)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def init_process_group(
    backend: str,
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    init_timeout_s: float,
    timeout_s: float,
) -> None:
    """Join the default process group over TCP rendezvous.

    Rendezvous waits at most `init_timeout_s`; the Comm built on top of the group
    gives every later collective `timeout_s`.
    """
    dist.init_process_group(
        backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=max(init_timeout_s, timeout_s)),
    )
