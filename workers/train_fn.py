"""The function every Ray Train worker runs.

Ray Train (TorchTrainer) places the workers, creates the process group (gloo
on CPU, NCCL on GPU) with the configured timeout and restarts the group on
failure; this function binds that group to the topology, checks that every
rank runs where the topology puts it (`ray_zep.distributed.placement`: Ray numbers the
workers node by node, in GPU order), and runs the library's rank loop, fetching
shards from the data actor and sending events to the driver.
"""

from __future__ import annotations

import datetime
import logging
import os
from pathlib import Path
from typing import Any

import ray
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist

from ray_zep.config import Config, config_from_dict
from ray_zep.data.shards import RankShard
from ray_zep.distributed import Comm
from ray_zep.distributed.placement import (
    WorkerPlace,
    check_placement,
    gather_places,
    whole_node_ranks,
)
from ray_zep.errors import CommError, TopologyError, ZepError, find_zep_error
from ray_zep.logs import setup_logging
from ray_zep.topology import Topology
from ray_zep.train.checkpoint_dirs import Progress
from ray_zep.train.setup import create_comm, least_nodes

log = logging.getLogger(__name__)

EVENT_PUT_TIMEOUT_S = 30.0
LOST_DATA_ACTOR = (
    "rank {rank} lost the data actor while {what}: its process died, and Ray starts it "
    "again; the workers restart from the newest complete checkpoint"
)
INPUT_ERROR_EVENT = "input_error"
"""A worker met bad input (`ZepError.retryable` false): `{"event", "rank", "error"}`."""
COMM_ENV_PREFIXES = ("NCCL_", "GLOO_", "TORCH_NCCL_", "TP_SOCKET_IFNAME")
"""Environment variables that steer the collectives (set them through `runtime_env`)."""


def train_loop(loop_config: dict[str, Any]) -> None:
    """Entry point of a Ray Train worker.

    Args:
        loop_config: `config` and `topology` (the configured one) as plain data, the
            `data_actor` handle, the driver's `events` queue and `use_gpu`.
    """
    config = config_from_dict(loop_config["config"])
    configured = Topology.from_dict(loop_config["topology"])
    context = ray.train.get_context()
    setup_logging(context.get_world_rank())
    if context.get_world_rank() == 0:
        log.info("communication environment: %s", comm_environment())
    here = WorkerPlace(ray.get_runtime_context().get_node_id(), context.get_local_rank())
    places = gather_places(here)
    joined = _live_comm(config, configured, places)
    if joined is None:
        return  # a worker of a partial node: it idles until the group ends
    comm, chosen = joined
    live = [places[r] for r in chosen]
    check_placement(live, comm.topology)
    device = ray.train.torch.get_device() if loop_config["use_gpu"] else torch.device("cpu")
    data_actor = loop_config["data_actor"]
    events = loop_config["events"]
    timeout_s = config.comm.timeout_s
    rank = comm.rank
    nodes = comm.topology.nodes
    if rank == 0:
        events.put(
            {"event": "placement", "machines": [p.machine for p in live]},
            timeout=EVENT_PUT_TIMEOUT_S,
        )

    def fetch(step: int) -> list[RankShard]:
        return fetch_shards(data_actor, step, rank, timeout_s)

    def start_data(progress: Progress) -> None:
        if rank != 0:  # one data actor serves every rank
            return
        started = data_actor.start.remote(progress.step, progress.cursor or None, nodes)
        try:
            ray.get(started, timeout=timeout_s)
        except ray.exceptions.RayActorError:
            raise CommError(LOST_DATA_ACTOR.format(rank=rank, what="starting the data")) from None

    def report(event: dict) -> None:
        if event["event"] == "start":
            event = {**event, "nodes": nodes, "world_size": comm.world_size}
        events.put(event, timeout=EVENT_PUT_TIMEOUT_S)

    # The training stack (the engine, torch.distributed.checkpoint) is imported here, in
    # the worker: the driver imports this module for `train_loop` alone and starts 0.7 s
    # sooner without it.
    from ray_zep.train.loop import run_rank

    try:
        run_rank(config, comm, device, Path(config.train.out_dir), fetch, start_data, report)
    except Exception as exc:
        found = find_zep_error(exc)
        if found is None or found.retryable:
            raise  # Ray Train restarts the group from the last checkpoint
        stop_the_run(events, found, rank)


def stop_the_run(events: Any, error: ZepError, rank: int) -> None:
    """Hand bad input met in a worker to the driver, which ends the run with its one line.

    Raising it would make Ray Train start the group again, `ray.max_failures` times, to
    meet the same error each time. The worker returns instead: when every rank meets
    it (a model file or a data error reaches them all) the group ends at once and the
    driver raises it; when only some do, the driver ends the run on the first report.
    """
    log.info("rank %d stops the run: %s", rank, error)
    try:
        events.put(
            {"event": INPUT_ERROR_EVENT, "rank": rank, "error": error},
            timeout=EVENT_PUT_TIMEOUT_S,
        )
    except Exception:  # the driver is gone: let Ray Train see the error itself
        raise error from None


def _live_comm(
    config: Config, configured: Topology, places: list[WorkerPlace]
) -> tuple[Comm, list[int]] | None:
    """This worker's Comm on the nodes it trains on and the worker ranks that train, or
    None for a worker left out.

    A fixed run trains on every worker. An elastic run (`ray.min_nodes`) trains on the
    whole topology nodes among its workers: Ray Train gives it between ray.min_nodes and
    topology.nodes nodes' worth, and a machine may hold part of a node.

    Raises:
        TopologyError: an elastic group holds fewer whole nodes than ray.min_nodes.
    """
    least = least_nodes(config, configured)
    gpus = configured.gpus_per_node
    if least == configured.nodes:
        return create_comm(config, configured), list(range(len(places)))
    chosen = whole_node_ranks(places, gpus, configured.nodes)
    nodes = len(chosen) // gpus
    if nodes < least:
        raise TopologyError(
            f"config key ray.min_nodes={least}: Ray placed {len(places)} workers, which hold "
            f"{nodes} whole node(s) of topology.gpus_per_node={gpus} workers"
        )
    rank = ray.train.get_context().get_world_rank()
    if rank == 0:
        log.info(
            "elastic run: training on %d of topology.nodes=%d nodes (%d ranks)%s",
            nodes, configured.nodes, len(chosen),
            "" if len(chosen) == len(places) else
            f"; {len(places) - len(chosen)} worker(s) of a partial node stay idle",
        )  # fmt: skip
    topology = configured.with_nodes(nodes)
    if len(chosen) == len(places):
        return create_comm(config, topology), chosen
    # every worker of the default group takes part in creating the subgroup
    group = dist.new_group(ranks=chosen, timeout=datetime.timedelta(seconds=config.comm.timeout_s))
    if rank not in chosen:
        log.info("worker %d is on a partial node: it does not train", rank)
        return None
    return create_comm(config, topology, group=group), chosen


def fetch_shards(data_actor: Any, step: int, rank: int, timeout_s: float) -> list[RankShard]:
    """This rank's shards of `step` (one per micro-batch), read from the object store."""
    try:
        refs = ray.get(data_actor.get_shards.remote(step, rank, timeout_s), timeout=timeout_s + 10)
        return ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise CommError(
            f"rank {rank} got no shard for step {step} within comm.timeout_s={timeout_s:g}"
        ) from None
    except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError):
        # the actor's process died (a shard it stored dies with it); Ray starts it again
        what = f"fetching its shard of step {step + 1}"
        raise CommError(LOST_DATA_ACTOR.format(rank=rank, what=what)) from None


def comm_environment() -> str:
    """The NCCL / gloo settings this worker sees, as `KEY=value` pairs."""
    found = sorted(k for k in os.environ if k.startswith(COMM_ENV_PREFIXES))
    if not found:
        return "library defaults (no NCCL_*, GLOO_* or TORCH_NCCL_* variables set)"
    return " ".join(f"{key}={os.environ[key]}" for key in found)
