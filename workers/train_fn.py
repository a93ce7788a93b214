"""The function every Ray Train worker runs.

Ray Train (TorchTrainer) places the workers, creates the process group (gloo
on CPU, NCCL on GPU) with the configured timeout and restarts the group on
failure; this function binds that group to the topology, checks that every
rank runs where the topology puts it (`ray_zep.distributed.placement`: Ray numbers the
workers node by node, in GPU order), and runs the library's rank loop, fetching
shards from the data actor and sending events to the driver.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import ray
import ray.train
import ray.train.torch
import torch

from ray_zep.config import config_from_dict
from ray_zep.data.shards import RankShard
from ray_zep.distributed.placement import WorkerPlace, check_placement, gather_places
from ray_zep.errors import CommError
from ray_zep.logs import setup_logging
from ray_zep.topology import Topology
from ray_zep.train.checkpoint import Progress
from ray_zep.train.loop import run_rank
from ray_zep.train.setup import create_comm

log = logging.getLogger(__name__)

EVENT_PUT_TIMEOUT_S = 30.0
COMM_ENV_PREFIXES = ("NCCL_", "GLOO_", "TORCH_NCCL_", "TP_SOCKET_IFNAME")
"""Environment variables that steer the collectives (set them through `runtime_env`)."""


def train_loop(loop_config: dict[str, Any]) -> None:
    """Entry point of a Ray Train worker.

    Args:
        loop_config: `config` and `topology` as plain data, the `data_actor`
            handle, the driver's `events` queue and `use_gpu`.
    """
    config = config_from_dict(loop_config["config"])
    topology = Topology.from_dict(loop_config["topology"])
    rank = ray.train.get_context().get_world_rank()
    setup_logging(rank)
    if rank == 0:
        log.info("communication environment: %s", comm_environment())
    comm = create_comm(config, topology)
    context = ray.train.get_context()
    here = WorkerPlace(ray.get_runtime_context().get_node_id(), context.get_local_rank())
    places = gather_places(comm, here)
    check_placement(places, topology)
    device = ray.train.torch.get_device() if loop_config["use_gpu"] else torch.device("cpu")
    data_actor = loop_config["data_actor"]
    events = loop_config["events"]
    timeout_s = config.comm.timeout_s
    if rank == 0:
        events.put(
            {"event": "placement", "machines": [p.machine for p in places]},
            timeout=EVENT_PUT_TIMEOUT_S,
        )

    def fetch(step: int) -> list[RankShard]:
        return fetch_shards(data_actor, step, rank, timeout_s)

    def start_data(progress: Progress) -> None:
        if rank != 0:  # one data actor serves every rank
            return
        ray.get(data_actor.start.remote(progress.step, progress.cursor or None), timeout=timeout_s)

    def report(event: dict) -> None:
        events.put(event, timeout=EVENT_PUT_TIMEOUT_S)

    run_rank(config, comm, device, Path(config.train.out_dir), fetch, start_data, report)


def fetch_shards(data_actor: Any, step: int, rank: int, timeout_s: float) -> list[RankShard]:
    """This rank's shards of `step` (one per micro-batch), read from the object store."""
    try:
        refs = ray.get(data_actor.get_shards.remote(step, rank, timeout_s), timeout=timeout_s + 10)
        return ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise CommError(
            f"rank {rank} got no shard for step {step} within comm.timeout_s={timeout_s:g}"
        ) from None


def comm_environment() -> str:
    """The NCCL / gloo settings this worker sees, as `KEY=value` pairs."""
    found = sorted(k for k in os.environ if k.startswith(COMM_ENV_PREFIXES))
    if not found:
        return "library defaults (no NCCL_*, GLOO_* or TORCH_NCCL_* variables set)"
    return " ".join(f"{key}={os.environ[key]}" for key in found)
