"""`ray job submit` against a real Ray head with token authentication, and failures.

One head (`ray start --head`, job API on 127.0.0.1, `RAY_AUTH_MODE=token`) serves
the module (`tests/conftest.py`). A job meets four failures at random steps: a worker
that stops answering (SIGSTOP), a worker killed outright (SIGKILL) with the data actor,
one of its dataset's Parquet files turned to garbage, and then its driver killed.
Submitted again, it stops in one line naming the file and keeps every checkpoint; with
the file mended and submitted once more, it finishes. It must end in the state of an
uninterrupted reference run, bit for bit, with every sample trained exactly once (the
sample ledger). The reference trains the same config through the library's rank loop
on gloo processes, the code every Ray worker runs.

The same head is the cluster a driver that names none joins, here one without room for
the run's workers.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ray_zep.config import load_config
from ray_zep.data.builder import write_token_parquet
from ray_zep.data.catalog import open_configured_source
from ray_zep.train.checkpoint_dirs import checkpoint_path, checkpoint_root
from ray_zep.train.ledger import read_ledger
from tests.helpers.procs import run_ranks
from tests.helpers.ray_head import RayHead, pids_matching, process_table
from tests.helpers.training import SMALL_RUN, checkpoint_params, jsonl_losses, train_rank

pytestmark = pytest.mark.ray

REPO = Path(__file__).resolve().parents[1]
STEPS = 12
TIMEOUT_S = 5
RUN = [
    *SMALL_RUN,
    # two workers meet every failure four would, and start in half the time on two cores
    "topology.nodes=1",
    "topology.gpus_per_node=2",
    f"train.steps={STEPS}",
    "train.checkpoint_every=2",
    "train.warmup_steps=2",
    "metrics.port=-1",
    f"comm.timeout_s={TIMEOUT_S}",
    "ray.max_failures=2",
    # data parallel: whole sequences packed per rank, replicated weights
    "parallel.sequence=whole",
    "parallel.weights=replicated",
    "parallel.routing=false",
    "parallel.remap=false",
    "data.packing=rank",
]
# Before a restart, Ray Train's controller waits for every worker to destroy its process
# group, 30 s by default; the stopped worker never answers, so the wait is cut as for the
# suite's own clusters (tests/conftest.py; the variable reaches the controller through the
# job's runtime_env).
RUNTIME_ENV = json.dumps(
    {
        "env_vars": {
            "GLOO_SOCKET_IFNAME": "lo",
            "TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S": os.environ[
                "TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S"
            ],
            # the controller notices failures and restarts sooner (tests/conftest.py)
            "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"],
        }
    }
)
JOB_TIMEOUT_S = 300.0
WORKER_TITLE = "ray::RayTrainWorker"
DATA_ACTOR_TITLE = "ray::DataActor"
RESTARTED = "workers restarted from the checkpoint of step"


@pytest.fixture
def head(ray_head: RayHead) -> RayHead:
    return ray_head


def test_job_api_refuses_a_client_without_the_token(head: RayHead) -> None:
    refused = head.ray("job", "list", with_token=False)
    assert refused.returncode != 0, refused.stdout
    allowed = head.ray("job", "list")
    assert allowed.returncode == 0, allowed.stdout + allowed.stderr


@pytest.mark.slow
def test_job_survives_failed_peers_a_lost_data_actor_a_broken_file_and_a_killed_driver(
    head: RayHead, tmp_path: Path
) -> None:
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    where = f"(failure steps drawn with seed {seed})"
    dataset, files = _sharded_dataset(tmp_path / "data")
    run = [*RUN, f"data.source={dataset}"]

    reference = tmp_path / "reference"
    demo = REPO / "conf" / "demo.yaml"
    expected = run_ranks(train_rank, 2, [*run, f"train.out_dir={reference}"], demo)[0]

    def log() -> str:
        return head.driver_log("failing")

    def tail() -> str:
        return log()[-4000:]

    out = tmp_path / "failing"
    job = head.submit("failing", REPO, RUNTIME_ENV, _entrypoint(out, run))
    broken = rng.choice(files)
    intact = broken.read_bytes()
    try:
        # 1. a peer stops answering: the others fail within comm.timeout_s, Ray restarts all
        _wait_for_step(out, first := rng.randint(1, 3), head, "failing", job)
        assert "communication environment: GLOO_SOCKET_IFNAME=lo" in log(), "runtime_env lost"
        os.kill(rng.choice(_workers()), signal.SIGSTOP)
        stopped = time.monotonic()

        _wait_until(lambda: f"exceeded comm.timeout_s={TIMEOUT_S}" in log(), "the error", tail)
        noticed = time.monotonic() - stopped
        assert noticed < TIMEOUT_S + 20, f"a silent peer noticed after {noticed:.0f} s {where}"
        _wait_until(lambda: log().count(RESTARTED) == 1, "the first restart", tail)

        # 2. a worker dies (a step beyond any the stopped run could have reached), and the
        # data actor with it: Ray starts the actor again, the new group's data comes from it
        _wait_for_step(out, second := rng.randint(first + 2, first + 4), head, "failing", job)
        data_actor = _single(pids_matching(DATA_ACTOR_TITLE))
        os.kill(rng.choice(_workers()), signal.SIGKILL)
        os.kill(data_actor, signal.SIGKILL)
        _wait_until(lambda: log().count(RESTARTED) == 2, "the second restart", tail)
        assert _single(pids_matching(DATA_ACTOR_TITLE)) != data_actor

        # 3. a dataset file turns to garbage: the running data actor read it at its start
        _wait_for_step(out, third := rng.randint(second + 1, second + 2), head, "failing", job)
        broken.write_bytes(b"\0" * 64)

        # 4. the driver dies; freeze the workers first so that no step runs past this point
        # (at most step 10 of 12: the workers may finish a step while the test looks)
        _wait_for_step(out, third + 1, head, "failing", job)
        workers = _workers()
        for pid in workers:
            os.kill(pid, signal.SIGSTOP)
        for pid in _driver_pids(out):
            os.kill(pid, signal.SIGKILL)
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
        status = head.wait_for_end("failing", JOB_TIMEOUT_S)
    finally:
        job.kill()
    assert status == "FAILED"
    killed_at = max(jsonl_losses(out))
    assert killed_at < STEPS, f"the first driver finished before it was killed {where}"
    assert "Traceback" not in log(), tail()

    # 5. submitted again with the file still broken: one line names it, nothing is lost
    saved = sorted(p.name for p in checkpoint_root(out).iterdir())
    refused = _run_to_end(head, "failing-refused", out, run, "FAILED")
    assert (
        refused.strip()
        .splitlines()[-1]
        .startswith(f"ray-zep: error: {str(broken)!r} is not a readable Parquet file")
    ), refused[-3000:]
    assert "Traceback" not in refused, refused[-3000:]
    assert sorted(p.name for p in checkpoint_root(out).iterdir()) == saved

    # 6. with the file mended, the same run resumes from its newest checkpoint and finishes
    broken.write_bytes(intact)
    logs = _run_to_end(head, "failing-again", out, run)
    assert "resuming from" in logs and f"..{STEPS}:" in logs

    assert jsonl_losses(out) == expected["losses"], f"losses differ {where}"
    ours = checkpoint_params(checkpoint_path(out, STEPS), run)
    for name, value in checkpoint_params(checkpoint_path(reference, STEPS), run).items():
        assert torch.equal(ours[name], value), f"parameter {name} differs {where}"
    samples = read_ledger(out)
    assert samples == read_ledger(reference), f"the trained samples differ {where}"
    assert sorted(samples) == list(range(1, STEPS + 1))
    pieces = [piece for step in samples.values() for piece in step]
    assert len(set(pieces)) == len(pieces), f"a sample was trained twice {where}"


def _sharded_dataset(folder: Path) -> tuple[Path, list[Path]]:
    """The run's synthetic documents as a folder of four Parquet files (enough for every
    step: the run reads a few dozen)."""
    config = load_config(None, RUN)
    source = open_configured_source(config)
    docs = [source.tokens(i) for i in range(400)]
    files = [write_token_parquet(docs[i::4], folder / f"part_{i}.parquet").path for i in range(4)]
    return folder, files


ROOMLESS = [*RUN, "topology.nodes=2", "topology.gpus_per_node=4"]
"""Eight workers, and the head has six CPUs."""


@pytest.mark.parametrize("found_by", ["ray start", "RAY_ADDRESS"])
def test_a_cluster_without_room_for_the_workers_is_refused_in_one_line(
    head: RayHead, tmp_path: Path, found_by: str
) -> None:
    """The running cluster, found through Ray's record of `ray start` (a driver that
    names no cluster joins it, as `ray.init()` would) or through RAY_ADDRESS, lacks CPUs
    for the run: one line says so and how to go on. (A joined cluster trains as any
    other: the jobs above train on this head.)"""
    env = head.local_env()
    port = head.gcs_address.rsplit(":", 1)[1]  # Ray records the head by the machine's IP
    where = rf"the Ray cluster at [\d.]+:{port} \(ray start on this machine\) has 6"
    if found_by == "RAY_ADDRESS":
        env = {**head.client_env(), "RAY_ADDRESS": head.gcs_address}
        where = rf"the Ray cluster at {re.escape(head.gcs_address)} \(RAY_ADDRESS\) has 6"
    done = _ray_zep(env, "train", "conf/demo.yaml", *ROOMLESS, f"train.out_dir={tmp_path}")
    assert done.returncode == 2, done.stderr[-3000:]
    if found_by == "ray start":
        joined = r"joined the Ray cluster that `ray start` runs on this machine \([\d.]+:(\d+)\)"
        found = re.search(joined, done.stderr)
        assert found and found.group(1) == port, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert re.match(rf"ray-zep: error: 8 worker\(s\) need one CPU each but {where}; ", last), last
    assert "add CPUs to that cluster (`ray start --num-cpus=...`)" in last, last
    assert "or set ray.address=local" in last, last


def _ray_zep(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["ray-zep", *args], env=env, cwd=REPO, capture_output=True, text=True,
        timeout=JOB_TIMEOUT_S,
    )  # fmt: skip


def _entrypoint(out: Path, run: list[str]) -> list[str]:
    return ["ray-zep", "train", "conf/demo.yaml", *run, f"train.out_dir={out}"]


def _run_to_end(
    head: RayHead, job_id: str, out: Path, run: list[str], expect: str = "SUCCEEDED"
) -> str:
    job = head.submit(job_id, REPO, RUNTIME_ENV, _entrypoint(out, run))
    try:
        status = head.wait_for_end(job_id, JOB_TIMEOUT_S)
    finally:
        job.kill()
    logs = head.logs(job_id)
    assert status == expect, f"job {job_id}: {status}\n{logs[-3000:]}"
    return logs


def _single(found: list[int]) -> int:
    assert len(found) == 1, f"expected one process, found {found}"
    return found[0]


def _workers() -> list[int]:
    found = pids_matching(WORKER_TITLE)
    assert found, "no Ray Train worker is running"
    return found


def _driver_pids(out: Path) -> list[int]:
    """The job's driver (and its shell), not the `ray job submit` client."""
    table = process_table()
    return [
        pid
        for pid in pids_matching("ray-zep train", f"train.out_dir={out}")
        if "job submit" not in table.get(pid, "job submit")
    ]


def _wait_for_step(out: Path, step: int, head: RayHead, job_id: str, job: subprocess.Popen) -> None:
    """Wait until the run in `out` has trained `step`; fail at once, with its output, if
    the `ray job submit` client `job` has ended first (a job that never started)."""

    def reached() -> bool:
        if job.poll() is not None:
            output = job.stdout.read()
            raise AssertionError(f"`ray job submit` ended before step {step}:\n{output[-3000:]}")
        try:
            return max(jsonl_losses(out), default=0) >= step
        except json.JSONDecodeError:  # a line still being written
            return False

    _wait_until(reached, f"step {step}", lambda: head.driver_log(job_id)[-3000:])


def _wait_until(
    done: Callable[[], bool], what: str, context: Callable[[], str] = lambda: ""
) -> None:
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not done():
        assert time.monotonic() < deadline, f"waited in vain for {what}\n{context()}"
        time.sleep(0.05)
