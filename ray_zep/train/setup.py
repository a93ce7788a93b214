"""Everything checked and decided before any process starts.

`prepare_run` turns a Config into a RunPlan: the topology, the number of
workers and the absolute run directory. It checks the checkpoint a restart
would resume from, opens the dataset and builds the first batch stream, so a
missing or corrupt dataset, an out-of-vocabulary token, an overlong document
under `data.overlong=error` or a mismatched checkpoint fails here, in one
line, before a cluster is touched.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from ray_zep.config import Config, write_resolved_config
from ray_zep.data.batching import BatchStream
from ray_zep.data.catalog import open_configured_source
from ray_zep.errors import TopologyError
from ray_zep.mesh import num_ranks
from ray_zep.topology import Topology, build_topology
from ray_zep.train.checkpoint import resume_checkpoint


@dataclass(frozen=True)
class RunPlan:
    """A validated run, ready to launch.

    Attributes:
        config: the config with `train.out_dir` made absolute.
        topology: the topology the job runs on (or emulates).
        num_workers: training processes (1 for `single`).
        run_dir: absolute run directory.
    """

    config: Config
    topology: Topology
    num_workers: int
    run_dir: Path


def prepare_run(config: Config, write_config: bool = True) -> RunPlan:
    """Validate a config against its data and run directory.

    Raises:
        ZepError subclasses naming the key, path or value to fix.
    """
    topology = build_topology(config.topology)
    expected = num_ranks(config.parallel.strategy, topology)
    wanted = config.ray.num_workers
    if wanted is not None and wanted != expected:
        raise TopologyError(
            f"config key ray.num_workers={wanted}: parallel.strategy="
            f"{config.parallel.strategy.value} on topology.nodes={topology.nodes} x "
            f"topology.gpus_per_node={topology.gpus_per_node} runs {expected} worker(s)"
        )
    run_dir = Path(config.train.out_dir).expanduser().resolve()
    config = dataclasses.replace(
        config, train=dataclasses.replace(config.train, out_dir=str(run_dir))
    )
    _check_data(config, topology)
    resume_checkpoint(run_dir, config.train.resume, expected)
    if write_config:
        write_resolved_config(config, run_dir)
    return RunPlan(config, topology, expected, run_dir)


def _check_data(config: Config, topology: Topology) -> None:
    BatchStream.from_config(open_configured_source(config), config, topology.world_size)
