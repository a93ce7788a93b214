"""The Ray layer end to end: driver, data actor and Ray Train workers on a local cluster."""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import ray
from ray.cluster_utils import Cluster
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ray_zep import steplog
from ray_zep.config import config_to_dict, load_config
from ray_zep.constants import METRICS_FILE_NAME
from ray_zep.data.builder import write_token_parquet
from ray_zep.errors import (
    ClusterError,
    CommError,
    CorruptDatasetError,
    OverlongDocumentError,
    TopologyError,
)
from ray_zep.topology import build_topology
from ray_zep.topology_resolve import resolve_topology
from ray_zep.train.checkpoint_dirs import checkpoint_path, latest_checkpoint
from ray_zep.train.ledger import read_ledger
from ray_zep_workers.data_actor import DataActor
from ray_zep_workers.driver import RunSummary, train
from ray_zep_workers.probe import probe_cluster
from tests.helpers.procs import free_port, run_ranks
from tests.helpers.prometheus import (
    PrometheusServer,
    has_finite_sample,
    prometheus_binary,
    start_prometheus,
)
from tests.helpers.training import (
    SMALL_RUN,
    checkpoint_params,
    jsonl_losses,
    max_relative_error,
    tokens_per_step,
    train_rank,
)

pytestmark = pytest.mark.ray

REPO = Path(__file__).resolve().parents[1]

# See tests/test_train_dist.py for why fp32 dp and single agree to ~1e-6 and not bit for bit.
REL_TOL = 1e-5
BASE = [
    *SMALL_RUN,
    "topology.nodes=2",
    "topology.gpus_per_node=2",
    "metrics.port=-1",
    "train.checkpoint_every=2",
    # data parallel: whole sequences packed per rank, replicated weights
    "parallel.sequence=whole",
    "parallel.weights=replicated",
    "parallel.routing=false",
    "parallel.remap=false",
    "data.packing=rank",
]


NODE = {"num_cpus": 2, "object_store_memory": 96 * 1024 * 1024}
HEAD = {**NODE, "include_dashboard": False}
"""No Ray dashboard: nothing here reads it (Grafana's panels query the run's own
exporter), and its dozen processes took about 4 s of every start of this module."""


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    """Three Ray nodes on this machine with two CPUs each: wherever Ray packs the four
    workers of a 2 x 2 run, each node holds two of them (one topology node)."""
    cluster = Cluster(initialize_head=True, head_node_args=HEAD)
    for _ in range(2):
        cluster.add_node(**NODE)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    _fast_resource_view()
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def _fast_resource_view() -> None:
    """Ray Train's elastic policy sees the cluster through Ray's AutoscalingCoordinator, a
    detached actor that refreshes its view every 20 s, so a returned node is noticed up to
    20 s late (README, "Elastic runs"). The tests start that actor first, by its name,
    refreshing every second: whether a group grows back then does not hang on how long
    the smaller group happens to train. It lives on the head, as Ray Train places its own
    (beside the driver): on a node the test removes it would restart empty, and the run's
    request for workers reaches it again only 20 s later."""
    from ray.data._internal.cluster_autoscaler import default_autoscaling_coordinator as ac

    class EverySecond(ac._AutoscalingCoordinatorActor):
        TICK_INTERVAL_S = 1

    ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)(EverySecond).options(
        name="AutoscalingCoordinator",
        namespace="AutoscalingCoordinator",
        get_if_exists=True,
        lifetime="detached",
        scheduling_strategy=NodeAffinitySchedulingStrategy(
            ray.get_runtime_context().get_node_id(), soft=False
        ),
    ).remote()


def _train(out: Path, *overrides: str):
    """A short demo run: conf/demo.yaml made small by BASE."""
    demo = REPO / "conf" / "demo.yaml"
    return train(load_config(demo, [*BASE, f"train.out_dir={out}", *overrides]))


ELASTIC_STEPS = 8
TORN_STEP = 4
"""The elastic run loses a node while this step's checkpoint is being written."""
HELD_STEP = 6
"""The smaller group's save of this step waits until the group grows again."""
THREE_NODES = [
    *SMALL_RUN,
    "topology.nodes=3",
    "topology.gpus_per_node=2",
    "train.checkpoint_every=2",
    f"train.steps={ELASTIC_STEPS}",
    # a group start, or room for ray.min_nodes, that takes longer fails the test
    "comm.init_timeout_s=25",
]
ELASTIC = [
    *THREE_NODES,
    "parallel.sequence=zeppelin",
    "parallel.weights=fsdp",
    "parallel.routing=true",
    "parallel.remap=true",
    "data.packing=budget",
    "data.max_doc_tokens=256",  # a sequence fits two nodes' budget
]
TAWPIPE = [
    *THREE_NODES,
    "parallel.sequence=whole",
    "parallel.weights=tawpipe",
    "model.n_layers=4",  # a unit for each of the six ranks: embedding, 4 blocks, output
    "parallel.routing=false",
    "parallel.remap=false",
    "data.packing=rank",
]


@dataclass
class ScrapedRun:
    out: Path
    summary: RunSummary
    prometheus: PrometheusServer | None
    """None where the prometheus package is missing."""
    started: float
    ended: float


@pytest.fixture(scope="module")
def elastic_run(local_ray: Cluster, tmp_path_factory: pytest.TempPathFactory):
    """zeppelin + fsdp (routing and remapping on, every stream they use compressed,
    routed_kv's framed relay on three nodes too) on 3 x 2 with ray.min_nodes=2,
    its metrics scraped by a real Prometheus server. A node is removed
    while the checkpoint of step 4 is being written, the run goes on with two nodes from
    step 2's checkpoint, the node comes back and the group grows to three again."""
    binary = shutil.which("prometheus")
    out = tmp_path_factory.mktemp("ray_train")
    port = free_port()
    prometheus = start_prometheus(binary, port, out / "prometheus") if binary else None
    run_dir = out / "elastic"
    # metrics.peak_tflops: no datasheet peak on a CPU, and MFU needs one
    elastic = [*ELASTIC, f"train.out_dir={run_dir}", "ray.min_nodes=2",
               "ray.resize_interval_s=1", "comm.compression=always", f"metrics.port={port}",
               "comm.compression_streams=[kv,routed_kv,fsdp_all_gather,fsdp_reduce_scatter,remap_all_to_all]",
               "metrics.peak_tflops=0.001"]  # fmt: skip
    try:
        started = time.time()
        summary = _lose_a_node_and_get_it_back(local_ray, elastic, run_dir, world=6)
        yield ScrapedRun(run_dir, summary, prometheus, started, time.time())
    finally:
        if prometheus:
            prometheus.stop()


def _lose_a_node_and_get_it_back(
    cluster: Cluster, overrides: list[str], run_dir: Path, world: int
) -> RunSummary:
    """Train conf/demo.yaml with `overrides` on the cluster's three nodes; remove a node
    while the checkpoint of step 4 is being written, and add it back once the smaller group
    has checkpointed a step of its own. The run's summary.

    The save is caught in the middle for certain: each rank's data file of step 4 is a
    named pipe before the run starts, so every rank blocks opening it (no reader) until
    its node is gone or its group is stopped. The smaller group cannot end the run before
    the group grows back: its rank files of step 6 are pipes too, taken away once the grown
    group has trained a step (a group that reaches them first waits for the driver's
    restart of a silent group, which then saves step 6 as files)."""
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["summary"] = train(load_config(REPO / "conf" / "demo.yaml", overrides))
        except BaseException as exc:
            outcome["error"] = exc

    torn = _pipes_in_place_of_rank_files(checkpoint_path(run_dir, TORN_STEP), world)
    fit = threading.Thread(target=run, daemon=True)
    fit.start()
    _wait_for(lambda: _last_step(run_dir) >= TORN_STEP, fit, outcome, f"step {TORN_STEP}")
    cluster.remove_node(next(iter(cluster.worker_nodes)))
    smaller = world * 2 // 3
    held = _pipes_in_place_of_rank_files(checkpoint_path(run_dir, HELD_STEP), smaller)
    for pipe in torn:  # the smaller group writes step 4's checkpoint as files
        pipe.unlink()
    # the node returns once the smaller group has checkpointed a step of its own: the
    # grown group resumes from there, so the rows of two nodes' steps stay in the file
    shrunk = "a checkpoint of a step on two nodes"
    try:
        _wait_for(lambda: _checkpointed_on(run_dir, smaller), fit, outcome, shrunk)
    finally:  # the module's other tests need three nodes
        cluster.add_node(**NODE)
    try:
        _wait_for(lambda: _grew_after(run_dir, smaller, world), fit, outcome, "a grown group")
    finally:
        for pipe in held:  # the grown group writes step 6's checkpoint as files
            pipe.unlink()
    _wait_for(lambda: not fit.is_alive(), fit, outcome, "the end of the run", timeout_s=300)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["summary"]


def test_an_elastic_run_loses_a_node_and_grows_back_as_one_run(
    elastic_run: ScrapedRun, tmp_path: Path
) -> None:
    """Losses, parameters and the tokens of every step equal one process training the
    same global batches without interruption (the library's rank loop, the code every
    Ray worker runs)."""
    _assert_trained_as_one_run(elastic_run.summary, elastic_run.out, ELASTIC, tmp_path)


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("RAY_ZEP_ALL_RAY_TESTS") != "1",
    reason="a minute of the suite's ten: set RAY_ZEP_ALL_RAY_TESTS=1. Its parts run by "
    "default: the node loss and return through Ray (zeppelin + fsdp, above) and the "
    "weight-passing ring rebuilt for fewer ranks and more again (tests/test_elastic.py, "
    "whole+tawpipe)",
)
def test_weight_passing_loses_a_node_and_grows_back_as_one_run(
    local_ray: Cluster, tmp_path: Path
) -> None:
    """whole + tawpipe on 3 x 2 with ray.min_nodes=2, through the same node loss (during
    step 4's save) and return as the zeppelin + fsdp run: the weight-passing ring is
    rebuilt for two nodes and for three again."""
    run_dir = tmp_path / "elastic"
    overrides = [*TAWPIPE, f"train.out_dir={run_dir}", "ray.min_nodes=2",
                 "ray.resize_interval_s=1"]  # fmt: skip
    summary = _lose_a_node_and_get_it_back(local_ray, overrides, run_dir, world=6)
    _assert_trained_as_one_run(summary, run_dir, TAWPIPE, tmp_path)


def _assert_trained_as_one_run(
    summary: RunSummary, out: Path, composition: list[str], tmp_path: Path
) -> None:
    """The run that lost a node and got it back against one process training the same
    global batches."""
    assert summary.world_sizes[0] == 6 and 4 in summary.world_sizes, summary.world_sizes
    assert summary.world_sizes[-1] == 6, f"the group did not grow back: {summary.world_sizes}"
    # two ranks on each Ray node, in rank order: the topology's nodes
    nodes = summary.machines
    assert len(nodes) == 6 and len(set(nodes)) == 3, nodes
    assert all(nodes[r] == nodes[r + 1] != nodes[r + 2] for r in (0, 2)), nodes

    single_dir = tmp_path / "single"
    single = [*composition, "parallel.sequence=single", "parallel.weights=replicated",
              "parallel.routing=false", "parallel.remap=false",
              f"train.out_dir={single_dir}"]  # fmt: skip
    run_ranks(train_rank, 1, single, REPO / "conf" / "demo.yaml")
    losses, reference = jsonl_losses(out), jsonl_losses(single_dir)
    assert sorted(losses) == list(range(1, ELASTIC_STEPS + 1))
    for step, loss in reference.items():
        assert losses[step] == pytest.approx(loss, rel=REL_TOL), f"loss of step {step}"
    ours = checkpoint_params(checkpoint_path(out, ELASTIC_STEPS), composition)
    theirs = checkpoint_params(checkpoint_path(single_dir, ELASTIC_STEPS), composition)
    err, name = max_relative_error(ours, theirs)
    assert err <= REL_TOL, f"parameter {name}: relative error {err:.2e}"
    assert tokens_per_step(read_ledger(out)) == tokens_per_step(read_ledger(single_dir))
    rows = steplog.step_rows(out / METRICS_FILE_NAME)
    assert {(r["nodes"], r["world_size"]) for r in rows} == {(3, 6), (2, 4)}
    # the torn checkpoint was passed over: two nodes trained again from step 2's on
    world_of_step = {row["step"]: row["world_size"] for row in rows}
    assert [world_of_step[s] for s in range(1, TORN_STEP + 1)] == [6, 6, 4, 4], world_of_step


def test_every_dashboard_panel_query_answers(elastic_run: ScrapedRun) -> None:
    prometheus_binary()  # skips (or fails, where CI requires it) without the package
    dashboard = json.loads((REPO / "dashboards" / "ray_zep.json").read_text())
    queries = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    assert len(queries) >= 20
    run, prometheus = elastic_run, elastic_run.prometheus
    assert prometheus is not None
    empty = [
        query
        for query in queries
        if not has_finite_sample(prometheus.query_range(query, run.started, run.ended + 1))
    ]
    assert not empty, f"panel queries with no answer: {empty}"
    for reason in ("node_lost", "nodes_returned"):
        query = f'ray_zep_resizes_total{{reason="{reason}"}}'
        series = prometheus.query_range(query, run.started, run.ended + 1)
        assert max(float(v) for s in series for _, v in s["values"]) == 1, reason


def _pipes_in_place_of_rank_files(checkpoint: Path, world: int) -> list[Path]:
    """Named pipes where each rank's distributed-checkpoint data file goes (DCP names the
    file of rank r `__r_0.distcp`: one file per rank): opening one to write blocks."""
    checkpoint.mkdir(parents=True)
    pipes = [checkpoint / f"__{rank}_0.distcp" for rank in range(world)]
    for pipe in pipes:
        os.mkfifo(pipe)
    return pipes


def _last_step(run_dir: Path) -> int:
    try:
        return max(jsonl_losses(run_dir), default=0)
    except json.JSONDecodeError:  # a row still being written
        return 0


def _checkpointed_on(run_dir: Path, world_size: int) -> bool:
    """Whether the newest complete checkpoint is of a step a group of `world_size` trained."""
    newest = latest_checkpoint(run_dir)
    try:
        rows = steplog.step_rows(run_dir / METRICS_FILE_NAME)
    except json.JSONDecodeError:  # a row still being written
        return False
    trained = {row["step"] for row in rows if row["world_size"] == world_size}
    return newest is not None and int(newest.name.rsplit("_", 1)[1]) in trained


def _grew_after(run_dir: Path, smaller: int, world: int) -> bool:
    """Whether a group of `world` ranks has trained a step after one of `smaller` ranks."""
    try:
        sizes = [row["world_size"] for row in steplog.step_rows(run_dir / METRICS_FILE_NAME)]
    except json.JSONDecodeError:  # a row still being written
        return False
    if smaller not in sizes:
        return False
    last = len(sizes) - 1 - sizes[::-1].index(smaller)
    return world in sizes[last + 1 :]


def _wait_for(done, fit: threading.Thread, outcome: dict, what: str, timeout_s: float = 180):
    deadline = time.monotonic() + timeout_s
    while not done():
        if "error" in outcome:
            raise outcome["error"]
        assert fit.is_alive() or done(), f"the run ended before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:.0f} s"
        time.sleep(0.2)


OVERLONG = [
    "train.steps=30",
    "data.source=synthetic:github",
    "data.length_scale=1.0",
    "data.overlong=error",
]


def test_a_data_error_during_training_stops_the_run_at_once_typed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Bad input met by the workers (here every rank's shard request fails with the data
    actor's typed error) ends the run with its one line: Ray Train does not restart the
    group to meet it again, though ray.max_failures would allow two restarts."""
    caplog.set_level(logging.WARNING, logger="ray_zep_workers")
    two_workers = ["topology.nodes=1", "topology.gpus_per_node=2", "ray.max_failures=2"]
    with pytest.raises(OverlongDocumentError) as raised:
        _train(tmp_path, *OVERLONG, *two_workers)
    assert str(raised.value).startswith("document "), "a remote traceback in the message"
    assert "\n" not in str(raised.value) and "data.overlong=error" in str(raised.value)
    noted = [r.getMessage() for r in caplog.records]
    assert not any("restarted" in line or "group failed" in line for line in noted), noted


def test_machines_too_small_for_a_topology_node_are_refused_before_any_worker_starts(
    tmp_path: Path,
) -> None:
    """One topology node of three workers on Ray nodes of two CPUs each: no machine holds
    the node whole (Ray Train would place its workers on two or three machines, where they
    would refuse to train, tests/test_placement.py), so the driver refuses the run in one
    line before it starts a worker."""
    three_on_one = ["topology.nodes=1", "topology.gpus_per_node=3"]
    short = (r"^config key topology\.gpus_per_node=3: the Ray nodes have room for 0 whole "
             r"topology node\(s\) of 3 workers .* and the topology has 1; give each Ray node "
             r"the CPUs of 3 workers, or lower topology\.gpus_per_node$")  # fmt: skip
    started = time.monotonic()
    with pytest.raises(ClusterError, match=short):
        _train(tmp_path, "train.steps=1", *three_on_one)
    assert time.monotonic() - started < 10, "a worker group started (10-20 s on two cores)"


def test_a_cluster_without_gpus_is_reported_without_a_probe_on_each_node() -> None:
    """No Ray node offers a GPU, so no worker can take one: every node is reported as
    such at once (a probe actor per node would only find the same)."""
    reports = probe_cluster(timeout_s=5)
    assert len(reports) == 3 and all(r.gpus == 0 and r.topology is None for r in reports)
    topology = build_topology(load_config(None, ["topology.nodes=3"]).topology)
    assert resolve_topology(reports, topology)[1].startswith("no GPU on the 3 Ray node(s)")


def test_a_data_error_fails_every_restart_at_once() -> None:
    """Restarts must not replay a data error step by step (nor skip past it)."""
    config = load_config(None, [*BASE, *OVERLONG])
    actor = DataActor(config_to_dict(config), build_topology(config.topology).to_dict())
    actor.start(0, None)
    with pytest.raises(OverlongDocumentError) as first:
        for step in range(config.train.steps):
            actor.get_shards(step, 0, timeout_s=60)
    actor.start(0, None)  # what rank 0 does after Ray Train restarts the workers
    started = time.perf_counter()
    with pytest.raises(OverlongDocumentError) as again:
        actor.get_shards(0, 0, timeout_s=60)
    assert str(again.value) == str(first.value)
    assert time.perf_counter() - started < 5


def test_a_data_actor_started_again_sends_the_workers_back_to_a_checkpoint(
    tmp_path: Path,
) -> None:
    """Ray starts the data actor again after its process died: until rank 0 starts a
    stream, shard requests fail at once (the workers then restart from a checkpoint);
    if its dataset became unreadable meanwhile, they fail with the typed error naming the
    file, before and after a start, which ends the run."""
    data = write_token_parquet([np.arange(50, dtype=np.int32)] * 40, tmp_path / "d.parquet")
    config = load_config(None, [*BASE, f"data.source={data.path}"])
    topology = build_topology(config.topology).to_dict()
    restarted = DataActor(config_to_dict(config), topology)
    with pytest.raises(CommError, match="data actor's process died and Ray started it again"):
        restarted.get_shards(3, 0, timeout_s=60)
    restarted.start(3, None)
    assert len(restarted.get_shards(3, 0, timeout_s=60)) == 1
    data.path.write_bytes(b"\0" * 64)
    broken = DataActor(config_to_dict(config), topology)
    for _ in range(2):
        with pytest.raises(CorruptDatasetError, match=r"d\.parquet' is not a readable Parquet"):
            broken.get_shards(3, 0, timeout_s=60)
        broken.start(3, None)


def test_an_elastic_run_without_room_for_its_minimum_stops_with_one_line(tmp_path: Path) -> None:
    """Three Ray nodes of two workers and ray.min_nodes=4: after comm.init_timeout_s the
    driver stops, naming the key, instead of waiting for Ray Train without end."""
    four = ["topology.nodes=5", "ray.min_nodes=4", "comm.init_timeout_s=2"]
    started = time.monotonic()
    short = r"^config key ray\.min_nodes=4: .*room for [0-3] node\(s\) .* training cannot start"
    with pytest.raises(TopologyError, match=short):
        _train(tmp_path, "train.steps=1", *four)
    assert time.monotonic() - started < 30
