"""Metric names, the Prometheus endpoint and metrics.jsonl."""

from __future__ import annotations

import json
import re
import socket
import urllib.request
from pathlib import Path

import pytest

from ray_zep import metrics, steplog
from ray_zep.config import TopologyConfig, load_config
from ray_zep.errors import ConfigError
from ray_zep.host_usage import HostUsage
from ray_zep.model_shapes import build_shape
from ray_zep.topology import build_topology
from ray_zep.tracking import open_trackers, row_scalars
from ray_zep.traffic import gradient_traffic
from ray_zep_workers.metrics_export import MetricsExporter
from tests.helpers.procs import run_ranks
from tests.helpers.trackers import tensorboard_scalars, wandb_history
from tests.helpers.training import SMALL_RUN, train_rank

pytestmark = pytest.mark.unit

UNITS = (
    "_total",
    "_seconds",
    "_bytes_total",
    "_bytes",
    "_per_second",
    "_step",
    "_loss",
    "_rate",
    "_norm",
    "_imbalance",
    "_ranks",
    "_ratio",
    "_size",
    "_nodes",
    "_fds",  # as the standard process collector's process_open_fds
)


def _event(step: int, loss: float = 2.0) -> dict:
    return {
        "event": "step",
        "step": step,
        "loss": loss,
        "tokens": 4000,
        "label_tokens": 3990,
        "step_seconds": 0.5,
        "data_seconds": 0.01,
        "lr": 1e-3,
        "grad_norm": 0.7,
        "rank_tokens": [1000, 900, 1100, 1000],
        "comm_bytes": {"intra_node": 300, "inter_node": 100},
        "nic_bytes": [[60, 40]],
        "compression": {
            "fsdp_all_gather": {"raw_bytes": 1400, "wire_bytes": 1000},
            "kv": {"raw_bytes": 500, "wire_bytes": 500},
        },
        "zone_tokens": {"local": 3000, "intra_node": 600, "inter_node": 400},
        "model_flops": 2e12,
        "host": {"rss_bytes": [5_000_000, 6_000_000, 5_500_000, 7_000_000], "open_fds": [9] * 4},
    }


def _scrape(port: int) -> str:
    url = f"http://127.0.0.1:{port}/metrics"
    return urllib.request.urlopen(url, timeout=10).read().decode()


@pytest.mark.parametrize("spec", metrics.ALL_METRICS, ids=lambda s: s.name)
def test_metric_names_follow_prometheus_conventions(spec: metrics.MetricSpec) -> None:
    assert re.fullmatch(r"ray_zep_[a-z_]+", spec.name)
    assert spec.name.endswith(UNITS)
    assert (spec.kind is metrics.Kind.COUNTER) == spec.name.endswith("_total")
    assert spec.help.endswith(".")


def test_exporter_serves_metrics_and_writes_jsonl(tmp_path: Path) -> None:
    exporter = MetricsExporter(tmp_path, port=0)
    try:
        exporter.on_start(0)
        row = exporter.on_step(_event(1))
        exporter.on_step(_event(2, loss=1.5))
        exporter.on_checkpoint(2)
        body = _scrape(exporter.port)
    finally:
        exporter.close()
    assert exporter.address == ("127.0.0.1", exporter.port), "loopback unless metrics.host"
    assert row["tokens_per_second"] == pytest.approx(8000)
    assert row["rank_token_imbalance"] == pytest.approx(1.1)
    for spec in metrics.ALL_METRICS:
        assert spec.name in body, f"{spec.name} is not exported"
    assert "ray_zep_tokens_total 8000.0" in body
    assert 'ray_zep_communication_bytes_total{link="inter_node"} 200.0' in body
    assert 'ray_zep_nic_bytes_total{nic="1",node="0"} 80.0' in body
    assert row["nic_bytes"] == [[60, 40]]
    assert "ray_zep_loss 1.5" in body
    assert 'ray_zep_compression_ratio{stream="fsdp_all_gather"} 1.4' in body
    assert 'ray_zep_compression_raw_bytes_total{stream="fsdp_all_gather"} 2800.0' in body
    assert 'ray_zep_compression_wire_bytes_total{stream="kv"} 1000.0' in body
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    assert {"step", "loss", "tokens", "step_seconds"} <= set(lines[0])


def test_resume_drops_jsonl_lines_after_the_checkpoint(tmp_path: Path) -> None:
    exporter = MetricsExporter(tmp_path, port=-1)
    for step in range(1, 6):
        exporter.on_step(_event(step))
    exporter.on_start(3)
    exporter.on_step(_event(4, loss=9.0))
    steps = [
        json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps == [1, 2, 3, 4]
    assert exporter.port is None


def test_busy_port_is_a_config_error(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        with pytest.raises(ConfigError, match=r"metrics\.port=\d+: cannot serve metrics"):
            MetricsExporter(tmp_path, port=busy.getsockname()[1])


def test_ring_all_reduce_volume_by_link_kind() -> None:
    two_by_two = build_topology(TopologyConfig(nodes=2, gpus_per_node=2))
    links = gradient_traffic(1000, two_by_two, world=4)
    # every rank sends 2 (N-1)/N x 1000 = 1500 bytes; 2 of the 4 ring links cross
    # nodes, from each node's last GPU (rank 1 and rank 3, each on its node's NIC 1)
    assert links.intra_node == 3000 and links.inter_node == 3000
    assert links.nic.tolist() == [[0, 1500], [0, 1500]]
    one_node = build_topology(TopologyConfig(nodes=1, gpus_per_node=4))
    assert gradient_traffic(1000, one_node, 4).inter_node == 0
    single = gradient_traffic(1000, one_node, 1)
    assert single.intra_node == 0 and single.inter_node == 0


def test_exporter_derives_model_flops_mfu_zone_shares_and_restarts(tmp_path: Path) -> None:
    exporter = MetricsExporter(tmp_path, port=0, peak_flops=1e12)
    try:
        exporter.set_ranks(4)
        exporter.on_start(0)
        row = exporter.on_step(_event(1))
        exporter.on_restart()
        body = _scrape(exporter.port)
    finally:
        exporter.close()
    assert row["model_flops_per_second"] == pytest.approx(4e12)  # 2e12 FLOPs in 0.5 s
    assert row["mfu"] == pytest.approx(4e12 / (4 * 1e12))
    assert 'ray_zep_zone_tokens_total{zone="inter_node"} 400.0' in body
    assert "ray_zep_mfu_ratio 1.0" in body
    assert "ray_zep_restarts_total 1.0" in body
    without_peak = MetricsExporter(tmp_path / "b", port=-1)
    (tmp_path / "b").mkdir()
    assert "mfu" not in without_peak.on_step(_event(1))


def test_an_evaluation_is_a_metrics_row_and_a_gauge(tmp_path: Path) -> None:
    exporter = MetricsExporter(tmp_path, port=0)
    try:
        exporter.on_start(0)
        exporter.on_step(_event(1))
        eval_event = {"step": 1, "loss": 2.5, "label_tokens": 900, "documents": 12, "seconds": 0.4}
        exporter.on_eval(eval_event)
        body = _scrape(exporter.port)
    finally:
        exporter.close()
    assert "ray_zep_eval_loss 2.5" in body
    rows = steplog.read_rows(tmp_path / "metrics.jsonl")
    assert [r.get("eval_loss") for r in rows] == [None, 2.5]
    assert "step_seconds" not in rows[1], "readers of step rows must skip it"


@pytest.mark.dist
def test_step_events_carry_zone_tokens_and_model_flops_per_rank(tmp_path: Path) -> None:
    overrides = [*SMALL_RUN, "train.steps=2", "topology.nodes=2", "topology.gpus_per_node=2"]
    overrides += ["parallel.sequence=zeppelin", f"train.out_dir={tmp_path}"]
    rank0 = run_ranks(train_rank, 4, overrides)[0]
    shape = build_shape(load_config(None, overrides).model)
    steps = [e for e in rank0["events"] if e["event"] == "step"]
    assert len(steps) == 2
    for event in steps:
        lengths = [length for _, _, length in rank0["samples"][event["step"] - 1]]
        assert sum(event["zone_tokens"].values()) == event["tokens"] == sum(lengths)
        attention = sum(shape.attention_flops(n) for n in lengths)
        expected = 3 * (shape.linear_flops_per_token() * event["tokens"] + attention)
        assert event["model_flops"] == pytest.approx(expected, rel=1e-9)
        # each rank's share: its tokens' layers and its part of each sequence's attention
        assert len(event["rank_flops"]) == 4 and min(event["rank_flops"]) > 0
        assert sum(event["rank_flops"]) == pytest.approx(expected, rel=1e-9)


def test_row_scalars_keep_every_number_of_a_row_under_its_key() -> None:
    row = {
        "step": 7,
        "time": 1.0e9,
        "loss": 2.5,
        "tokens": 4000,
        "comm_bytes": {"intra_node": 300, "inter_node": 100},
        "compression": {"kv": {"raw_bytes": 500, "wire_bytes": 400}},
        "rank_tokens": [1000, 900, 1100, 1000],
        "nic_bytes": [[60, 40], [0, 20]],
        "memory": {"modelled": [4.0, 6.0], "measured_by": "tracker"},
        "rss_bytes": {"driver": 10, "ranks": [30, 50]},
    }
    assert row_scalars(row) == {
        "loss": 2.5,
        "tokens": 4000.0,
        "comm_bytes/intra_node": 300.0,
        "comm_bytes/inter_node": 100.0,
        "compression/kv/raw_bytes": 500.0,
        "compression/kv/wire_bytes": 400.0,
        "rank_tokens/max": 1100.0,
        "rank_tokens/mean": 1000.0,
        "nic_bytes/max": 60.0,
        "nic_bytes/mean": 30.0,
        "memory/modelled/max": 6.0,
        "memory/modelled/mean": 5.0,
        "rss_bytes/driver": 10.0,
        "rss_bytes/ranks/max": 50.0,
        "rss_bytes/ranks/mean": 40.0,
    }


def test_tensorboard_and_offline_wandb_hold_every_row_as_metrics_jsonl_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One record, three sinks, across a restart from step 2: TensorBoard ends with one
    history (the steps after 2 trained again replace the first try's), W&B keeps every
    point it was sent, metrics.jsonl the newest history."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    metrics_config = load_config(
        None, ["metrics.tensorboard=tb", "metrics.wandb=ray-zep-tests", "metrics.wandb_run=t"]
    ).metrics
    trackers = open_trackers(metrics_config, tmp_path, {"train": {"steps": 4}})
    exporter = MetricsExporter(tmp_path, port=-1, trackers=trackers)
    beside = {"driver": HostUsage(3_000_000, 20), "data": HostUsage(2_000_000, 12)}
    exporter.on_start(0)
    for step in (1, 2, 3):
        exporter.on_step(_event(step, loss=9.0), beside)
    exporter.on_start(2)  # a restart from step 2's checkpoint
    for step in (3, 4):
        exporter.on_step(_event(step, loss=float(step)), beside)
    exporter.on_eval({"step": 4, "loss": 2.5, "label_tokens": 9, "documents": 1, "seconds": 0.1})
    exporter.close()

    rows = steplog.read_rows(tmp_path / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 4]
    board = tensorboard_scalars(tmp_path / "tb")
    wandb_rows = wandb_history(tmp_path)
    assert [r["step"] for r in wandb_rows] == [1, 2, 3, 3, 4, 4]
    for row in rows:
        for name, value in row_scalars(row).items():
            assert board[name][row["step"]] == pytest.approx(value), (name, row["step"])
            logged = [r for r in wandb_rows if r["step"] == row["step"] and name in r]
            assert logged and logged[-1][name] == pytest.approx(value), (name, row["step"])
    assert board["loss"] == {1: 9.0, 2: 9.0, 3: 3.0, 4: 4.0}, "step 3's first try was purged"
    assert {"rss_bytes/driver", "rss_bytes/ranks/max", "lr", "grad_norm"} <= set(board)
    assert "tokens_per_second" in board and "rank_token_imbalance" in board
