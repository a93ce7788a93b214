"""Everything checked and decided before any process starts.

`prepare_run` turns a Config into a RunPlan: the topology, the number of
workers and the absolute run directory. It checks the config against its topology
and model (`ray_zep.config.sizes.check_run`, which `ray-zep config` applies too) and
the checkpoint a restart would resume from, opens the dataset and builds the first
batch stream, so a missing or corrupt dataset, an out-of-vocabulary token, an overlong
document under `data.overlong=error` or a checkpoint of another `parallel.ep` fails
here, in one line, before a cluster is touched.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from ray_zep.config import Config, write_resolved_config
from ray_zep.config.sizes import check_run, num_ranks
from ray_zep.config.sizes import least_nodes as least_nodes  # the workers import it from here
from ray_zep.data.batching import BatchStream
from ray_zep.data.catalog import open_configured_source
from ray_zep.distributed import Comm
from ray_zep.model.hf import check_hf_checkpoint
from ray_zep.model_shapes import build_shape
from ray_zep.topology import Topology
from ray_zep.tracking import check_trackers
from ray_zep.train.checkpoint_dirs import resume_checkpoint


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


def create_comm(
    config: Config,
    topology: Topology,
    timeout_s: float | None = None,
    group: dist.ProcessGroup | None = None,
) -> Comm:
    """This process's Comm for the run (checks the number of processes it needs), over the
    default group or `group` (made with the run's timeout)."""
    return Comm.create(
        topology,
        num_ranks(config, topology),
        config.comm.timeout_s if timeout_s is None else timeout_s,
        group,
        why=f"parallel.sequence={config.parallel.sequence.value}",
    )


def prepare_run(config: Config, write_config: bool = True) -> RunPlan:
    """Validate a config against its data and run directory.

    Raises:
        ZepError subclasses naming the key, path or value to fix.
    """
    topology = check_run(config)
    expected = num_ranks(config, topology)
    run_dir = Path(config.train.out_dir).expanduser().resolve()
    config = dataclasses.replace(
        config, train=dataclasses.replace(config.train, out_dir=str(run_dir))
    )
    # headers and settings first: a refusal there comes before the data is read (on a
    # fresh machine, before the default dataset is built)
    check_trackers(config.metrics)
    if config.model.init_from:
        check_hf_checkpoint(config.model.init_from, build_shape(config.model))
    _check_data(config, topology)
    resume_checkpoint(run_dir, config.train.resume, config.parallel.ep)
    if write_config:
        write_resolved_config(config, run_dir)
    return RunPlan(config, topology, expected, run_dir)


def _check_data(config: Config, topology: Topology) -> None:
    BatchStream.from_config(open_configured_source(config), config, topology.world_size)
