"""Which Ray a run joins or starts, and the one-line refusals, without starting Ray
(`tests/test_ray_job.py` does the same against a real `ray start --head`)."""

from __future__ import annotations

import socket

import pytest

from ray_zep.config import load_config
from ray_zep.errors import ClusterError, ConfigError
from ray_zep_workers import cluster

pytestmark = pytest.mark.unit


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch):
    """A cluster `ray start` runs on this machine, as Ray's record names it."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(cluster, "recorded_cluster", lambda: "10.0.0.5:6379")


@pytest.mark.parametrize(
    "overrides, env, chosen",
    [
        ([], None, ("10.0.0.5:6379", cluster.RECORDED)),
        (["ray.address=local"], None, (None, "started")),
        ([], "10.0.0.7:6379", ("10.0.0.7:6379", "RAY_ADDRESS")),
        (["ray.address=ray://head:10001"], "10.0.0.7:6379", ("ray://head:10001", "ray.address")),
        ([], "local", (None, "started")),
    ],
    ids=["ray start record", "ray.address=local", "RAY_ADDRESS", "ray.address first", "local"],
)
def test_the_driver_joins_the_named_or_recorded_cluster_or_starts_its_own(
    recorded, monkeypatch: pytest.MonkeyPatch, overrides, env, chosen
) -> None:
    if env:
        monkeypatch.setenv("RAY_ADDRESS", env)
    assert cluster._chosen_address(load_config(None, overrides)) == chosen


def test_no_record_and_no_address_starts_a_local_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(cluster, "recorded_cluster", lambda: None)
    assert cluster._chosen_address(load_config(None, [])) == (None, "started")


def test_a_job_api_address_is_refused_naming_the_key(recorded) -> None:
    with pytest.raises(ConfigError, match=r"^config key ray\.address: .*http://head:8265.*GCS"):
        cluster._chosen_address(load_config(None, ["ray.address=http://head:8265"]))


def test_an_address_where_nothing_listens_is_refused_at_once() -> None:
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        assert cluster._answers(f"127.0.0.1:{port}")
        assert cluster._answers(f"ray://127.0.0.1:{port}")
    with pytest.raises(ClusterError, match=rf"127\.0\.0\.1:{port} \(RAY_ADDRESS\): nothing"):
        cluster._check_reachable(f"127.0.0.1:{port}", "RAY_ADDRESS")


@pytest.mark.parametrize(
    "resources, joined, device, message",
    [
        ({"CPU": 3}, True, "cpu", "4 worker(s) need one CPU each but the Ray cluster at "
         "10.0.0.5:6379 (ray start on this machine) has 3; add CPUs to that cluster"),
        ({"CPU": 3}, False, "cpu", "4 worker(s) need one CPU each but the local Ray this run "
         "started has 3; shrink topology.nodes / topology.gpus_per_node or raise ray.num_cpus"),
        ({"CPU": 64, "GPU": 2}, True, "auto", "4 worker(s) need one GPU each but the Ray "
         "cluster at 10.0.0.5:6379 (ray start on this machine) has 2; add GPUs"),
    ],
)  # fmt: skip
def test_a_cluster_without_room_is_refused_in_one_line(
    monkeypatch: pytest.MonkeyPatch, resources, joined, device, message
) -> None:
    monkeypatch.setattr(cluster.ray, "cluster_resources", lambda: resources)
    connection = cluster.Connection(
        "10.0.0.5:6379" if joined else None,
        cluster.RECORDED if joined else "started",
        started=True,
    )
    config = load_config(None, [f"train.device={device}"])
    with pytest.raises(ClusterError) as refused:
        cluster.check_room(config, 4, connection)
    assert str(refused.value).startswith(message), refused.value
    assert ("ray.address=local" in str(refused.value)) == joined
    assert cluster.check_room(config, 2, connection) == (resources.get("GPU", 0) > 0)


def test_a_worker_failure_is_told_in_one_line() -> None:
    """What the driver logs for each failed rank: the root error's type and first line,
    whether Ray Train hands it over wrapped with its traceback or Ray wraps it in a task
    error."""
    from ray.exceptions import RayTaskError
    from ray.train.v2._internal.exceptions import UserExceptionWithTraceback

    from ray_zep.errors import CommError
    from ray_zep_workers.failure_notes import describe

    traceback = "Traceback (most recent call last):\n  File ..."
    gloo = RuntimeError("Connection closed by peer [127.0.0.1]:4242\nsecond line")
    assert describe(UserExceptionWithTraceback(gloo, traceback)) == (
        "RuntimeError: Connection closed by peer [127.0.0.1]:4242"
    )
    lost = CommError("rank 1 lost the data actor while starting the data")
    remote = RayTaskError("fetch", traceback, lost).as_instanceof_cause()
    assert describe(UserExceptionWithTraceback(remote, traceback)) == f"CommError: {lost}"
