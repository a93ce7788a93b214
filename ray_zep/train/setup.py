"""Everything checked and decided before any process starts.

`prepare_run` turns a Config into a RunPlan: the topology, the number of
workers, the absolute run directory, the checkpoint to resume from. It opens
the dataset and builds the first batch stream, so a missing or corrupt
dataset, an out-of-vocabulary token, an overlong document under
`data.overlong=error` or a mismatched checkpoint fails here, in one line,
before a cluster is touched.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from ray_zep import constants
from ray_zep.config import Config, ResumeMode, Strategy, write_resolved_config
from ray_zep.data.batching import BatchStream
from ray_zep.data.catalog import open_source
from ray_zep.errors import CheckpointError, TopologyError
from ray_zep.model.shapes import ModelShape, build_shape
from ray_zep.topology import Topology, build_topology
from ray_zep.train.checkpoint import latest_checkpoint


@dataclass(frozen=True)
class RunPlan:
    """A validated run, ready to launch.

    Attributes:
        config: the config with `train.out_dir` made absolute.
        topology: the topology the job runs on (or emulates).
        shape: the model's shape.
        num_workers: training processes (1 for `single`).
        run_dir: absolute run directory.
        resume_from: the checkpoint a restart would load, if any.
    """

    config: Config
    topology: Topology
    shape: ModelShape
    num_workers: int
    run_dir: Path
    resume_from: Path | None


def prepare_run(config: Config, write_config: bool = True) -> RunPlan:
    """Validate a config against its data and run directory.

    Raises:
        ZepError subclasses naming the key, path or value to fix.
    """
    topology = build_topology(config.topology)
    shape = build_shape(config.model)
    expected = 1 if config.parallel.strategy is Strategy.SINGLE else topology.world_size
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
    _check_data(config, topology, shape)
    resume_from = _check_resume(run_dir, config.train.resume, expected)
    if write_config:
        write_resolved_config(config, run_dir)
    return RunPlan(config, topology, shape, expected, run_dir, resume_from)


def _check_data(config: Config, topology: Topology, shape: ModelShape) -> None:
    data = config.data
    source = open_source(data.source, shape.vocab_size, config.train.seed, data.length_scale)
    BatchStream(
        source,
        world=topology.world_size,
        tokens_per_rank=config.train.tokens_per_rank,
        packing=data.packing,
        max_doc_tokens=data.max_doc_tokens,
        overlong=data.overlong,
        seed=config.train.seed,
        shuffle=data.shuffle,
    )


def _check_resume(run_dir: Path, resume: ResumeMode, workers: int) -> Path | None:
    found = latest_checkpoint(run_dir)
    if found is None:
        return None
    if resume is ResumeMode.NEVER:
        raise CheckpointError(
            f"train.out_dir={str(run_dir)!r} already holds checkpoints and train.resume=never; "
            "choose a new train.out_dir or train.resume=auto"
        )
    saved = json.loads((found / constants.CHECKPOINT_COMPLETE_MARKER).read_text())
    if saved.get("world_size") != workers:
        raise CheckpointError(
            f"checkpoint {found} was saved by {saved.get('world_size')} rank(s) but this run "
            f"has {workers}; resume with the same topology and strategy or use a new "
            "train.out_dir"
        )
    return found
