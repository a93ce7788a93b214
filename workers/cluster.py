"""Which Ray cluster a run trains on, and whether it has room for the run's workers.

The driver decides in this order:

1. `ray.address` (or `RAY_ADDRESS`, which `ray job submit` sets for its drivers): join
   that cluster. `ray.address=local` instead always starts a Ray of the run's own.
2. Neither set, and a cluster that `ray start --head` runs on this machine: join it, as
   `ray.init()` does (Ray's own record of the last `ray start`, under `RAY_TMPDIR` or
   /tmp). The run then shows in that cluster's dashboard and uses its resources.
3. Otherwise start a local Ray sized for the run (`ray.num_cpus`, `ray.object_store_mb`).

A joined cluster is checked before anything is placed on it: an address nothing listens
at, or a cluster with fewer CPUs (GPUs) than the run has workers, ends in one line that
names the address, how it was found and what to change. So does one whose machines are too
small for a topology node's workers (`check_node_room`), before any worker starts.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass

import ray

from ray_zep.config import Config, Device
from ray_zep.errors import ClusterError, ConfigError, first_line
from ray_zep.topology import Topology
from ray_zep_workers.elastic import node_room

log = logging.getLogger(__name__)

LOCAL = "local"
"""`ray.address=local`: start a Ray of the run's own, even beside a running one."""
AUTO = "auto"
"""Ray's own `auto`: any cluster found on this machine."""
STARTED = "started"
"""The origin of a local Ray the driver starts for the run."""
RECORDED = "ray start on this machine"
"""How a cluster found through Ray's record of `ray start` is named in messages."""
CLIENT_SCHEME = "ray://"
REACH_TIMEOUT_S = 10.0
"""How long the driver waits for a joined cluster's address to accept a connection
(Ray's own connect retries for minutes on an address nothing listens at)."""
API_SERVER_ENV_VAR = "RAY_API_SERVER_ADDRESS"
PREEMPTION_WATCHER_ENV_VAR = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"
"""Ray Train's watcher of preemptible nodes; off on a Ray whose nodes all run on this
machine, where no node is preemptible apart from the driver's and starting it prints a
Ray-internal error line that is not a failure."""


@dataclass(frozen=True)
class Connection:
    """The cluster the driver is connected to."""

    address: str | None
    """The joined cluster's address; None for a Ray the driver started."""
    origin: str
    """How it was chosen: `ray.address`, `RAY_ADDRESS`, `ray start on this machine`, or
    `started` (a local Ray of the run's own)."""
    started: bool
    """Whether the driver started (and must shut down) this Ray connection."""
    env: tuple[str, ...] = ()
    """Environment variables set for this connection (removed again by `disconnect`)."""

    def describe(self) -> str:
        if self.origin == STARTED:
            return "the local Ray this run started"
        if self.address is None:
            return "the Ray cluster this process is connected to"
        return f"the Ray cluster at {self.address} ({self.origin})"


def connect(config: Config, num_workers: int) -> Connection:
    """Join or start Ray as the module docstring says.

    Raises:
        ConfigError: `ray.address` is not an address Ray can join.
        ClusterError: nothing answers at the address, or Ray refuses to connect.
    """
    if ray.is_initialized():  # the caller's own connection (tests, notebooks)
        return Connection(None, "the caller's", started=False)
    address, origin = _chosen_address(config)
    if address is None:
        return Connection(None, STARTED, started=True, env=_start_local(config, num_workers))
    if config.ray.num_cpus is not None:
        log.warning(
            "ray.num_cpus=%d is not used: it sizes a Ray the run starts, and the run joins "
            "the Ray cluster at %s (%s)", config.ray.num_cpus, address, origin,
        )  # fmt: skip
    if origin != RECORDED:  # recorded_cluster found the recorded one answering
        _check_reachable(address, origin)
    try:
        # Ray finds the recorded cluster itself, and only then takes up the token its
        # head made (a head started with `ray start` enables token authentication)
        ray.init(address=None if origin == RECORDED else address, log_to_driver=True)
    except Exception as exc:  # Ray's own errors vary by cause and version
        reason = first_line(exc)
        raise ClusterError(
            f"cannot join the Ray cluster at {address} ({origin}): {reason}"
        ) from None
    # Ray Train passes the variable on to its controller
    env = _set_unset({PREEMPTION_WATCHER_ENV_VAR: "0"}) if _all_on_this_machine() else ()
    if origin == RECORDED:
        log.info(
            "joined the Ray cluster that `ray start` runs on this machine (%s); "
            "ray.address=local starts a Ray of this run's own instead", address,
        )  # fmt: skip
    return Connection(address, origin, started=True, env=env)


def disconnect(connection: Connection) -> None:
    """End the driver's Ray connection if `connect` made it (a Ray it started stops), and
    remove the environment variables set for it."""
    if connection.started:
        ray.shutdown()
    for name in connection.env:
        os.environ.pop(name, None)


def _start_local(config: Config, num_workers: int) -> tuple[str, ...]:
    """Start a local Ray for this run; returns the environment variables set for it.

    Its processes inherit this process's environment: no preemption watcher, and the
    address of its own dashboard, which Ray Train's helpers would otherwise look for
    among every Ray on the machine (and fail to choose when another one runs beside it).
    A variable the user set is left as it is.
    """
    cpus = config.ray.num_cpus or max(num_workers + 2, os.cpu_count() or 1)
    port = _free_port()
    env = _set_unset(
        {PREEMPTION_WATCHER_ENV_VAR: "0", API_SERVER_ENV_VAR: f"http://127.0.0.1:{port}"}
    )
    try:
        ray.init(
            address=LOCAL,
            num_cpus=cpus,
            object_store_memory=config.ray.object_store_mb * 1024 * 1024,
            dashboard_port=port,
            log_to_driver=True,
        )
    except BaseException:
        for name in env:
            os.environ.pop(name, None)
        raise
    return env


def _set_unset(values: dict[str, str]) -> tuple[str, ...]:
    """Set each variable that is not set yet; returns the ones set."""
    fresh = tuple(name for name in values if name not in os.environ)
    for name in fresh:
        os.environ[name] = values[name]
    return fresh


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _chosen_address(config: Config) -> tuple[str | None, str]:
    """(address to join, how it was found), or (None, ...) to start a local Ray."""
    if config.ray.address:
        given, origin = config.ray.address.strip(), "ray.address"
    elif os.environ.get("RAY_ADDRESS"):
        given, origin = os.environ["RAY_ADDRESS"].strip(), "RAY_ADDRESS"
    else:
        recorded = recorded_cluster()
        return (recorded, RECORDED) if recorded else (None, STARTED)
    if given == LOCAL:
        return None, STARTED
    if "://" in given and not given.startswith(CLIENT_SCHEME):
        raise ConfigError(
            f"config key ray.address: {origin}={given!r} is not a Ray cluster address; give "
            "the head's GCS address (host:6379), a Ray Client address (ray://host:10001), "
            f"'{AUTO}' or '{LOCAL}' (a job API address such as http://host:8265 is for "
            "`ray job submit --address`)"
        )
    return given, origin


def recorded_cluster() -> str | None:
    """The address of the cluster that the last `ray start --head` on this machine
    recorded (what `ray.init()` without an address joins), or None when there is none or
    nothing answers there any more (a head that was killed leaves its record behind)."""
    try:
        from ray._private.services import find_bootstrap_address
    except ImportError:  # a Ray that moved its lookup: behave as on a machine without one
        log.debug("this Ray has no find_bootstrap_address: not looking for a running cluster")
        return None
    address = find_bootstrap_address(None)
    if not address:
        return None
    if not _answers(address):
        log.info("the Ray cluster recorded at %s no longer answers: starting a local Ray", address)
        return None
    return address


def _all_on_this_machine() -> bool:
    """Whether every alive node of the joined cluster runs on the driver's machine (no
    node can then be preempted apart from the driver's)."""
    here = ray.util.get_node_ip_address()
    return all(n["NodeManagerAddress"] == here for n in ray.nodes() if n.get("Alive"))


def _check_reachable(address: str, origin: str) -> None:
    if address == AUTO or _answers(address):
        return
    raise ClusterError(
        f"cannot join the Ray cluster at {address} ({origin}): nothing accepts a connection "
        f"there within {REACH_TIMEOUT_S:g} s; check that the head runs and the address and "
        f"port are right, or set ray.address={LOCAL} to train on a local Ray of the run's own"
    )


def _answers(address: str) -> bool:
    """Whether host:port (or ray://host:port) accepts a TCP connection."""
    host, _, port = address.removeprefix(CLIENT_SCHEME).rpartition(":")
    if not host or not port.isdigit():
        return True  # not host:port: Ray itself judges it
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=REACH_TIMEOUT_S):
            return True
    except OSError:
        return False


def check_room(config: Config, num_workers: int, connection: Connection) -> bool:
    """Whether the workers take a GPU each, checked against the cluster's resources.

    Raises:
        ClusterError: the cluster has fewer GPUs (or, training on CPU, CPUs) than
            `num_workers`.
    """
    resources = ray.cluster_resources()
    gpus, cpus = int(resources.get("GPU", 0)), int(resources.get("CPU", 0))
    device = config.train.device
    use_gpu = device is Device.CUDA or (device is Device.AUTO and gpus > 0)
    have, kind = (gpus, "GPU") if use_gpu else (cpus, "CPU")
    if have >= num_workers:
        return use_gpu
    what = f"{num_workers} worker(s) need one {kind} each but {connection.describe()} has {have}"
    if connection.address is None:
        fix = "shrink topology.nodes / topology.gpus_per_node"
        fix += " or set train.device=cpu" if use_gpu else " or raise ray.num_cpus"
    else:
        fix = (
            f"add {kind}s to that cluster (`ray start --num-{kind.lower()}s=...`), shrink "
            f"topology.nodes / topology.gpus_per_node, or set ray.address={LOCAL} to train "
            "on a local Ray of the run's own"
        )
        if use_gpu:
            fix += " (or train.device=cpu)"
    raise ClusterError(f"{what}; {fix}")


def check_node_room(topology: Topology, use_gpu: bool) -> None:
    """Whether the cluster's machines hold the topology's nodes whole: the workers of a
    topology node must share one machine (`check_placement` refuses them otherwise), so a
    fixed group on Ray nodes too small for them would only start its workers to fail.

    Raises:
        ClusterError: the alive Ray nodes have room for fewer whole topology nodes than
            the topology has (one worker a GPU, or a CPU on a CPU cluster).
    """
    room = node_room(topology.gpus_per_node, use_gpu)
    if room >= topology.nodes:
        return
    kind, gpus = ("GPU" if use_gpu else "CPU"), topology.gpus_per_node
    raise ClusterError(
        f"config key topology.gpus_per_node={gpus}: the Ray nodes have room for {room} "
        f"whole topology node(s) of {gpus} workers (one {kind} each, a node's workers on one "
        f"machine) and the topology has {topology.nodes}; give each Ray node the {kind}s of "
        f"{gpus} workers, or lower topology.gpus_per_node"
    )
