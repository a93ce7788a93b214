"""Session-wide test plumbing."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import pytest

from ray_zep.logs import LOGGERS
from tests.helpers.procs import close_pools
from tests.helpers.ray_head import RayHead, shared_head, stop_shared_head
from tests.helpers.ray_last import RayTestsLast, is_ray_test

# Ray Train's controller polls its workers every 2 s: a run's end, a failure and a
# restart are each noticed up to 2 s late. The Ray tests start many short runs; polling
# every 0.5 s saves the suite a few seconds a run and changes nothing they check. Set
# here, before any Ray process starts, so every cluster the tests start inherits it.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
# No node of the tests' Ray clusters is preemptible: Ray Train's preemption watcher would be
# one more process to start with every worker group, and watch nothing.
os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
# Before it restarts a worker group, Ray Train's controller waits for every worker to
# destroy its process group, 30 s by default. A test that loses a node holds the survivors
# where no step can end (a checkpoint file they cannot open, a stopped process), so they
# never answer and the wait runs out each time: 1 s (tests/test_ray_job.py gives its jobs
# the same). A group that does answer leaves its process group in well under that; one cut
# short is killed with its actor, as Ray Train kills every worker of a group it ends.
os.environ.setdefault("TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S", "1")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The Ray tests run last, in their files' order: the gloo pools then start once and
    serve every multi-process test before them, instead of being ended before each Ray
    file and started again after it. Under pytest-xdist `RayTestsLast` knows them by their
    files' names, so a Ray test lives in a `test_ray_*.py` file, and only Ray tests do."""
    items.sort(key=lambda item: item.get_closest_marker("ray") is not None)
    for item in items:
        if (item.get_closest_marker("ray") is not None) != is_ray_test(item.nodeid):
            raise pytest.UsageError(
                f"{item.nodeid}: a test marked `ray` goes in a tests/test_ray_*.py file, "
                "and every test there is marked `ray` (tests/helpers/ray_last.py)"
            )


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """`-n 2` (pyproject.toml's default): xdist's load balancing, the Ray tests last and
    on one worker."""
    if config.getvalue("dist") == "load":
        return RayTestsLast(config, log)
    return None


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Ray tests start clusters of their own: end the idle gloo pools first (kept, their
    memory slows every Ray worker start by a third on two cores), and the shared
    `ray start` head once the tests that use it are done."""
    if item.get_closest_marker("ray") is not None:
        close_pools(kill=True)
        if "ray_head" not in getattr(item, "fixturenames", ()):
            stop_shared_head()


@pytest.fixture
def ray_head() -> RayHead:
    """One `ray start --head` (token authentication, job API on loopback, six CPUs) for
    the tests that meet a cluster already running on the machine: the demo runs beside
    it, `ray job submit` and a driver that names no cluster use it. Started by the first
    test that asks, kept for the next."""
    return shared_head(num_cpus=6, object_store_mb=300)


def pytest_sessionfinish() -> None:
    stop_shared_head()


_PROJECT_LOGGERS = [logging.getLogger(name) for name in LOGGERS]
_LOGGERS_AT_START = [(lg.handlers[:], lg.level, lg.propagate) for lg in _PROJECT_LOGGERS]


@pytest.fixture(autouse=True)
def _restore_project_loggers() -> Iterator[None]:
    """A command run in-process configures the project's loggers (`setup_logging`); every test
    ends with them as the session began, so no test sees another's handlers, levels or
    propagation (pytest attaches its capture to loggers that do not propagate)."""
    yield
    for logger, (handlers, level, propagate) in zip(
        _PROJECT_LOGGERS, _LOGGERS_AT_START, strict=True
    ):
        logger.handlers[:] = handlers
        logger.setLevel(level)
        logger.propagate = propagate
