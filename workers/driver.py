"""The driver of `ray-zep train`.

It validates the run (before touching a cluster), joins a Ray cluster or starts
a local one (`ray_zep_workers.cluster`), starts the data actor, and runs the
training workers through Ray Train's TorchTrainer, which places them, builds the
process group (gloo on CPU, NCCL on GPU) and restarts them from the last checkpoint
on failure (`ray.max_failures`). While training runs, rank 0's per-step events arrive on
a Ray queue and feed the progress bar, the Prometheus endpoint and
metrics.jsonl; when training ends, the driver draws the run's pictures next to it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.train import FailureConfig, LoggingConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer
from ray.util.queue import Empty, Queue
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ray_zep.config import Config, config_to_dict
from ray_zep.costmodel import datasheet_peak_flops
from ray_zep.errors import ZepError, find_zep_error
from ray_zep.report.run_plots import draw_run
from ray_zep.topology_resolve import resolve_topology
from ray_zep.tracking import open_trackers
from ray_zep.train.setup import RunPlan, least_nodes, prepare_run
from ray_zep_workers.cluster import check_node_room, check_room, connect, disconnect
from ray_zep_workers.data_actor import DataActor
from ray_zep_workers.elastic import RoomWatch, node_room, placement_wait_s
from ray_zep_workers.failure_notes import FAILURE_EVENT, FailureNotes, ray_train_console_level
from ray_zep_workers.metrics_export import RESIZE_LOST, RESIZE_RETURNED, MetricsExporter
from ray_zep_workers.probe import probe_cluster
from ray_zep_workers.progress import ProgressBar
from ray_zep_workers.train_fn import INPUT_ERROR_EVENT, train_loop
from ray_zep_workers.usage import UsagePoll

log = logging.getLogger(__name__)

WORKER_GROUP_START_TIMEOUT_ENV_VAR = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"
EVENT_POLL_S = 0.5


@dataclass(frozen=True)
class RunSummary:
    """What a finished run did."""

    run_dir: Path
    first_step: int
    last_step: int
    first_loss: float | None
    final_loss: float | None
    tokens: int
    tokens_per_second: float
    metrics_port: int | None
    restarts: int = 0
    """Times Ray Train restarted the workers from the last checkpoint."""
    machines: tuple[str, ...] = ()
    """The Ray node id each rank ran on (rank order), as the last worker group reported."""
    world_sizes: tuple[int, ...] = ()
    """The ranks of each worker group that trained, in start order (an elastic run's
    groups shrink and grow)."""


def train(config: Config) -> RunSummary:
    """Run training as `config` says and return its summary.

    Raises:
        ZepError subclasses (unwrapped from Ray's wrappers) for bad input,
        lost peers and timeouts.
    """
    plan = prepare_run(config)
    connection = connect(plan.config, plan.num_workers)
    try:
        least = least_nodes(plan.config, plan.topology)
        topology, origin = resolve_topology(
            probe_cluster(plan.config.comm.init_timeout_s), plan.topology, least
        )
        log.info("topology: %s", origin)
        plan = dataclasses.replace(plan, topology=topology)
        elastic = least < topology.nodes
        # an elastic run waits for room below (an autoscaling cluster may be growing)
        use_gpu = check_room(plan.config, 0 if elastic else plan.num_workers, connection)
        if not elastic:  # an elastic run counts whole nodes as it waits for them (below)
            check_node_room(topology, use_gpu)
        metrics = plan.config.metrics
        peak = metrics.peak_tflops * 1e12 or (
            datasheet_peak_flops(topology.gpu_model) if use_gpu else None
        )
        trackers = open_trackers(metrics, plan.run_dir, config_to_dict(plan.config))
        exporter = MetricsExporter(plan.run_dir, metrics.port, metrics.host, peak, trackers)
        exporter.set_ranks(plan.num_workers)
        watch = None
        if elastic:
            room = functools.partial(node_room, topology.gpus_per_node, use_gpu)
            watch = RoomWatch(room, least, plan.config.comm.init_timeout_s)
            watch.wait("training cannot start")
        wait_s = placement_wait_s(plan.config.comm.init_timeout_s, elastic)
        try:
            with _placement_wait(wait_s):
                return _run(plan, use_gpu, exporter, least, watch)
        finally:
            exporter.close()
    except Exception as exc:
        found = find_zep_error(exc)
        if found is not None and found is not exc:
            raise found from None
        raise
    finally:
        disconnect(connection)


def _run(
    plan: RunPlan, use_gpu: bool, exporter: MetricsExporter, least: int, watch: RoomWatch | None
) -> RunSummary:
    config = plan.config
    config_data = config_to_dict(config)
    # The data actor and the event queue live beside the driver: a lost worker node
    # takes neither with it (and the job ends with the driver's node anyway).
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    data_actor = (
        ray.remote(DataActor)
        .options(
            num_cpus=0,  # I/O-light; must never take a CPU slot a training worker needs
            max_concurrency=plan.num_workers + 4,
            max_restarts=-1,  # each restart fails the workers' step: ray.max_failures bounds it
            scheduling_strategy=here,
        )
        .remote(config_data, plan.topology.to_dict())
    )
    data_ready = data_actor.ready.remote()  # awaited once Ray Train's controller is starting
    events = Queue(actor_options={"num_cpus": 0, "scheduling_strategy": here})
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={
            "config": config_data,
            "topology": plan.topology.to_dict(),
            "data_actor": data_actor,
            "events": events,
            "use_gpu": use_gpu,
        },
        scaling_config=_scaling(plan, use_gpu, least),
        torch_config=TorchConfig(
            backend="nccl" if use_gpu else "gloo",
            timeout_s=int(max(config.comm.init_timeout_s, config.comm.timeout_s)),
        ),
        run_config=RunConfig(
            name="ray_zep",
            storage_path=str(plan.run_dir / "ray_train"),
            failure_config=FailureConfig(max_failures=config.ray.max_failures),
            callbacks=[FailureNotes(events)],
            logging_config=LoggingConfig(log_level=ray_train_console_level()),
        ),
    )
    progress = ProgressBar(config.train.steps, enabled=config.metrics.progress)
    watcher = _Watcher(exporter, progress, plan.topology.nodes, UsagePoll(data_actor))
    outcome: dict[str, Any] = {}

    def fit() -> None:
        try:
            outcome["result"] = trainer.fit()
        except BaseException as exc:  # re-raised in the driver's thread below
            outcome["error"] = exc

    thread = threading.Thread(target=fit, name="ray-zep-fit", daemon=True)
    thread.start()
    # the data actor (imports, the dataset read whole) starts while the controller does;
    # one that cannot start ends the run here
    ray.get(data_ready, timeout=config.comm.init_timeout_s)
    while thread.is_alive() and watcher.input_error is None:
        watcher.drain(events, block=True)
        if watch is not None:
            watch.check(what=f"training cannot go on after step {watcher.last_step}")
    watcher.drain(events, block=False)
    progress.close()
    ray.kill(data_actor)
    if watcher.input_error is not None:  # no restart gets past bad input
        raise watcher.input_error
    if "error" in outcome:
        raise outcome["error"]
    _draw_pictures(plan.run_dir)
    return watcher.summary(plan.run_dir, exporter.port)


@contextlib.contextmanager
def _placement_wait(seconds: float):
    """Ray Train's wait for a worker group's placement, for one run: its controller reads
    the variable when the run starts. A value exported before the run is kept."""
    if WORKER_GROUP_START_TIMEOUT_ENV_VAR in os.environ:
        yield
        return
    os.environ[WORKER_GROUP_START_TIMEOUT_ENV_VAR] = f"{seconds:g}"
    try:
        yield
    finally:
        del os.environ[WORKER_GROUP_START_TIMEOUT_ENV_VAR]


def _scaling(plan: RunPlan, use_gpu: bool, least: int) -> ScalingConfig:
    """A fixed worker group, or for an elastic run whole nodes' worth of workers from
    `least` (ray.min_nodes) to topology.nodes (a run on fewer cuts each global batch into
    micro-batches; the workers of a partial node stay idle)."""
    if least == plan.topology.nodes:
        return ScalingConfig(num_workers=plan.num_workers, use_gpu=use_gpu)
    return ScalingConfig(
        num_workers=(least * plan.topology.gpus_per_node, plan.num_workers),
        use_gpu=use_gpu,
        elastic_resize_monitor_interval_s=plan.config.ray.resize_interval_s,
    )


def _draw_pictures(run_dir: Path) -> None:
    """loss.png, throughput.png and load.png of the finished run, into its directory.

    A picture is a convenience: whatever goes wrong drawing it (no matplotlib, a
    malformed row, a full disk) is a warning, never the failure of a finished run.
    """
    try:
        for path in draw_run(run_dir):
            log.info("wrote %s", path)
    except Exception as exc:
        log.warning("run pictures not drawn in %s: %s: %s", run_dir, type(exc).__name__, exc)


class _Watcher:
    """Turns rank 0's events into progress, metrics and a run summary."""

    def __init__(
        self, exporter: MetricsExporter, progress: ProgressBar, nodes: int, usage: UsagePoll
    ) -> None:
        self.exporter = exporter
        self.usage = usage
        self.progress = progress
        self.started = False
        self.restarts = 0
        self.first_step = 0
        self.last_step = 0
        self.first_loss: float | None = None
        self.final_loss: float | None = None
        self.machines: tuple[str, ...] = ()
        self.nodes = nodes
        """The nodes the workers train on now."""
        self.world_sizes: list[int] = []
        """The ranks of each worker group, in start order."""
        self.heard = time.monotonic()
        """When the workers last reported progress (a step, checkpoint or evaluation)."""
        self.input_error: ZepError | None = None
        """The bad input a worker met first (`INPUT_ERROR_EVENT`): the run ends with it."""

    def drain(self, events: Queue, block: bool) -> None:
        while True:
            try:
                event = events.get(block=block, timeout=EVENT_POLL_S if block else None)
            except Empty:
                return
            self.handle(event)
            block = False

    def handle(self, event: dict[str, Any]) -> None:
        kind = event["event"]
        if kind in ("step", "checkpoint", "eval"):
            self.heard = time.monotonic()
        if kind == "start":
            nodes = event.get("nodes", self.nodes)
            if self.started:  # Ray Train restarted the workers from the last checkpoint
                self.exporter.on_restart()
                self.restarts += 1
                idle = time.monotonic() - self.heard
                log.warning(
                    "workers restarted from the checkpoint of step %d (%.0f s without a step)",
                    event["step"], idle,
                )  # fmt: skip
                if nodes != self.nodes:
                    reason = RESIZE_LOST if nodes < self.nodes else RESIZE_RETURNED
                    self.exporter.on_resize(reason)
                    log.warning(
                        "resize: from %d to %d nodes (%s), resuming after step %d",
                        self.nodes, nodes, reason.replace("_", " "), event["step"],
                    )  # fmt: skip
            else:
                self.first_step = event["step"]
            self.started = True
            self.nodes = nodes
            self.world_sizes.append(event.get("world_size", self.exporter.ranks))
            self.exporter.on_start(event["step"], nodes, self.world_sizes[-1])
            self.last_step = event["step"]
            self.progress.start(event["step"])
        elif kind == "step":
            row = self.exporter.on_step(event, self.usage.sample())
            self.progress.update(row)
            self.last_step = row["step"]
            self.final_loss = row["loss"]
            if self.first_loss is None:
                self.first_loss = row["loss"]
        elif kind == "checkpoint":
            self.exporter.on_checkpoint(event["step"])
        elif kind == "eval":
            row = self.exporter.on_eval(event)
            log.info(
                "step %d: validation loss %.4f on %d label tokens of data.eval_source (%.1f s)",
                row["step"], row["eval_loss"], row["eval_label_tokens"], row["eval_seconds"],
            )  # fmt: skip
        elif kind == FAILURE_EVENT:
            errors = event["errors"]
            rank, first = next(iter(errors.items()))
            others = f" (and {len(errors) - 1} more rank(s))" if len(errors) > 1 else ""
            log.warning("worker group failed after step %d: rank %d: %s%s",
                        self.last_step, rank, first, others)  # fmt: skip
        elif kind == INPUT_ERROR_EVENT:
            if self.input_error is None:
                self.input_error = event["error"]
        elif kind == "placement":
            self.machines = tuple(event["machines"])
            log.info("ranks run on Ray nodes %s", [m[:12] for m in self.machines])

    def summary(self, run_dir: Path, port: int | None) -> RunSummary:
        return RunSummary(
            run_dir,
            self.first_step,
            self.last_step,
            self.first_loss,
            self.final_loss,
            self.progress.tokens,
            self.progress.average_tokens_per_second(),
            port,
            self.restarts,
            self.machines,
            tuple(self.world_sizes),
        )
